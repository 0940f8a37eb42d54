"""Small example models, each showing one thing fxdp finds or fixes.

Every factory takes no arguments and returns a model in training mode, so the command line can load
it directly::

    fxdp inspect examples/models.py:resnet_block --input 8,3,16,16

``INPUT_SHAPES`` gives a batch shape that fits each factory. A ``# fxdp-example: NAME`` comment
precedes each line a report points at; the tests find those lines by it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: A batch shape (batch first) each factory's model accepts.
INPUT_SHAPES = {
    "resnet_block": (8, 3, 16, 16),
    "batchnorm_cnn": (8, 3, 16, 16),
    "untraceable": (8, 16),
    "time_major": (8, 5, 16),
    "mixing": (8, 16),
    "mnist_cnn": (8, 1, 28, 28),
    "mlp": (8, 20),
}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection, GroupNorm in place of BatchNorm."""

    def __init__(self, channels: int = 8, groups: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, channels)

    def forward(self, x):
        identity = x
        # fxdp-example: relu-1 (an inplace=True ReLU: the inplace pass calls an out-of-place copy)
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        # fxdp-example: iadd (in-place add: rewritten as `out = out + identity`)
        out += identity
        # fxdp-example: relu-2
        return self.relu(out)


class SmallResNet(nn.Module):
    """A stem, one residual block, global average pooling and a classifier."""

    def __init__(self, channels: int = 8, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(4, channels)
        self.relu = nn.ReLU(inplace=True)
        self.block = BasicBlock(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        # fxdp-example: relu-stem
        x = self.relu(self.norm(self.stem(x)))
        x = self.block(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet_block() -> nn.Module:
    """A ResNet-style network: the in-place pass rewrites ``out += identity`` and the ``ReLU(inplace=True)``
    modules out of place, and the report lists each rewrite with its line here. BatchNorm is already
    replaced by GroupNorm, so nothing blocks DP training."""
    return SmallResNet().train()


class BatchNormCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        # fxdp-example: batchnorm (BatchNorm2d in training mode: mixes samples, reported as an error)
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def batchnorm_cnn() -> nn.Module:
    """A CNN with BatchNorm2d: in training mode batch norm normalises each sample with statistics of the
    whole batch, so samples mix and no DP guarantee holds. Validation reports it as an error, naming
    the module (``bn``) and its line; ``ModuleValidator.fix`` replaces it with GroupNorm."""
    return BatchNormCNN().train()


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        x = self.fc1(x)
        # fxdp-example: control-flow (branching on tensor values: torch.fx cannot trace this)
        if x.sum() > 0:
            x = torch.relu(x)
        return self.fc2(x)


def untraceable() -> nn.Module:
    """A model whose forward branches on the data (``if x.sum() > 0:``). torch.fx cannot trace it; the
    report says so, why, and on which line, and fxdp falls back to backward hooks."""
    return DataDependent().train()


class TimeMajor(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32, out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x):  # x: (batch, time, features)
        # fxdp-example: transpose (the batch moves from dim 0 to dim 1)
        x = x.transpose(0, 1)
        # fxdp-example: time-major-linear (the Linear layers see the batch at dim 1)
        h = self.fc2(torch.relu(self.fc1(x)))
        return h.mean(0)


def time_major() -> nn.Module:
    """A model that switches to time-major layout (``x.transpose(0, 1)``) before its Linear layers. The
    batch dimension moves from 0 to 1; hook-based per-sample gradients that assume batch-first would be
    silently wrong. The batch_dim pass reports the move and where."""
    return TimeMajor().train()


class Mixing(nn.Module):
    def __init__(self, features: int = 16, out: int = 4):
        super().__init__()
        self.fc = nn.Linear(features, out)

    def forward(self, x):
        # fxdp-example: mixing (every sample's output depends on the whole batch)
        x = x - x.mean(0)
        return self.fc(x)


def mixing() -> nn.Module:
    """A model that centres each batch (``x - x.mean(0)``): every sample's output depends on all the
    others, which breaks differential privacy outright. The batch_dim pass reports it as an error."""
    return Mixing().train()


class MnistCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc = nn.Linear(16 * 5 * 5, 10)

    def forward(self, x):  # x: (batch, 1, 28, 28)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def mnist_cnn() -> nn.Module:
    """A small CNN for 28x28 grey-scale images: nothing to rewrite and nothing to report, the baseline a
    clean report looks like."""
    return MnistCNN().train()


def mlp() -> nn.Module:
    """A two-layer perceptron built from ``nn.Sequential``: the smallest model fxdp compiles."""
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10)).train()
