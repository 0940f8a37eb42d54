"""From (activations, backprops) to per-sample gradients: the step every engine shares.

Conventions (the same as the incumbent's, so code written for it keeps working):

- ``p.grad_sample[i]`` is the gradient sample i alone would give in a batch of one. With
  ``loss_reduction="mean"`` the backprops carry a ``1/N`` factor, which
  :func:`~fxdp.grad_sample.generic.summed_loss_backprops` undoes.
- Within one backward pass, the uses of a parameter add up (tied weights, a module called twice).
- One row per sample of the batch until cleared: the forward calls and backward passes of one batch
  (two views, two losses) add up per sample; a backward pass over another batch is appended along
  dimension 0 (``(N1 + N2, *p.shape)``), and the DP optimizer refuses to step on it. Clear it with
  :func:`zero_grad_sample` (the DP optimizer does) before the next batch.

The last two are the materialising sink's (:class:`~fxdp.grad_sample.sink.GradSampleSink`): engines
hand it one :class:`~fxdp.grad_sample.sink.LayerCapture` per layer and backward pass
(:func:`layer_capture`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional

import torch
from torch import nn

from fxdp.grad_sample.generic import (
    AutocastState,
    generic_grad_sampler,
    summed_loss_backprops,
    under_autocast,
)
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.grad_sample.sink import LayerCapture


def trainable_parameters(module: nn.Module) -> Dict[str, nn.Parameter]:
    """The parameters of ``module`` (and its submodules) that require gradients, by name, each once, as
    ``named_parameters`` lists them. A layer without submodules is read directly: DP-aware ops ask at
    every call, and ``named_parameters`` walks the module tree."""
    if module._modules:
        return {name: p for name, p in module.named_parameters() if p.requires_grad}
    out, seen = {}, set()
    for name, p in module._parameters.items():
        if p is not None and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


def float32_if_half(t: Any) -> Any:
    """A floating tensor of half precision (bfloat16, float16) in float32; anything else as it is.

    Per-sample arithmetic (hand-written rules, norms, clipped sums) reads A and G through this: its results
    then hold the float32 products of the half-precision values the layer computed with, so each sample's
    norm is that of the very gradient that is clipped and summed, and a sum over the batch is not rounded
    to 8 mantissa bits (a rounding of the sum that grows with the batch would break the sensitivity bound).
    Under autocast it also gives A and G one dtype (a float32 input, a bfloat16 output gradient)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() < 4:
        return t.float()
    return t


def compute_grad_samples(
    module: nn.Module,
    activations: List[torch.Tensor],
    backprops: torch.Tensor,
    *,
    loss_reduction: str,
    batch_size: int,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``module``'s trainable parameters, batch first.

    ``activations`` and ``backprops`` are batch first already. The module's registered rule is used,
    or the generic rule when it has none.
    """
    rule = find_grad_sampler(module) or generic_grad_sampler
    grad_samples = rule(module, activations, summed_loss_backprops(backprops, loss_reduction, batch_size))
    return {p: g for p, g in grad_samples.items() if p.requires_grad}


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
) -> LayerCapture:
    """What a layer hands its model's sink: ``activations`` and ``backprops`` are batch first, the
    backprops those of a summed loss once multiplied by ``backprops_scale`` (left to the capture: see
    :class:`~fxdp.grad_sample.sink.LayerCapture`). With a hand-written rule (unless ``generic``) the
    capture carries the layer, A and G (the rule sees neither ``kwargs`` nor ``batch_dim``); otherwise only
    the generic rule's thunk, which re-runs each sample with the batch at ``batch_dim`` (the layer's own
    layout), under ``autocast`` (the autocast settings of the layer's forward, see
    :func:`~fxdp.grad_sample.generic.autocast_state`). A hand-written rule sees half-precision A and G in
    float32 (:func:`float32_if_half`)."""
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

    rule = None if generic else find_grad_sampler(module)
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
            return summed(lambda g: rerun(module, activations, g, batch_dim=batch_dim, kwargs=kwargs))

    return LayerCapture(batch_size, generic, params=params)


def zero_grad_sample(module_or_params) -> None:
    """Remove ``p.grad_sample`` from every parameter of a module (or from an iterable of parameters)."""
    params: Iterable[nn.Parameter] = (
        module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    )
    for p in params:
        if hasattr(p, "grad_sample"):
            p.grad_sample = None
