"""Book-keeping of ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d``: the weight as a Linear layer on the unfolded input
``(N, L, C_in * k)`` per group, ghost norm or per-sample gradient (whichever costs less); its clipped sum is
the convolution's own weight gradient with G's rows scaled by the clip factors; the bias as G summed over
the spatial positions."""

from __future__ import annotations

import math

import torch
from torch import nn

from fxdp.grad_sample.conv import conv_grad_sample
from fxdp.grad_sample.conv_padding import pad_activations
from fxdp.sinks.bookkeeping.linear import ghost_norms
from fxdp.sinks.bookkeeping.registry import LayerBookkeeping, LayerPlan, pick
from fxdp.sinks.bookkeeping.uses import Summed, Use


class ConvWeight(Use):
    """Weight of a Conv layer, from its input A (N, C_in, *S) and output gradient G (N, C_out, *L)."""

    def __init__(self, module: nn.Module, a: torch.Tensor, g: torch.Tensor, method: str, scale: float = 1.0):
        self.module, self.a, self.g, self.method, self.scale = module, a.to(g.dtype), g, method, scale
        self.batch_size = g.shape[0]

    def grad_samples(self):
        gs = conv_grad_sample(self.module, [self.a], self.g)[self.module.weight]
        return gs * self.scale if self.scale != 1.0 else gs

    def squared_norms(self):
        if self.method != "ghost":
            return super().squared_norms()
        n, groups = self.batch_size, self.module.groups
        u = _patches(self.module, self.a)  # (N * groups, L, k * C_in / groups)
        g = self.g.reshape(n * groups, -1, u.shape[1]).transpose(1, 2)  # (N * groups, L, C_out / groups)
        return ghost_norms(u, g).view(n, groups).sum(1) * self.scale ** 2

    def clipped_sum(self, c):
        m = self.module
        x, padding = pad_activations(m, self.a)
        g = self.g * (c * self.scale).to(self.g.dtype).view(-1, *[1] * (self.g.dim() - 1))
        _, weight_grad, _ = torch.ops.aten.convolution_backward(
            g, x, m.weight.detach().to(g.dtype), None, list(m.stride), list(padding), list(m.dilation),
            False, [0] * len(padding), m.groups, [False, True, False],
        )
        return weight_grad


def _patches(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The convolution's input patches per sample and group, ``(N * groups, L, prod(k) * C_in / groups)``,
    for any number of spatial dims, stride, padding and dilation. Channels are innermost (one copy of a
    channels-last view: faster than unfolding channels-first); the columns are then not in the weight's
    order, which the Gram matrix ``U U^T`` does not see."""
    x, padding = pad_activations(module, x)
    if any(padding):
        x = torch.nn.functional.pad(x, [p for p in reversed(padding) for _ in (0, 1)])
    x = x.movedim(1, -1).contiguous()  # (N, *S, C)
    n, spatial, c, groups = x.shape[0], x.shape[1:-1], x.shape[-1], module.groups
    out = [(size - d * (k - 1) - 1) // s + 1
           for size, k, s, d in zip(spatial, module.kernel_size, module.stride, module.dilation)]
    steps = [x.stride(1 + j) for j in range(len(spatial))]
    windows = x.as_strided(
        (n, *out, *module.kernel_size, groups, c // groups),
        (x.stride(0), *[st * s for st, s in zip(steps, module.stride)],
         *[st * d for st, d in zip(steps, module.dilation)], c // groups, 1),
    )
    return windows.movedim(1 + 2 * len(spatial), 1).reshape(n * groups, math.prod(out), -1)


def _as_autocast_would(x, weight, bias):
    """The operands cast as autocast casts a convolution's (``F.conv2d`` is on its list of ops, the
    ``torch.convolution`` called here is not): to autocast's dtype, when autocast is on for ``x``'s device."""
    device = x.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _convolution(module: nn.Module):
    """``fn(x, weight, bias)``: the layer's convolution (its padding mode included) of these tensors."""
    def fn(x, weight, bias):
        x, padding = pad_activations(module, x)
        x, weight, bias = _as_autocast_would(x, weight, bias)
        return torch.convolution(x, weight, bias, list(module.stride), list(padding), list(module.dilation), False,
                                 [0] * len(padding), module.groups)

    return fn


class ConvBookkeeping(LayerBookkeeping):
    rule = conv_grad_sample

    def plan(self, module, a, g, prefer):
        name, nd = type(module).__name__, len(module.kernel_size)
        if len(a) != nd + 2 or len(g) != nd + 2 or a[0] != g[0]:
            return LayerPlan(name, "materialise", f"input {tuple(a)} is not batched (N, C, *spatial)")
        length, k = math.prod(g[2:]), math.prod(module.kernel_size)
        groups = module.groups
        cin_g, cout_g = module.in_channels // groups, module.out_channels // groups
        ghost = length * cin_g * groups * k + groups * length * length * (cin_g * k + cout_g)  # unfold + grams
        per_sample = length * groups * cin_g * k * cout_g
        return pick(name, ghost, per_sample, prefer, f"L={length}, C_in*k={cin_g * k}, C_out={cout_g}, groups={groups}")

    def uses(self, captured, sink):
        out = {}
        for p in captured.params:
            if p is captured.module.bias:  # summed over the spatial positions
                out[p] = Summed(captured.g.flatten(2).sum(2), captured.scale)
            else:
                out[p] = ConvWeight(captured.module, captured.a, captured.g, captured.method, captured.scale)
        return out

    def functional_forward(self, module, x):
        if x.dim() != len(module.kernel_size) + 2:
            return None
        return _convolution(module), (module.weight, module.bias)
