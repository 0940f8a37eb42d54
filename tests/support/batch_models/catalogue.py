"""A catalogue of small models for the batch-dimension analysis (and for per-sample-gradient checks).

Each entry has a name, a factory for the model, a factory for its example inputs, its category and,
for the lines the analysis must report, a marker comment on that line of the model's source:

- ``benign``: keeps samples apart and the batch in place (or moves it only where it comes back);
  nothing may be reported;
- ``moves``: moves the batch somewhere a batch-first assumption would miss (each marked ``# MOVE``
  or ``# MOVE <what>``, with the layout the node must record) but keeps samples apart; these models
  return batch-first outputs, work for any batch size (also 1) and have parameters after the move,
  so per-sample gradients can be compared with batches of one;
- ``mixes``: lets samples influence each other at the line marked ``# MIX``.

Expected lines are found from the markers with ``inspect`` (:func:`marker_line`), never written down.

    for entry in by_category("moves"):
        model, inputs = entry.build()
        ...
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fxdp.diagnostics import Kind
from fxdp.layout import BatchLayout

N, T, D, E = 4, 3, 8, 6  # batch, time, features, hidden: all different, so inputs are classified right
C, HW = 3, 6  # image channels and side


@dataclass(frozen=True)
class Expect:
    marker: str  # the comment on the line, without '#': "MIX", "MOVE", "MOVE merge"
    kind: Kind
    layout: Optional[BatchLayout] = None  # for moves: what the node on that line must record


@dataclass(frozen=True)
class CatalogueModel:
    name: str
    factory: Callable[[], nn.Module]
    inputs: Callable[[], Any]  # a tensor, a tuple of positional inputs, or a dict by name
    category: str  # "benign" | "moves" | "mixes"
    expect: Tuple[Expect, ...] = ()
    batch_dim: int = 0

    def build(self):
        torch.manual_seed(0)
        model = self.factory()
        return model, self.inputs()

    @property
    def marker(self) -> Optional[str]:
        return self.expect[0].marker if self.expect else None


def marker_line(model_or_class, marker: str) -> Tuple[str, int]:
    """(file, line) of the line in the model class whose comment is exactly ``# <marker>``."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    lines, start = inspect.getsourcelines(cls)
    hits = [start + i for i, text in enumerate(lines)
            if "#" in text and text.split("#", 1)[1].strip() == marker]
    if len(hits) != 1:
        raise LookupError(f"{cls.__name__} has {len(hits)} lines marked '# {marker}', expected exactly one")
    return inspect.getsourcefile(cls), hits[0]


def _x(*shape, long=False, high=10):
    def make():
        g = torch.Generator().manual_seed(1)
        if long:
            return torch.randint(0, high, shape, generator=g)
        return torch.randn(*shape, generator=g)
    return make


# --------------------------------------------------------------------------------------------
# Benign
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Moves the batch (and keeps samples apart)
# --------------------------------------------------------------------------------------------


class Transpose01(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = x.transpose(0, 1)  # MOVE
        return self.lin(h).transpose(0, 1)


class Permute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = x.permute(1, 0, 2)  # MOVE
        return self.lin(h).permute(1, 0, 2)


class Movedim(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = torch.movedim(x, 0, 1)  # MOVE
        return self.lin(h).movedim(1, 0)


class Swapaxes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = x.swapaxes(0, 1)  # MOVE
        return self.lin(h).swapaxes(0, 1)


class TransposeT(nn.Module):
    """x.T on a (N, D) input: the weight multiplies from the left, the batch sits in the columns.

    (torch.fx creates the node of an attribute such as ``.T`` where it is first used, so the move is
    reported on the line that uses ``x.T``.)
    """

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, D) / D)
        self.head = nn.Linear(E, 2)

    def forward(self, x):
        y = self.weight @ x.T  # MOVE
        return self.head(y.T)


class TransposeMT(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, D) / D)
        self.head = nn.Linear(E, 2)

    def forward(self, x):
        y = torch.mm(self.weight, x.mT)  # MOVE
        return self.head(y.mT)


class ReshapeMerge(nn.Module):
    """(N, T, D) -> (N*T, D): each sample now spans T consecutive rows."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        rows = x.reshape(-1, D)  # MOVE
        return self.lin(rows).view(x.size(0), T, E)


class TimeMajorMergeSplit(nn.Module):
    """Batch to dim 1, merged into (T*N, D), then split back out as (T, N, E) for a time-major GRU."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)
        self.gru = nn.GRU(E, E)

    def forward(self, x):
        t = x.transpose(0, 1)  # MOVE transpose
        rows = t.reshape(-1, D)  # MOVE merge
        h = self.lin(rows)
        s = h.view(T, -1, E)  # MOVE split
        out, _ = self.gru(s)
        return out.transpose(0, 1)


