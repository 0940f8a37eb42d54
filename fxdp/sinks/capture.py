"""The capture a layer hands its model's sink in backward (:class:`~fxdp.sinks.contract.LayerCapture`), built
from the layer's per-sample rule (or the generic rule): what every engine's DP-aware ops and hooks share.
The contract itself imports nothing from the rules (the optimizer reads only the contract); this module is
where the two meet."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn

from fxdp.grad_sample.accumulate import float32_if_half, trainable_parameters
from fxdp.grad_sample.generic import AutocastState, generic_grad_sampler, under_autocast
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.sinks.contract import LayerCapture

_LOOK_UP = object()  # layer_capture's rule argument when not given: look the layer's rule up


def layer_capture(
    module: nn.Module,
    activations: List[Any],
    backprops: torch.Tensor,
    *,
    batch_size: int,
    batch_dim: int = 0,
    kwargs: Optional[Mapping[str, Any]] = None,
    generic: bool = False,
    backprops_scale: float = 1.0,
    autocast: Optional[AutocastState] = None,
    out_batch_dim: Optional[int] = None,
    params: Optional[tuple] = None,
    rule: Any = _LOOK_UP,
) -> LayerCapture:
    """What a layer hands its model's sink: ``activations`` and ``backprops`` are batch first, the
    backprops those of a summed loss once multiplied by ``backprops_scale`` (left to the capture: see
    :class:`~fxdp.sinks.contract.LayerCapture`). With a hand-written rule (unless ``generic``) the
    capture carries the layer, A and G (the rule sees neither ``kwargs`` nor ``batch_dim``); otherwise only
    the generic rule's thunk, which re-runs each sample with the batch at ``batch_dim`` (the layer's own
    layout; its output's at ``out_batch_dim`` when that differs), under ``autocast`` (the autocast settings of the
    layer's forward, see :func:`~fxdp.grad_sample.generic.autocast_state`). A hand-written rule sees
    half-precision A and G in float32 (:func:`float32_if_half`). ``params`` (the layer's trainable parameters) and
    ``rule`` (its per-sample rule, or ``None``), where the caller has looked them up already for this call."""
    if params is None:
        params = tuple(trainable_parameters(module).values())
    if batch_size == 0:  # an empty batch (Poisson sampling): no rows; rules' reshape(n, -1) cannot take it
        return LayerCapture(0, lambda: {p: p.new_zeros((0, *p.shape)) for p in params}, params=params)

    def summed(compute) -> Dict[nn.Parameter, torch.Tensor]:
        """``compute(G)`` for the summed loss's G. Per-sample gradients are linear in G, so the factor scales
        whichever is smaller: G, or the per-sample gradients (a norm layer's are (N, C), its G (N, C, H, W))."""
        if backprops_scale == 1.0 or not isinstance(backprops, torch.Tensor):
            return compute(backprops)
        if batch_size * sum(p.numel() for p in params) < backprops.numel():
            return {p: g * backprops_scale for p, g in compute(backprops).items()}
        return compute(backprops * backprops_scale)

    rule = None if generic else find_grad_sampler(module) if rule is _LOOK_UP else rule
    if rule is not None:
        activations = [float32_if_half(a) for a in activations]
        backprops = float32_if_half(backprops)

        def grad_samples() -> Dict[nn.Parameter, torch.Tensor]:
            with torch.enable_grad():  # backward hooks run with grad mode off: the CPU LSTM has no backward there
                return {p: g for p, g in summed(lambda g: rule(module, activations, g)).items() if p.requires_grad}

        tensors = tuple(a for a in activations if isinstance(a, torch.Tensor))
        return LayerCapture(batch_size, grad_samples, module, tensors, backprops, params,
                            backprops_scale=backprops_scale)

    def generic() -> Dict[nn.Parameter, torch.Tensor]:
        with torch.enable_grad():
            rerun = under_autocast(autocast, generic_grad_sampler)
            return summed(lambda g: rerun(module, activations, g, batch_dim=batch_dim, kwargs=kwargs,
                                         out_batch_dim=out_batch_dim))

    return LayerCapture(batch_size, generic, params=params)
