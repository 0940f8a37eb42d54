"""The forward half of book-keeping: layers called so that backward computes their input gradients only. For a
layer the sink book-keeps, the sink's clipped sum replaces the weight gradient, so computing it in backward too
would be wasted.

Which layers, and what they compute as a function of their parameters, the sink says through the contract
(:meth:`~fxdp.sinks.contract.GradientSink.functional_forward`: the book-keeping sink answers from the layer type's
registration); this module only calls. Where the layer's input needs a gradient, the layer runs on detached
parameters: its output stays in the graph through the input, and autograd's own backward (in C++) computes the
input gradient alone. Where it does not (the first layer, on data), the output would then need no gradient at
all, and the layer's output gradient, which the sink needs, would never be computed: an autograd Function
takes the parameters as inputs, so that the output needs a gradient, and returns none for anything."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fxdp.sinks.contract import GradientSink


class _PositionalFunction(torch.autograd.Function):
    """An autograd Function called with positional arguments only. ``Function.apply`` binds them with
    ``inspect.signature`` on every call (as costly as a small layer's forward); outside functorch transforms
    this goes straight to autograd's own ``apply``, as ``Function.apply`` then does itself."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*args)


class _OutputNeedsGradOnly(_PositionalFunction):
    """``fn(x, *params)`` whose backward computes nothing: ``x`` needs no gradient, and the parameters'
    gradients are the sink's. Its output needs a gradient, so the output gradient the sink reads is formed."""

    @staticmethod
    def forward(fn, x, *params):
        return fn(x, *params)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.inputs = len(inputs)

    @staticmethod
    def backward(ctx, grad):
        return (None,) * ctx.inputs


def _detached(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach()


def call_without_param_grads(sink: Optional[GradientSink], module: nn.Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` with the same output, whose backward gives input gradients but no
    parameter gradients, for a layer whose parameter gradients ``sink`` forms itself. Returns ``None`` where
    that does not apply: the caller then calls the layer as usual."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
        return None
    forward = None if sink is None else sink.functional_forward(module, args[0])
    if forward is None:
        return None
    fn, params = forward
    x = args[0]
    if x.requires_grad:  # the output needs the graph through x only: autograd's own backward, in C++
        return fn(x, *[_detached(p) for p in params])
    return _OutputNeedsGradOnly.apply(fn, x, *params)
