"""Catalogue models that let samples influence each other, each at the line marked ``# MIX``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .sizes import D, E, N


class _Base(nn.Module):
    """A Linear in front, so the mixing op sees a computed per-sample tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)


class CenterWithBatchMean(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0, keepdim=True)  # MIX


class FullSum(_Base):
    def forward(self, x):
        h = self.lin(x)
        total = h.sum()  # MIX
        return h / total


class MaxOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h - h.max(0).values  # MIX


class MinOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h - torch.min(h, dim=0, keepdim=True).values  # MIX


class StdOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h / h.std(0)  # MIX


class VarOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h / torch.var(h, dim=0)  # MIX


class NormOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h / h.norm(dim=0)  # MIX


class LogSumExpOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h - torch.logsumexp(h, 0)  # MIX


class ProdOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h * h.prod(0)  # MIX


class AmaxOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h - h.amax(dim=0)  # MIX


class BatchNormTraining(_Base):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(E)

    def forward(self, x):
        h = self.lin(x)
        return self.bn(h)  # MIX


class FunctionalBatchNorm(_Base):
    def forward(self, x):
        h = self.lin(x)
        return F.batch_norm(h, None, None, training=True)  # MIX


class SoftmaxOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h.softmax(0)  # MIX


class LogSoftmaxOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return F.log_softmax(h, dim=0)  # MIX


class CumsumOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return torch.cumsum(h, dim=0)  # MIX


class CumprodOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h.cumprod(0)  # MIX


class SortOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return torch.sort(h, dim=0).values  # MIX


class ArgsortOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        order = h.argsort(dim=0)  # MIX
        return h * order


class TopkOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h.topk(2, dim=0).values  # MIX


class RollOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h - torch.roll(h, 1, 0)  # MIX


class FlipOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h + h.flip(0)  # MIX


class AdjacencyMatmul(_Base):
    """A graph convolution over the batch: every sample is a node."""

    def __init__(self):
        super().__init__()
        self.adj = nn.Parameter(torch.full((N, N), 1.0 / N))

    def forward(self, x):
        h = self.lin(x)
        return self.adj @ h  # MIX


class GramEinsum(_Base):
    def forward(self, x):
        h = self.lin(x)
        gram = torch.einsum("nd,ne->de", h, h)  # MIX
        return h @ gram


class BmmOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = self.lin(x)
        a = h.permute(1, 2, 0)
        b = h.transpose(0, 1)
        return torch.bmm(a, b)  # MIX


class PairwiseDifferences(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h.unsqueeze(1) - h.unsqueeze(0)  # MIX


class CatSharedRow(_Base):
    def __init__(self):
        super().__init__()
        self.extra = nn.Parameter(torch.zeros(1, E))

    def forward(self, x):
        h = self.lin(x)
        return torch.cat([h, self.extra], dim=0)  # MIX


class FirstSampleBroadcast(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h + h[0]  # MIX


class ShuffleByIndex(_Base):
    def __init__(self):
        super().__init__()
        self.register_buffer("perm", torch.randperm(N))

    def forward(self, x):
        h = self.lin(x)
        return h - h[self.perm]  # MIX


class IndexSelectBatch(_Base):
    def __init__(self):
        super().__init__()
        self.register_buffer("idx", torch.tensor([0, 0, 1, 1]))

    def forward(self, x):
        h = self.lin(x)
        return h.index_select(0, self.idx)  # MIX


class GatherBatch(_Base):
    def __init__(self):
        super().__init__()
        self.register_buffer("idx", torch.zeros(N, E, dtype=torch.long))

    def forward(self, x):
        h = self.lin(x)
        return torch.gather(h, 0, self.idx)  # MIX


class NormalizeOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return F.normalize(h, dim=0)  # MIX


class LayerNormOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return F.layer_norm(h, h.shape)  # MIX


class ConvBatchInChannels(nn.Module):
    """(N, L) -> (1, N, L): the Conv1d takes the batch for its channels."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(N, 4, 3)

    def forward(self, x):
        h = x.unsqueeze(0)
        return self.conv(h)  # MIX


class LinearOnBatch(nn.Module):
    """x.T puts the batch in the feature position, which the Linear contracts."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(N, E)

    def forward(self, x):
        h = x.T
        return self.lin(h)  # MIX


class LSTMWrongBatchFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(D, E)  # expects (T, N, D), receives (N, T, D)

    def forward(self, x):
        out, _ = self.lstm(x)  # MIX
        return out


class MHAWrongBatchFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2)  # expects (T, N, D), receives (N, T, D)

    def forward(self, x):
        y, _ = self.attn(x, x, x)  # MIX
        return y


class LossInsideModel(_Base):
    def forward(self, x, y):
        logits = self.lin(x)
        return F.cross_entropy(logits, y)  # MIX


class ConsecutiveDifference(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h[1:] - h[:-1]  # MIX


class ChunkBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        first, second = h.chunk(2, 0)  # MIX
        return first * second


class CdistPairs(_Base):
    def forward(self, x):
        h = self.lin(x)
        return torch.cdist(h, h)  # MIX


class AttentionOverBatch(_Base):
    def forward(self, x):
        h = self.lin(x)
        return F.scaled_dot_product_attention(h, h, h)  # MIX


class WriteAcrossSamples(_Base):
    def __init__(self):
        super().__init__()
        self.register_buffer("perm", torch.tensor([1, 0, 3, 2]))

    def forward(self, x):
        h = self.lin(x)
        out = torch.zeros_like(h)
        out[self.perm] = h  # MIX
        return out
