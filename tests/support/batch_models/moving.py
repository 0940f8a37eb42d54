"""Catalogue models that move the batch (each move marked ``# MOVE``) but keep samples apart."""

from __future__ import annotations

import torch
from torch import nn

from .sizes import C, D, E, T


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
