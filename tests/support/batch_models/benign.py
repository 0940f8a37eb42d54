"""Catalogue models that keep samples apart and the batch in place (or move it only where it comes back)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .sizes import C, D, E, HW, T


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)


class SelfAttention(nn.Module):
    """Multi-head attention written out: the transpose(1, 2) keeps the batch at dim 0."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).triu(1))

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(n, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(n, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(n, t, self.heads, d // self.heads).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(self.causal, float("-inf")).softmax(dim=-1)
        y = (scores @ v).transpose(1, 2).reshape(n, t, d)
        return self.out(y)


class PermuteAndBack(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        h = self.conv(x.permute(0, 2, 1))
        return self.lin(h.permute(0, 2, 1))


class TransposeBackToBack(nn.Module):
    """The batch leaves dim 0 and comes back before anything computes with it: not a finding."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        h = x.transpose(0, 1).contiguous().transpose(0, 1)
        return self.lin(h)


class ConvFlatten(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, 4, 3, padding=1)
        self.lin = nn.Linear(4 * HW * HW, 2)

    def forward(self, x):
        return self.lin(self.conv(x).flatten(1))


class ConvViewN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, 4, 3)
        self.lin = nn.Linear(4 * (HW - 2) ** 2, 2)

    def forward(self, x):
        h = self.conv(x)
        return self.lin(h.view(h.size(0), -1))


class BroadcastParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))
        self.shift = nn.Parameter(torch.zeros(1, D))
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        return self.lin(x * self.scale + self.shift)


class MaskInput(nn.Module):
    """A (T, T) mask input is not batched: it broadcasts against every sample."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x, mask):
        h = self.proj(x)
        scores = (h @ h.transpose(1, 2)).masked_fill(mask, -1e9).softmax(-1)
        return scores @ h


class PositionIds(nn.Module):
    """Position ids of shape (1, T) broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, D)
        self.pos = nn.Embedding(T, D)
        self.lin = nn.Linear(D, 2)

    def forward(self, tokens, positions):
        return self.lin(self.tok(tokens) + self.pos(positions))


class TimeMajorLSTM(nn.Module):
    """Time-major input (T, N, D), analysed with batch_dim=1."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(D, E)
        self.lin = nn.Linear(E, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.lin(out[-1])


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(C, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class KeywordInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, bias=None, scale: float = 1.0):
        h = self.lin(x) * scale
        return h if bias is None else h + bias


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, E)
        self.b = nn.Linear(5, E)
        self.head = nn.Linear(2 * E, 2)

    def forward(self, a, b):
        return self.head(torch.cat([self.a(a), self.b(b)], dim=1))


class MHABatchFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.lin = nn.Linear(D, 2)

    def forward(self, x, padding):
        y, _ = self.attn(x, x, x, key_padding_mask=padding)
        return self.lin(y)


class LSTMBatchFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(D, E, num_layers=2, batch_first=True)
        self.lin = nn.Linear(E, 2)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.lin(h[-1]) + self.lin(out[:, -1])


class EmbeddingMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, D)
        self.lin = nn.Linear(D, 2)

    def forward(self, tokens):
        return self.lin(self.emb(tokens).mean(1))


class BatchNormEval(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)
        self.bn = nn.BatchNorm1d(E)

    def forward(self, x):
        return self.bn(self.lin(x))


class PickPerSample(nn.Module):
    """x[arange(N), labels] picks one entry per sample: the arange lines up with the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 5)

    def forward(self, x, labels):
        h = self.lin(x)
        return h[torch.arange(h.size(0)), labels]


class FeatureOps(nn.Module):
    """Softmax, norms, reductions and scans over per-sample dimensions only."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = self.lin(x)
        a = h.softmax(-1) + F.layer_norm(h, h.shape[1:]) + F.normalize(h, dim=1)
        b = h.cumsum(1) + h.max(dim=1).values.unsqueeze(1) + h.std(1, keepdim=True)
        c = h.sort(dim=-1).values + h.flip(-1) + torch.logsumexp(h, dim=1, keepdim=True)
        return a + b + c + h.sum(-1, keepdim=True)


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        return self.lin(self.enc(x)[:, 0])


class TimeMajorMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2)
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        y, _ = self.attn(x, x, x)
        return self.lin(y)


class EinsumPerSample(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, E) / D)

    def forward(self, x):
        h = torch.einsum("ntd,de->nte", x, self.w)
        return torch.einsum("nte,nse->nts", h, h)


class ClassToken(nn.Module):
    """ViT-style: a parameter expanded to every sample and concatenated along the sequence."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        tokens = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1)
        return self.lin(tokens)[:, 0]


class GatherPerSample(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x, idx):
        return torch.gather(self.lin(x), 1, idx)


class SDPAPerSample(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.size(0), T, 3, 2, D // 2).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class WritePerSampleColumns(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)
        self.head = nn.Linear(E, 2)

    def forward(self, x):
        h = self.lin(x)
        buf = h.new_zeros(h.size(0), E)
        buf[:, :2] = h[:, :2]
        return self.head(buf)
