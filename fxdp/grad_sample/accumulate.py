"""From (activations, backprops) to ``p.grad_sample``: the step every engine shares.

Conventions (the same as the incumbent's, so code written for it keeps working):

- ``p.grad_sample[i]`` is the gradient sample i alone would give in a batch of one. With
  ``loss_reduction="mean"`` the backprops carry a ``1/N`` factor, which is undone here.
- Within one backward pass, the uses of a parameter add up (tied weights, a module called twice).
- Successive backward passes without clearing append along dimension 0: after two backward passes
  over batches of N1 and N2 samples, ``p.grad_sample`` has shape ``(N1 + N2, *p.shape)``, one row per
  sample seen (as with gradient accumulation over virtual batches). Clear it with
  :func:`zero_grad_sample` (the DP optimizer does) before the next logical batch.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from fxdp.grad_sample.registry import find_grad_sampler

LOSS_REDUCTIONS = ("mean", "sum")


def check_loss_reduction(loss_reduction: str) -> None:
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")


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
    or the generic functorch rule when it has none.
    """
    if batch_size == 0:
        # An empty batch (Poisson sampling; a rank's empty share): rules reshape with -1, which zero
        # elements make ambiguous. Run the rule on one zero sample and keep none of its rows, so each
        # parameter it covers gets a (0, *p.shape) per-sample gradient.
        one = [a.new_zeros((1, *a.shape[1:])) if isinstance(a, torch.Tensor) else a for a in activations]
        grad_samples = compute_grad_samples(module, one, backprops.new_zeros((1, *backprops.shape[1:])),
                                            loss_reduction=loss_reduction, batch_size=1)
        return {p: g[:0] for p, g in grad_samples.items()}
    rule = find_grad_sampler(module)
    if rule is None:
        from fxdp.grad_sample.functorch_rule import functorch_grad_sampler

        rule = functorch_grad_sampler
    if loss_reduction == "mean":
        backprops = backprops * batch_size
    grad_samples = rule(module, activations, backprops)
    return {p: g for p, g in grad_samples.items() if p.requires_grad}


class _PendingGradSamples:
    """Sums per-sample gradients within one backward pass and publishes them when it ends."""

    def __init__(self):
        self.current: Dict[int, torch.Tensor] = {}
        self.params: Dict[int, nn.Parameter] = {}
        self.task = None  # the autograd graph task (one backward call) the sums belong to

    def add(self, param: nn.Parameter, grad_sample: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != self.task:
            # a new backward pass; sums left by one that raised before finishing are dropped
            self.current.clear()
            self.params.clear()
            self.task = task
            # runs once, when the autograd engine finishes this backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self.publish)
        key = id(param)
        if key in self.current:
            self.current[key] = self.current[key] + grad_sample
        else:
            self.current[key] = grad_sample
            self.params[key] = param

    def publish(self) -> None:
        for key, grad_sample in self.current.items():
            param = self.params[key]
            previous = getattr(param, "grad_sample", None)
            if previous is None:
                param.grad_sample = grad_sample
            else:
                param.grad_sample = torch.cat([previous, grad_sample], dim=0)
        self.current.clear()
        self.params.clear()
        self.task = None


_PENDING = _PendingGradSamples()


def accumulate_grad_samples(grad_samples: Dict[nn.Parameter, torch.Tensor], batch_size: Optional[int] = None) -> None:
    """Add per-sample gradients computed during a backward pass (call only from backward hooks).
    With ``batch_size``, each must have exactly one row per sample of the batch."""
    for param, grad_sample in grad_samples.items():
        if batch_size is not None and grad_sample.shape[0] != batch_size:
            raise RuntimeError(
                f"fxdp: per-sample gradients with {grad_sample.shape[0]} rows for a batch of {batch_size} samples "
                f"(parameter of shape {tuple(param.shape)}); where the batch sits was recorded wrongly. Pass "
                "example_inputs with more than one sample to compile_for_dp"
            )
        if grad_sample.shape[1:] != param.shape:
            raise RuntimeError(
                f"fxdp: a per-sample rule returned shape {tuple(grad_sample.shape)} for a parameter of "
                f"shape {tuple(param.shape)}; expected (N, *{tuple(param.shape)})"
            )
        _PENDING.add(param, grad_sample.detach())


def zero_grad_sample(module_or_params) -> None:
    """Remove ``p.grad_sample`` from every parameter of a module (or from an iterable of parameters)."""
    params: Iterable[nn.Parameter] = (
        module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    )
    for p in params:
        if hasattr(p, "grad_sample"):
            p.grad_sample = None
