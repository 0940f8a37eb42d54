"""The ``ew`` engine: PyTorch's ExpandedWeights (``torch.nn.utils._per_sample_grad``), for models made of
the layers it knows, batch first.

ExpandedWeights writes ``p.grad_sample`` itself, so this engine delivers no captures to its sink; the
sink's read side (:class:`~fxdp.grad_sample.sink.GradSampleSink`) reads ``p.grad_sample``.
"""

from __future__ import annotations

import traceback
from typing import Dict, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxdp.diagnostics import PerSampleError, location_from_traceback
from fxdp.engines.base import GradSampleModuleBase, trainable_own_params
from fxdp.grad_sample.sink import GradientSink

# The layers whose functional ops ExpandedWeights implements (F.linear, F.conv*, F.embedding,
# F.group_norm, F.instance_norm, F.layer_norm). Its RNN support is partial, so RNNs are not listed.
EW_SUPPORTED_LAYERS = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Embedding,
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
)



class ExpandedWeightsGradSampleModule(GradSampleModuleBase):
    """PyTorch's ExpandedWeights: the forward runs with every trainable parameter replaced by an
    ``ExpandedWeight``, whose backward writes ``grad_sample`` directly.

    ExpandedWeights would add a second backward's per-sample gradients onto the first; this wrapper
    sets the earlier ones aside when a backward pass starts and appends the new rows when it ends,
    as the other engines do.
    """

    def __init__(self, model: nn.Module, batch_first: bool = True, loss_reduction: str = "mean", *,
                 sink: Optional[GradientSink] = None):
        if not batch_first:
            raise ValueError(
                "fxdp: grad_sample_mode='ew' (PyTorch ExpandedWeights) needs the batch in dimension 0 of "
                "every layer's input; batch_first=False is not supported. Use grad_sample_mode='fx', "
                "'hooks' or 'functorch', or make the model batch first."
            )
        super().__init__(model, batch_first=batch_first, loss_reduction=loss_reduction, sink=sink)
        unsupported = [
            f"'{name or '<model>'}' ({type(m).__name__})"
            for name, m in model.named_modules()
            if trainable_own_params(m) and not isinstance(m, EW_SUPPORTED_LAYERS)
        ]
        if unsupported:
            raise ValueError(
                "fxdp: grad_sample_mode='ew' (PyTorch ExpandedWeights) cannot compute per-sample "
                "gradients for the parameters of " + ", ".join(unsupported) + "; it supports "
                + ", ".join(t.__name__ for t in EW_SUPPORTED_LAYERS)
                + ". Use grad_sample_mode='fx', 'hooks' or 'functorch', or freeze those parameters."
            )
        self._in_backward = False

    def forward(self, *args, **kwargs):
        from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

        self._in_backward = False
        batch_size = _leading_size(args, kwargs)
        if batch_size == 0:  # ExpandedWeights refuses an empty batch: no rows to compute
            return self._empty_batch_forward(args, kwargs)
        params = [p for p in self._module.parameters() if p.requires_grad]
        # call_for_per_sample_grads refuses parameters that still hold grad_sample; ours append
        # across backward passes, so hide them while it checks.
        hidden = _take_grad_samples(params)
        try:
            per_sample_forward = call_for_per_sample_grads(
                self._module, batch_size=batch_size, loss_reduction=self.loss_reduction
            )
        finally:
            _restore_grad_samples(hidden)
        try:
            out = per_sample_forward(*args, **kwargs)
        except RuntimeError as e:
            if "Expanded Weights" not in str(e) and "ExpandedWeights" not in str(e):
                raise
            raise PerSampleError(self._explain(e)) from e
        if torch.is_grad_enabled():
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._backward_starts)
        return out

    def _empty_batch_forward(self, args, kwargs):
        out = self._module(*args, **kwargs)
        params = [p for p in self._module.parameters() if p.requires_grad]

        def add_no_rows() -> None:
            for p in params:
                if getattr(p, "grad_sample", None) is None:
                    p.grad_sample = p.new_zeros((0, *p.shape))

        def hook(grad: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(add_no_rows)

        if torch.is_grad_enabled():
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
                    break
        return out

    def _backward_starts(self, grad: torch.Tensor) -> None:
        # Runs before any layer's backward (outputs come last in the forward), once per backward.
        if self._in_backward:
            return
        self._in_backward = True
        earlier = _take_grad_samples(self._module.parameters())

        def backward_ends() -> None:
            for p, previous in earlier.items():
                new = getattr(p, "grad_sample", None)
                p.grad_sample = previous if new is None else torch.cat([previous, new], dim=0)
            self._in_backward = False

        torch.autograd.Variable._execution_engine.queue_callback(backward_ends)

    def _explain(self, error: RuntimeError) -> str:
        """Name the innermost module of the model that was running when ExpandedWeights gave up."""
        names = {id(m): name or "<model>" for name, m in self._module.named_modules()}
        culprit = None
        for frame, _ in traceback.walk_tb(error.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                culprit = owner
        where = f" in module '{names[id(culprit)]}' ({type(culprit).__name__})" if culprit is not None else ""
        location = location_from_traceback(error.__traceback__)
        if location is not None:
            where += f" at {location} ({location.code})" if location.code else f" at {location}"
        return (
            f"fxdp: grad_sample_mode='ew' (PyTorch ExpandedWeights) failed{where}: {error}. "
            "ExpandedWeights only handles parameters passed to F.linear, F.conv*, F.embedding, "
            "F.group_norm, F.instance_norm and F.layer_norm; use grad_sample_mode='fx', 'hooks' or "
            "'functorch' for this model."
        )


def _take_grad_samples(params) -> Dict[nn.Parameter, torch.Tensor]:
    taken = {}
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if gs is not None:
            taken[p] = gs
            p.grad_sample = None
    return taken


def _restore_grad_samples(taken: Dict[nn.Parameter, torch.Tensor]) -> None:
    for p, gs in taken.items():
        p.grad_sample = gs


def _leading_size(args, kwargs) -> int:
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    raise ValueError(
        "fxdp: grad_sample_mode='ew' found no tensor argument to read the batch size from"
    )
