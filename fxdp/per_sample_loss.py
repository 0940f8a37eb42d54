"""Each sample's own loss for a Hugging Face model, as its own loss computes it from ``labels`` but per sample
(torch only: :mod:`fxdp.integrations.transformers` re-exports these, and ``make_private`` uses them for a model
called with ``labels``).

A loss a transformers model computes from ``labels`` is averaged over the whole batch (over all its tokens, for a
language model), which would make each sample's gradient depend on the others. :func:`per_sample_loss` gives one
loss per sample instead; its mean over the batch is a loss DP-SGD can clip per sample."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # the label Hugging Face collators give padding and prompt tokens: not a target

TASKS = ("causal_lm", "tokens", "classification", "regression", "multi_label")


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor, task: str = "causal_lm") -> torch.Tensor:
    """Each sample's own loss, shape ``(N,)``: the mean of it over the batch is a loss DP-SGD can clip per sample.

    ``task``: ``"causal_lm"`` (``labels`` ``(N, T)``; the logits at position t predict the label at t + 1, as
    the models' own loss shifts them), ``"tokens"`` (one label per position, no shift: masked LM, token
    classification), ``"classification"`` (``labels`` ``(N,)``), ``"regression"`` (mean squared error over the
    outputs), ``"multi_label"`` (binary cross-entropy over the labels). For the token tasks a sample's loss is
    the mean over its target tokens (labels of -100 are not targets); a sample without any has loss 0."""
    if task not in TASKS:
        raise ValueError(f"fxdp: per_sample_loss: task must be one of {TASKS}, got {task!r}")
    n = logits.shape[0]
    if task in ("causal_lm", "tokens"):
        if task == "causal_lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="none").view(n, -1)
        targets = labels.ne(IGNORE_INDEX).to(per_token.dtype)
        return (per_token * targets).sum(1) / targets.sum(1).clamp(min=1)
    if task == "classification":
        return F.cross_entropy(logits.reshape(n, -1), labels.reshape(n), reduction="none")
    if task == "regression":
        return F.mse_loss(logits.reshape(n, -1), labels.reshape(n, -1).to(logits.dtype), reduction="none").mean(1)
    return F.binary_cross_entropy_with_logits(logits.reshape(n, -1), labels.reshape(n, -1).to(logits.dtype),
                                              reduction="none").mean(1)


def per_sample_mean(values: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The batch's loss as a mean of each sample's own mean: the fix for a loss normalised by the whole batch.

    ``values``: per-element losses with the batch first, ``(N, ...)`` (a loss function's ``reduction="none"``);
    ``weights``: broadcastable to ``values`` (a mask such as ``labels != -100``, or weights per element). Each
    sample's loss is ``sum(w * v) / sum(w)`` over its own elements (0 for a sample whose weights sum to 0), and
    the result is their mean over the batch, so sample i's gradient is what sample i alone would give. A mean
    over all the batch's tokens (or a weighted mean) divides instead by a count that every sample sets, which
    DP-SGD's clipping does not bound."""
    n = values.shape[0]  # (no branch on the values: torch.fx traces this where a criterion calls it)
    weights = torch.ones_like(values) if weights is None else torch.broadcast_to(weights, values.shape).to(values.dtype)
    total = (values * weights).reshape(n, -1).sum(1)
    count = weights.reshape(n, -1).sum(1)
    counted = count != 0
    return torch.where(counted, total / torch.where(counted, count, torch.ones_like(count)),
                       torch.zeros_like(total)).mean()


def task_of(model: nn.Module) -> str:
    """The :func:`per_sample_loss` task of a transformers model (a peft model's base model), from its class name
    and config, as the model's own loss decides it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if name.endswith(("ForMaskedLM", "ForTokenClassification")):
        return "tokens"
    if name.endswith("ForSequenceClassification"):
        config = base.config
        if config.problem_type == "regression" or (config.problem_type is None and config.num_labels == 1):
            return "regression"
        return "multi_label" if config.problem_type == "multi_label_classification" else "classification"
    raise ValueError(f"fxdp: cannot tell which loss {name} is trained with; compute each sample's loss yourself "
                     "(DPTrainer: per_sample_loss=lambda outputs, labels: ..., one loss per sample, shape (N,))")
