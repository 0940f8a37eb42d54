"""The example inputs ``make_private`` takes from a data loader's batch, for a model torch.fx cannot trace (captured
with torch.export from them), and which of them hold one row per sample."""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
from typing import Any, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader

from fxdp.data.loader import first_samples_batch
from fxdp.diagnostics.report import REPORT_ATTR

# what a Hugging Face collator names the targets (the Trainer's default label names, and the datasets' own)
LABEL_KEYS = ("labels", "label", "label_ids")
_LOADER_SAMPLES = 2  # the dataset's first samples make_private captures a model from


@dataclasses.dataclass
class LoaderInputs:
    """The example inputs make_private took from the data loader, and the label keys it left out."""

    inputs: Any
    labels: Tuple[str, ...]
    batch_inputs: Tuple[str, ...]  # the inputs that hold one row per sample of the loader's batch

    def mark(self, compiled: nn.Module, task: Optional[str]) -> None:
        """Say in the report where the graph came from, and what the labels left out do (``task``: the loss they
        give, see :func:`fxdp.model_labels.labels_outside_the_graph`)."""
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in self.inputs.items() if isinstance(v, torch.Tensor)) \
            if isinstance(self.inputs, dict) else f"{tuple(self.inputs.shape)}"
        left = ""
        if self.labels:
            left = (f"; left out: {', '.join(self.labels)} (given to the private model, they give each sample's own "
                    f"{task} loss, computed outside the graph: fxdp.per_sample_loss)" if task else
                    f"; left out: {', '.join(self.labels)} (the loss belongs outside the model)")
        elif task:  # a tuple batch: its labels are not named, but the model takes them as a user calls it
            left = (f"; labels= given to the private model give each sample's own {task} loss, computed outside "
                    f"the graph: fxdp.per_sample_loss")
        rep = getattr(compiled, REPORT_ATTR)
        did = "captured the model" if rep.front_end == "torch.export" else "tried to capture the model (see the reason)"
        setattr(compiled, REPORT_ATTR, dataclasses.replace(rep, notes=(
            *rep.notes, f"make_private {did} from a batch of the data loader's first samples "
                        f"({shapes}){left}; the loader's sampling was not touched")))


def inputs_from_the_loader(module: nn.Module, data_loader: DataLoader, batch_dim: int) -> Optional[LoaderInputs]:
    """The model's inputs in a batch of the dataset's first samples (:func:`fxdp.data.loader.first_samples_batch`:
    the loader's sampling and the random generators untouched): a dict batch (Hugging Face collators) gives the
    keyword inputs ``forward`` names, its labels left out; a tensor is the input; a tuple or list gives its first
    item (``for x, y in loader: model(x)``). ``None`` when the batch holds nothing of the kind. A ``forward`` that
    takes ``**kwargs`` (a peft model's) is given every tensor of a dict batch but its labels.

    The loader's collate makes one row per sample of every tensor it puts in a batch: the inputs taken from the
    batch with as many rows at ``batch_dim`` as it has samples are the batched inputs (``batch_inputs``), known
    rather than found from the graph."""
    batch = first_samples_batch(data_loader, size=_LOADER_SAMPLES)
    if batch is None:
        return None
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], (torch.Tensor, collections.abc.Mapping)):
        batch = batch[0]
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = None
    samples = min(_LOADER_SAMPLES, len(data_loader.dataset))

    def per_sample(value) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() > batch_dim and value.shape[batch_dim] == samples

    if isinstance(batch, torch.Tensor):
        first = next((p.name for p in params or () if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
        return LoaderInputs(batch, (), (first,) if first is not None and per_sample(batch) else ())
    if not isinstance(batch, collections.abc.Mapping) or params is None:
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    # a forward(**kwargs) (a peft model's) passes on what it does not name: the batch's tensors are what the training
    # loop's model(**batch) gives it (a call with other keywords is captured again for them)
    passes_on = any(p.kind is p.VAR_KEYWORD for p in params)
    inputs = {k: v for k, v in batch.items() if k not in LABEL_KEYS and (
        k in named or passes_on and isinstance(k, str) and k.isidentifier() and isinstance(v, torch.Tensor))}
    batched = tuple(k for k, v in inputs.items() if per_sample(v))
    return LoaderInputs(inputs, tuple(k for k in batch if k in LABEL_KEYS), batched) if inputs else None