class Unsqueeze0(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = x.unsqueeze(0)  # MOVE
        return self.lin(h).squeeze(0)


class Flatten01(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        rows = x.flatten(0, 1)  # MOVE
        return self.lin(rows).unflatten(0, (x.size(0), T))


class PermutedImage(nn.Module):
    """(N, C, H, W) -> (H, W, N, C): a Linear over channels, then back to (N, E, H, W)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(C, 4)

    def forward(self, x):
        h = x.permute(2, 3, 0, 1)  # MOVE
        return self.lin(h).permute(2, 3, 0, 1)


class StackTwoViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, E)
        self.b = nn.Linear(D, E)
        self.head = nn.Linear(E, 2)

    def forward(self, x):
        views = torch.stack([self.a(x), self.b(x)])  # MOVE
        return self.head(views).sum(0)


class CatTwoViews(nn.Module):
    """SimCLR-style: two views through one encoder as a (2N, D) batch, split back afterwards."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D, E)

    def forward(self, x1, x2):
        both = torch.cat([x1, x2])  # MOVE
        a, b = self.enc(both).chunk(2)
        return a * b


class FeaturesIntoRows(nn.Module):
    """(N, 2D) viewed as (2N, D): each sample's two halves become consecutive rows."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        rows = x.view(-1, D)  # MOVE
        return self.lin(rows).view(x.size(0), -1)


class TimeMajorRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(D, E)
        self.lin = nn.Linear(E, 2)

    def forward(self, x):
        seq = x.transpose(0, 1)  # MOVE
        out, _ = self.rnn(seq)
        return self.lin(out.transpose(0, 1))


# --------------------------------------------------------------------------------------------
# Mixes samples (each op in its own model)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------------


def _eval(factory):
    return lambda: factory().eval()


MIX = (Expect("MIX", Kind.MIXES_SAMPLES),)


def _move(layout: BatchLayout, marker: str = "MOVE") -> Expect:
    return Expect(marker, Kind.MOVES_BATCH, layout)


CATALOGUE: List[CatalogueModel] = [
    # benign
    CatalogueModel("mlp", MLP, _x(N, D), "benign"),
    CatalogueModel("attention_transpose_1_2", SelfAttention, _x(N, T, D), "benign"),
    CatalogueModel("permute_and_back", PermuteAndBack, _x(N, T, D), "benign"),
    CatalogueModel("transpose_back_to_back", TransposeBackToBack, _x(N, T, D), "benign"),
    CatalogueModel("flatten_from_dim_1", ConvFlatten, _x(N, C, HW, HW), "benign"),
    CatalogueModel("view_n_minus_1", ConvViewN, _x(N, C, HW, HW), "benign"),
    CatalogueModel("broadcast_parameters", BroadcastParameters, _x(N, D), "benign"),
    CatalogueModel("unbatched_mask_input", MaskInput,
                   lambda: (_x(N, T, D)(), torch.ones(T, T, dtype=torch.bool).triu(1)), "benign"),
    CatalogueModel("position_ids_1_T", PositionIds,
                   lambda: (_x(N, T, long=True)(), torch.arange(T).unsqueeze(0)), "benign"),
    CatalogueModel("time_major_lstm_batch_dim_1", TimeMajorLSTM, _x(T, N, D), "benign", batch_dim=1),
    CatalogueModel("conv_net", ConvNet, _x(N, C, HW, HW), "benign"),
    CatalogueModel("keyword_inputs", KeywordInputs,
                   lambda: {"x": _x(N, D)(), "bias": torch.ones(D), "scale": 2.0}, "benign"),
    CatalogueModel("two_inputs", TwoInputs, lambda: (_x(N, D)(), _x(N, 5)()), "benign"),
    CatalogueModel("mha_batch_first_padding_mask", MHABatchFirst,
                   lambda: (_x(N, T, D)(), torch.zeros(N, T, dtype=torch.bool)), "benign"),
    CatalogueModel("lstm_batch_first", LSTMBatchFirst, _x(N, T, D), "benign"),
    CatalogueModel("embedding_mean_over_time", EmbeddingMean, _x(N, T, long=True), "benign"),
    CatalogueModel("batchnorm_eval", _eval(BatchNormEval), _x(N, D), "benign"),
    CatalogueModel("pick_per_sample_arange", PickPerSample,
                   lambda: (_x(N, D)(), torch.tensor([0, 4, 2, 1])), "benign"),
    CatalogueModel("per_sample_feature_ops", FeatureOps, _x(N, D), "benign"),
    CatalogueModel("transformer_encoder_layer", EncoderLayer, _x(N, T, D), "benign"),
    CatalogueModel("time_major_mha_batch_dim_1", TimeMajorMHA, _x(T, N, D), "benign", batch_dim=1),
    CatalogueModel("einsum_per_sample", EinsumPerSample, _x(N, T, D), "benign"),
    CatalogueModel("class_token_expand_cat", ClassToken, _x(N, T, D), "benign"),
    CatalogueModel("gather_per_sample", GatherPerSample,
                   lambda: (_x(N, D)(), torch.zeros(N, 2, dtype=torch.long)), "benign"),
    CatalogueModel("sdpa_per_sample", SDPAPerSample, _x(N, T, D), "benign"),
    CatalogueModel("write_per_sample_columns", WritePerSampleColumns, _x(N, D), "benign"),
    # moves the batch
    CatalogueModel("transpose_0_1", Transpose01, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("permute", Permute, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("movedim", Movedim, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("swapaxes", Swapaxes, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("dot_T_2d", TransposeT, _x(N, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("dot_mT_2d", TransposeMT, _x(N, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("reshape_merge_n_t", ReshapeMerge, _x(N, T, D), "moves", (_move(BatchLayout.merged(0, T)),)),
    CatalogueModel("time_major_merge_then_view_split", TimeMajorMergeSplit, _x(N, T, D), "moves",
                   (_move(BatchLayout.at(1), "MOVE transpose"), _move(BatchLayout.merged(0, 1), "MOVE merge"),
                    _move(BatchLayout.at(1), "MOVE split"))),
    CatalogueModel("unsqueeze_0", Unsqueeze0, _x(N, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("flatten_0_1", Flatten01, _x(N, T, D), "moves", (_move(BatchLayout.merged(0, T)),)),
    CatalogueModel("permuted_image", PermutedImage, _x(N, C, HW, HW), "moves", (_move(BatchLayout.at(2)),)),
    CatalogueModel("stack_two_views", StackTwoViews, _x(N, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("cat_two_views_along_batch", CatTwoViews, lambda: (_x(N, D)(), _x(N, D)() + 1), "moves",
                   (_move(BatchLayout.merged(0, 1)),)),
    CatalogueModel("view_features_into_rows", FeaturesIntoRows, _x(N, 2 * D), "moves",
                   (_move(BatchLayout.merged(0, 2)),)),
    CatalogueModel("time_major_gru", TimeMajorRNN, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    # mixes samples
    CatalogueModel("center_with_batch_mean", CenterWithBatchMean, _x(N, D), "mixes", MIX),
    CatalogueModel("full_sum", FullSum, _x(N, D), "mixes", MIX),
    CatalogueModel("max_over_batch", MaxOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("min_over_batch", MinOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("std_over_batch", StdOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("var_over_batch", VarOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("norm_over_batch", NormOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("logsumexp_over_batch", LogSumExpOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("prod_over_batch", ProdOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("amax_over_batch", AmaxOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("batchnorm_training", BatchNormTraining, _x(N, D), "mixes", MIX),
    CatalogueModel("functional_batch_norm_training", FunctionalBatchNorm, _x(N, D), "mixes", MIX),
    CatalogueModel("softmax_over_batch", SoftmaxOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("log_softmax_over_batch", LogSoftmaxOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("cumsum_over_batch", CumsumOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("cumprod_over_batch", CumprodOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("sort_over_batch", SortOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("argsort_over_batch", ArgsortOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("topk_over_batch", TopkOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("roll_over_batch", RollOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("flip_over_batch", FlipOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("matmul_contracting_batch", AdjacencyMatmul, _x(N, D), "mixes", MIX),
    CatalogueModel("einsum_contracting_batch", GramEinsum, _x(N, D), "mixes", MIX),
    CatalogueModel("bmm_contracting_batch", BmmOverBatch, _x(N, T, D), "mixes", MIX),
    CatalogueModel("pairwise_differences", PairwiseDifferences, _x(N, D), "mixes", MIX),
    CatalogueModel("cat_with_shared_row_along_batch", CatSharedRow, _x(N, D), "mixes", MIX),
    CatalogueModel("first_sample_broadcast", FirstSampleBroadcast, _x(N, D), "mixes", MIX),
    CatalogueModel("shuffle_by_index_tensor", ShuffleByIndex, _x(N, D), "mixes", MIX),
    CatalogueModel("index_select_batch", IndexSelectBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("gather_along_batch", GatherBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("normalize_over_batch", NormalizeOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("layer_norm_over_batch", LayerNormOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("conv_batch_in_channels", ConvBatchInChannels, _x(N, 7), "mixes", MIX),
    CatalogueModel("linear_on_batch_features", LinearOnBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("lstm_wrong_batch_first", LSTMWrongBatchFirst, _x(N, T, D), "mixes", MIX),
    CatalogueModel("mha_wrong_batch_first", MHAWrongBatchFirst, _x(N, T, D), "mixes", MIX),
    CatalogueModel("loss_inside_model", LossInsideModel, lambda: (_x(N, D)(), torch.tensor([0, 1, 2, 3])),
                   "mixes", MIX),
    CatalogueModel("consecutive_difference", ConsecutiveDifference, _x(N, D), "mixes", MIX),
    CatalogueModel("chunk_batch", ChunkBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("cdist_pairs", CdistPairs, _x(N, D), "mixes", MIX),
    CatalogueModel("attention_over_batch", AttentionOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("write_across_samples", WriteAcrossSamples, _x(N, D), "mixes", MIX),
]


def by_category(category: str) -> List[CatalogueModel]:
    """The entries of one category: "benign", "moves" or "mixes"."""
    if category not in ("benign", "moves", "mixes"):
        raise ValueError(f"unknown category {category!r}")
    return [e for e in CATALOGUE if e.category == category]


def by_name(name: str) -> CatalogueModel:
    for e in CATALOGUE:
        if e.name == name:
            return e
    raise KeyError(name)
