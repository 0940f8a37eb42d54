"""The labels of a model whose ``forward`` takes them (a transformers model), when make_private compiled it from
example inputs without them: given to the private model, they give each sample's own loss for the model's task, or,
where fxdp does not know the model's loss, they are refused with why."""

from __future__ import annotations

import collections.abc
import inspect
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from fxdp.compiler import report
from fxdp.data.example_inputs import LABEL_KEYS
from fxdp.diagnostics import UnsupportedInputError
from fxdp.per_sample_loss import per_sample_loss, task_of


def labels_outside_the_graph(compiled: nn.Module, module: nn.Module, example_inputs: Any,
                             loss_reduction: str) -> Optional[str]:
    """A model whose ``forward`` takes labels (a transformers model), compiled from example inputs without them
    (given, or captured from the data loader): given to the private model, they give each sample's own loss for the
    model's task (:class:`LabelsAsPerSampleLoss`; the task is returned), or, where fxdp does not know the model's
    loss, are refused with why (:class:`LabelsLeftOut`)."""
    if example_inputs is None:  # traced from forward's code: the graph takes what forward takes
        return None
    named = _named_inputs(module)
    given = set(example_inputs) if isinstance(example_inputs, collections.abc.Mapping) else set()
    labels = tuple(k for k in LABEL_KEYS if k in named and k not in given)
    if not labels or report(compiled).engine not in ("fx", "hooks"):
        return None
    try:
        task = task_of(module)
    except ValueError:
        compiled.register_forward_pre_hook(LabelsLeftOut(labels), with_kwargs=True)
        return None
    LabelsAsPerSampleLoss(labels, task, loss_reduction).attach(compiled)
    return task


def _named_inputs(module: nn.Module) -> set:
    """The inputs ``module.forward`` names; for a wrapper whose ``forward(*args, **kwargs)`` names none (a peft model
    made without ``task_type``), those of the model it passes its inputs to (``get_base_model()``)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    named = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if not named and hasattr(module, "get_base_model") and module.get_base_model() is not module:
        return _named_inputs(module.get_base_model())
    return named


class LabelsAsPerSampleLoss:
    """A compiled model captured without the batch's labels takes them as a transformers model does, and returns
    its output with ``loss`` first, as the model would, but each sample's own loss (:func:`fxdp.per_sample_loss.
    per_sample_loss` for the model's task) reduced over the batch as the DP optimizer expects (mean or sum).

    The model's own loss from ``labels`` is averaged over the whole batch (over all its tokens, for a language
    model), so each sample's gradient would depend on the others; here the labels never enter the graph. For a
    causal language model each sample's loss is the mean over its own target tokens (the model's is weighted by
    token, over the batch); for classification the two are equal."""

    def __init__(self, labels: Tuple[str, ...], task: str, loss_reduction: str):
        self.labels, self.task, self.loss_reduction = labels, task, loss_reduction
        self._taken: List[Optional[torch.Tensor]] = []  # the labels of each call in progress (calls may nest)

    def attach(self, compiled: nn.Module) -> None:
        compiled.register_forward_pre_hook(self, with_kwargs=True)
        compiled.register_forward_hook(self.give, with_kwargs=True, always_call=True)

    @property
    def fxdp_outside_inputs(self) -> Tuple[str, ...]:  # what the captured graph never takes (a graph captured again
        return self.labels                              # for another call leaves them out too)

    def __call__(self, module, args, kwargs):  # the forward pre-hook
        given = [k for k in self.labels if kwargs.get(k) is not None]
        if len(given) > 1:
            raise UnsupportedInputError(f"fxdp: the private model was given labels twice ({', '.join(given)}); "
                                        "give one")
        self._taken.append(kwargs[given[0]] if given else None)
        return args, {k: v for k, v in kwargs.items() if k not in self.labels}

    def give(self, module, args, kwargs, output):
        labels = self._taken.pop() if self._taken else None
        if labels is None or output is None:  # (no labels; or forward raised: the hook is always called)
            return None
        logits = output["logits"] if isinstance(output, collections.abc.Mapping) else output[0]
        losses = per_sample_loss(logits, labels, self.task)
        loss = losses.mean() if self.loss_reduction == "mean" else losses.sum()
        if isinstance(output, tuple):  # return_dict=False: (loss, logits, ...), as the model returns it
            return (loss, *output)
        return type(output)(loss=loss, **output)


class LabelsLeftOut:
    """A compiled model captured without the batch's labels, of a model whose loss fxdp does not know, refuses
    them, saying why (a loss averaged inside the model over the batch mixes the samples) and what to do."""

    def __init__(self, labels: Tuple[str, ...]):
        self.labels = self.fxdp_outside_inputs = labels

    def __call__(self, module, args, kwargs):
        given = [k for k in self.labels if k in kwargs]
        if given:
            raise UnsupportedInputError(
                f"fxdp: the private model was given {', '.join(map(repr, given))}, which make_private compiled the "
                "model without (its example inputs, or the data loader's first batch): with labels, the model "
                "computes its loss itself, averaged over the whole batch (over all its tokens, for a language "
                "model), so each sample's gradient would depend on the other samples, and fxdp cannot tell which "
                "loss this model computes (it knows the transformers models ...ForCausalLM, "
                "...ForSequenceClassification, ...ForMaskedLM, ...ForTokenClassification). Call the model without "
                "them and compute each sample's loss outside it (fxdp.per_sample_loss.per_sample_loss(outputs.logits, "
                "labels, task) does), with the mean over the batch as the loss; or train with "
                "fxdp.integrations.transformers.DPTrainer")
        return None
