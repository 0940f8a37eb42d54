"""Layers called so that backward computes their input gradients only: for a book-kept layer the sink's
clipped sum replaces the weight gradient, so computing it in backward too would be wasted.

Where the layer's input needs a gradient, the layer runs on detached parameters: its output stays in the
graph through the input, and autograd's own backward (in C++) computes the input gradient alone. Where it
does not (the first layer, on data), the output would then need no gradient at all, and the layer's
output gradient, which the sink needs, would never be computed: an autograd Function takes the parameters
as inputs, so that the output needs a gradient, and returns none for them."""

from __future__ import annotations

import torch
from torch import nn

from fxdp.grad_sample.conv import _pad_activations, conv_grad_sample
from fxdp.grad_sample.embedding import embedding_grad_sample
from fxdp.grad_sample.linear import is_transformers_conv1d, linear_grad_sample
from fxdp.sinks.bookkeeping.plans import _CONVS, _own_rule  # (temporary)


class _PositionalFunction(torch.autograd.Function):
    """An autograd Function called with positional arguments only. ``Function.apply`` binds them with
    ``inspect.signature`` on every call (about 40 us, as much as a small layer's forward); outside functorch
    transforms this goes straight to autograd's own ``apply``, as ``Function.apply`` then does itself."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*args)


class _LinearInputGradOnly(_PositionalFunction):
    """``F.linear`` whose backward computes the input gradient only: the weight gradient, the product
    the sink forms later with re-weighted rows, is not computed twice."""

    @staticmethod
    def forward(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return (grad.matmul(weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None), None, None


class _ConvInputGradOnly(_PositionalFunction):
    """A convolution (input already padded as the layer pads it) whose backward computes the input
    gradient only."""

    @staticmethod
    def forward(x, weight, bias, stride, padding, dilation, groups):
        return torch.convolution(x, weight, bias, stride, padding, dilation, False, [0] * len(padding), groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs
        ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        x, weight = ctx.saved_tensors
        grad_x, _, _ = torch.ops.aten.convolution_backward(
            grad, x, weight, None, ctx.stride, ctx.padding, ctx.dilation, False, [0] * len(ctx.padding),
            ctx.groups, [True, False, False],
        )
        return (grad_x,) + (None,) * 6


class _EmbeddingNoGrad(_PositionalFunction):
    """A lookup whose backward computes nothing (indices have no gradient; the weight's is the sink's)."""

    @staticmethod
    def forward(indices, weight, padding_idx):
        return torch.nn.functional.embedding(indices, weight, padding_idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return None, None, None


def _as_autocast_would(x, weight, bias):
    """The operands cast as autocast casts a convolution's (``F.conv2d`` is on its list of ops, the
    ``torch.convolution`` called here is not): to autocast's dtype, when autocast is on for ``x``'s device."""
    device = x.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _detached(t):
    return None if t is None else t.detach()


def call_without_param_grads(module: nn.Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` with the same output, whose backward gives input gradients but no
    parameter gradients — for a layer the sink book-keeps (its clipped sum replaces the weight
    gradient). Returns ``None`` where that does not apply: the caller then calls the layer as usual."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
        return None
    x = args[0]
    if _own_rule(module, nn.Linear, linear_grad_sample):
        if x.requires_grad:  # the output needs the graph through x only: autograd's own backward, in C++
            return torch.nn.functional.linear(x, module.weight.detach(), _detached(module.bias))
        return _LinearInputGradOnly.apply(x, module.weight, module.bias)
    if is_transformers_conv1d(module):  # x @ W + b, W stored (in, out)
        if x.requires_grad:
            return torch.nn.functional.linear(x, module.weight.detach().t(), _detached(module.bias))
        return _LinearInputGradOnly.apply(x, module.weight.t(), module.bias)
    if _own_rule(module, _CONVS, conv_grad_sample) and x.dim() == len(module.kernel_size) + 2:
        x, padding = _pad_activations(module, x)
        x, weight, bias = _as_autocast_would(x, module.weight, module.bias)
        if x.requires_grad:
            return torch.convolution(x, weight.detach(), _detached(bias), list(module.stride),
                                     list(padding), list(module.dilation), False, [0] * len(padding), module.groups)
        return _ConvInputGradOnly.apply(x, weight, bias, list(module.stride), list(padding),
                                        list(module.dilation), module.groups)
    if (_own_rule(module, nn.Embedding, embedding_grad_sample) and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse):
        return _EmbeddingNoGrad.apply(x, module.weight, module.padding_idx)
    return None

