"""Small re-implementations of what torchvision's classification models call, for tests/end_to_end/test_real_models.py.

torchvision cannot be installed next to the CPU torch here (PyPI's wheel needs CUDA torch), so these
are small re-implementations made to look like torchvision to fxdp: the functions live in modules
named as torchvision's (not put in sys.modules, so a real torchvision is not shadowed) and are
wrapped for fx the way torchvision wraps them. LayerNorm2d (ConvNeXt's) is a LayerNorm subclass that
overrides forward; the window attention indexes a parameter table by a constant buffer.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

_OPS_SOURCE = '''
import torch
import torch.fx
from torch import nn


def stochastic_depth(input, p, mode, training=True):
    if not training or p == 0.0:
        return input
    survival = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device).bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return input * noise


torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    def __init__(self, p, mode):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, input):
        return stochastic_depth(input, self.p, self.mode, self.training)


class Permute(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)
'''

_SWIN_SOURCE = '''
import torch
import torch.fx
import torch.nn.functional as F


def _patch_merging_pad(x):
    H, W, _ = x.shape[-3:]
    x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
    return torch.cat([x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :], x[..., 0::2, 1::2, :], x[..., 1::2, 1::2, :]], -1)


torch.fx.wrap("_patch_merging_pad")


def _get_relative_position_bias(table, index, window_size):
    n = window_size[0] * window_size[1]
    return table[index].view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)


torch.fx.wrap("_get_relative_position_bias")


def _shift_mask(x, pH, pW, ws, shift):
    mask = x.new_zeros((pH, pW))
    count = 0
    for h in ((0, -ws[0]), (-ws[0], -shift[0]), (-shift[0], None)):
        for w in ((0, -ws[1]), (-ws[1], -shift[1]), (-shift[1], None)):
            mask[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    mask = mask.view(pH // ws[0], ws[0], pW // ws[1], ws[1]).permute(0, 2, 1, 3).reshape(-1, ws[0] * ws[1])
    mask = mask.unsqueeze(1) - mask.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


def shifted_window_attention(input, qkv_weight, proj_weight, relative_position_bias, window_size, num_heads,
                             shift_size, attention_dropout=0.0, dropout=0.0, qkv_bias=None, proj_bias=None,
                             training=True):
    B, H, W, C = input.shape
    ws = window_size
    x = F.pad(input, (0, 0, 0, (ws[1] - W % ws[1]) % ws[1], 0, (ws[0] - H % ws[0]) % ws[0]))
    _, pH, pW, _ = x.shape
    shift = [0 if ws[0] >= pH else shift_size[0], 0 if ws[1] >= pW else shift_size[1]]
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    nh, nw = pH // ws[0], pW // ws[1]
    x = x.view(B, nh, ws[0], nw, ws[1], C).permute(0, 1, 3, 2, 4, 5).reshape(B * nh * nw, ws[0] * ws[1], C)
    qkv = F.linear(x, qkv_weight, qkv_bias).reshape(x.size(0), x.size(1), 3, num_heads, C // num_heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    attn = (q * (C // num_heads) ** -0.5).matmul(k.transpose(-2, -1)) + relative_position_bias
    if sum(shift) > 0:
        mask = _shift_mask(x, pH, pW, ws, shift)
        attn = attn.view(B, nh * nw, num_heads, x.size(1), x.size(1)) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, num_heads, x.size(1), x.size(1))
    attn = F.dropout(F.softmax(attn, dim=-1), p=attention_dropout, training=training)
    x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), C)
    x = F.dropout(F.linear(x, proj_weight, proj_bias), p=dropout, training=training)
    x = x.view(B, nh, nw, ws[0], ws[1], C).permute(0, 1, 3, 2, 4, 5).reshape(B, pH, pW, C)
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
    return x[:, :H, :W, :].contiguous()


torch.fx.wrap("shifted_window_attention")
'''


def _module_named(name: str, source: str):
    module = types.ModuleType(name)  # not in sys.modules: a real torchvision is not shadowed
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


tv_ops = _module_named("torchvision.ops.stochastic_depth", _OPS_SOURCE)
tv_swin = _module_named("torchvision.models.swin_transformer", _SWIN_SOURCE)
StochasticDepth, Permute = tv_ops.StochasticDepth, tv_ops.Permute


class LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's: a LayerNorm subclass that overrides forward to normalise channels of (N, C, H, W)."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    def __init__(self, dim, p):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, groups=dim), Permute([0, 2, 3, 1]),
                                   nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim),
                                   Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.rand(dim, 1, 1))
        self.stochastic_depth = StochasticDepth(p, "row")

    def forward(self, input):
        result = self.stochastic_depth(self.layer_scale * self.block(input))
        result += input
        return result


def tiny_convnext(p=0.0):
    return nn.Sequential(nn.Conv2d(3, 4, 2, 2), LayerNorm2d(4), CNBlock(4, p), LayerNorm2d(4), nn.Conv2d(4, 6, 2, 2),
                         CNBlock(6, p), nn.AdaptiveAvgPool2d(1), LayerNorm2d(6), nn.Flatten(1), nn.Linear(6, 3))


class SqueezeExcitation(nn.Module):
    def __init__(self, c, squeezed):
        super().__init__()
        self.avgpool, self.fc1, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, squeezed, 1), nn.Conv2d(squeezed, c, 1)
        self.activation, self.scale_activation = nn.SiLU(), nn.Sigmoid()

    def forward(self, x):
        return self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x))))) * x


class MBConv(nn.Module):
    def __init__(self, c, p):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(c, 2 * c, 1), nn.GroupNorm(2, 2 * c), nn.SiLU(),
                                   nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c), nn.GroupNorm(2, 2 * c), nn.SiLU(),
                                   SqueezeExcitation(2 * c, 2), nn.Conv2d(2 * c, c, 1), nn.GroupNorm(1, c))
        self.stochastic_depth = StochasticDepth(p, "row")

    def forward(self, input):
        result = self.stochastic_depth(self.block(input))
        result += input
        return result


def tiny_efficientnet(p=0.0):
    return nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1), nn.GroupNorm(1, 4), nn.SiLU(), MBConv(4, p), MBConv(4, p),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(4, 3))


class ShiftedWindowAttention(nn.Module):
    def __init__(self, dim, window_size, shift_size, num_heads):
        super().__init__()
        self.window_size, self.shift_size, self.num_heads = window_size, shift_size, num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        ws = window_size
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * ws[0] - 1) * (2 * ws[1] - 1), num_heads))
        coords = torch.stack(torch.meshgrid(torch.arange(ws[0]), torch.arange(ws[1]), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        index = (rel[:, :, 0] + ws[0] - 1) * (2 * ws[1] - 1) + rel[:, :, 1] + ws[1] - 1
        self.register_buffer("relative_position_index", index.flatten())

    def forward(self, x):
        bias = tv_swin._get_relative_position_bias(self.relative_position_bias_table, self.relative_position_index,
                                                   self.window_size)
        return tv_swin.shifted_window_attention(
            x, self.qkv.weight, self.proj.weight, bias, self.window_size, self.num_heads, shift_size=self.shift_size,
            qkv_bias=self.qkv.bias, proj_bias=self.proj.bias, training=self.training)


class SwinBlock(nn.Module):
    def __init__(self, dim, shift, p):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ShiftedWindowAttention(dim, [3, 3], shift, 2)
        self.stochastic_depth = StochasticDepth(p, "row")
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.stochastic_depth(self.attn(self.norm1(x)))
        return x + self.stochastic_depth(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.reduction = nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        return self.reduction(self.norm(tv_swin._patch_merging_pad(x)))


def tiny_swin(p=0.0):
    return nn.Sequential(nn.Conv2d(3, 4, 2, 2), Permute([0, 2, 3, 1]), nn.LayerNorm(4), SwinBlock(4, [0, 0], p),
                         SwinBlock(4, [1, 1], p), PatchMerging(4), nn.LayerNorm(8), Permute([0, 3, 1, 2]),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(8, 3))


TINY = {"efficientnet": tiny_efficientnet, "convnext": tiny_convnext, "swin": tiny_swin}
