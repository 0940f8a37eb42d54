"""Models no front end captures (neither torch.fx nor torch.export): data-dependent control flow inside otherwise
ordinary models of Linear / Conv / LayerNorm / Embedding layers. Each builder returns (model, batch, per-sample loss
function); the batch holds one row per sample at dimension 0."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D = 6


class SlidingWindowMixer(nn.Module):
    """Mixes the tokens of each window of W: the windows of all samples are stacked as rows (N * C, W, D), as
    sliding-window attention does; how many windows depends on the longest sequence in the batch (``.item()``)."""

    W = 2

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(self.W * D, self.W * D)
        self.norm = nn.LayerNorm(D)

    def forward(self, h, mask):
        n, t, d = h.shape
        used = int(mask.sum(1).max().item())  # the longest sequence of the batch
        chunks = []
        for start in range(0, used, self.W):  # a loop whose count is a tensor's value
            window = h[:, start:start + self.W]
            if window.shape[1] < self.W:
                window = F.pad(window, (0, 0, 0, self.W - window.shape[1]))
            chunks.append(window)
        windows = torch.stack(chunks, 1).reshape(n * len(chunks), self.W * d)  # (N * C) rows: samples merged
        mixed = self.mix(windows).reshape(n, len(chunks) * self.W, d)[:, :used]
        out = torch.cat([mixed, h[:, used:]], 1) if used < t else mixed
        return self.norm(h + out * mask.unsqueeze(-1))


class ChunkedEncoder(nn.Module):
    """Embedding, the sliding-window block, a pooled head: only the block's own code is untraceable."""

    def __init__(self, vocab: int = 11, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.block = SlidingWindowMixer()
        self.head = nn.Linear(D, classes)

    def forward(self, ids):
        mask = (ids != 0).to(self.embed.weight.dtype)
        h = self.block(self.embed(ids), mask)
        return self.head((h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1))


class PerRowLoop(nn.Module):
    """A Python loop over the batch's rows (the tracer cannot iterate a traced tensor), each row through a Linear
    that then sees rows without a batch dimension."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h):
        return torch.stack([torch.tanh(self.fc(row)) for row in h])


class RowLoopNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.rows = PerRowLoop()
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        return self.out(self.rows(self.inp(x)))


class AdaptiveDepth(nn.Module):
    """Applies its layer as many times as a per-sample value says (``.item()`` on each sample's own data)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h):
        outs = []
        for row in h.split(1):
            steps = 1 + int(row.abs().sum().item() * 3) % 3  # 1 to 3 steps, from this sample alone
            for _ in range(steps):
                row = torch.tanh(self.fc(row))
            outs.append(row)
        return torch.cat(outs)


class AdaptiveDepthNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)
        self.proj = nn.Linear(3 * 4, D)
        self.depth = AdaptiveDepth()
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        h = self.proj(torch.relu(self.conv(x)).flatten(1))
        return self.out(self.depth(h))


class BatchBranch(nn.Module):
    """Takes one of two layers for the whole batch, depending on the batch's sum: the branch a sample takes
    depends on the other samples (it mixes samples)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, h):
        return self.a(h) if h.sum() > 0 else self.b(h)


class BatchBranchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.branch = BatchBranch()
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        return self.out(self.branch(self.inp(x)))


class BatchLoopCount(nn.Module):
    """Repeats its layer as often as the batch's largest value says: the count mixes samples."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h):
        for _ in range(1 + int(h.abs().max().item() * 4) % 3):
            h = torch.tanh(self.fc(h))
        return h


class BatchLoopNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.loop = BatchLoopCount()
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        return self.out(self.loop(self.inp(x)))


class RootItemScale(nn.Module):
    """The root's own forward is untraceable: a step counter read with ``.item()`` picks a branch (the same for
    every sample); its layers are ordinary."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, 2)
        self.register_buffer("warm", torch.tensor(3.0))

    def forward(self, x):
        h = self.inp(x)
        if self.warm.item() > 2:
            h = self.norm(h)
        return self.out(torch.relu(h))


def chunked_encoder():
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 0], [3, 4, 0, 0, 0, 0], [7, 1, 2, 9, 0, 0], [5, 0, 0, 0, 0, 0]])
    return ChunkedEncoder().double(), (ids,), torch.tensor([0, 1, 2, 1])


def row_loop():
    torch.manual_seed(0)
    return RowLoopNet().double(), (torch.randn(4, 4, dtype=torch.float64),), torch.tensor([0, 1, 1, 0])


def adaptive_depth():
    torch.manual_seed(0)
    return AdaptiveDepthNet().double(), (torch.randn(4, 2, 4, dtype=torch.float64),), torch.tensor([0, 1, 1, 0])


def batch_branch():
    torch.manual_seed(0)
    # samples 0 and 1 alone take the other branch than the batch does
    x = torch.randn(4, 4, dtype=torch.float64)
    return BatchBranchNet().double(), (x,), torch.tensor([0, 1, 1, 0])


def batch_loop():
    torch.manual_seed(0)
    return BatchLoopNet().double(), (torch.randn(4, 4, dtype=torch.float64),), torch.tensor([0, 1, 1, 0])


def root_item():
    torch.manual_seed(0)
    return RootItemScale().double(), (torch.randn(4, 4, dtype=torch.float64),), torch.tensor([0, 1, 1, 0])


ZOO = {"chunked_encoder": chunked_encoder, "row_loop": row_loop, "adaptive_depth": adaptive_depth,
       "batch_branch": batch_branch, "batch_loop": batch_loop, "root_item": root_item}
