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

The last two are the materialising sink's (:class:`~fxdp.sinks.contract.GradSampleSink`): engines
hand it one :class:`~fxdp.sinks.contract.LayerCapture` per layer and backward pass
(:func:`fxdp.sinks.capture.layer_capture`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List

import torch
from torch import nn

from fxdp.grad_sample.generic import (
    AutocastState,
    generic_grad_sampler,
    summed_loss_backprops,
)
from fxdp.grad_sample.registry import find_grad_sampler


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


def zero_grad_sample(module_or_params) -> None:
    """Remove ``p.grad_sample`` from every parameter of a module (or from an iterable of parameters)."""
    params: Iterable[nn.Parameter] = (
        module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    )
    for p in params:
        if hasattr(p, "grad_sample"):
            p.grad_sample = None
