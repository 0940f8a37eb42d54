"""The ``functorch`` engine (``grad_sample_mode="functorch"``): per-sample gradients of the whole model
at once, with the generic rule (``vmap`` over the samples of ``vjp`` through
``functional_call(model, params, x_i)``) run in a hook on the model's output.

It differs from the compiled graph's whole-model fallback (``fx+whole-model``, :mod:`fxdp.engines.whole_model`),
which knows where the batch sits in every input and output from the batch_dim pass: here positional
tensor arguments carry the batch (at dim 0, or 1 with ``batch_first=False``), keyword arguments are
passed unchanged to every sample, and the model must return one tensor. Random ops (dropout in
training mode) cannot be replayed per sample and make vmap raise.
"""

from __future__ import annotations

from typing import Any

import torch

from fxdp.engines.base import GradSampleModuleBase, ParameterWatch
from fxdp.grad_sample.sink import SINK_ATTR


class FunctorchGradSampleModule(GradSampleModuleBase):
    """The whole model under the generic rule (see the module docstring)."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._parameter_watch = ParameterWatch(model)

    def forward(self, *args, **kwargs):
        self.forward_calls += 1
        self._parameter_watch.check(getattr(self, SINK_ATTR))
        out = self._module(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"fxdp: grad_sample_mode='functorch' differentiates the model's output, which must be a "
                f"single tensor, but {type(self._module).__name__}.forward returned {_describe(out)}. "
                "Use grad_sample_mode='fx' or 'hooks', or wrap the model so that forward returns one tensor."
            )
        if out.requires_grad and any(p.requires_grad for p in self._module.parameters()):
            activations = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            out.register_hook(self._output_hook(self._module, activations, kwargs, generic=True))
        return out


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} values"
    return f"a {type(value).__name__}"
