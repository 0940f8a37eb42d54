"""The models the benchmarks time: an MLP, an MNIST CNN, a ResNet with GroupNorm on 32x32 images, a
2-layer transformer encoder built from Linear, LayerNorm and Embedding layers, the same encoder built from
PyTorch's own blocks (nn.TransformerEncoder, a learned position table as a bare nn.Parameter), an LSTM text
classifier (a stock nn.LSTM), and a deep, narrow MLP (many small layers: the per-layer cost of each library's
own code, not the arithmetic, sets its step time)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import nn


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def mnist_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(8, cout)
        self.relu = nn.ReLU()  # no in-place ops: Opacus's hooks engine would crash on them
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(8, cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        out = out + identity
        return self.relu(out)


class ResNetGN(nn.Module):
    def __init__(self, width=32, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.GroupNorm(8, width), nn.ReLU())
        self.layers = nn.Sequential(
            BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 4 * width, 2)
        )
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class EncoderLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.ff2 = nn.Linear(4 * d, d)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(att.transpose(1, 2).reshape(n, t, d))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab=1000, d=128, heads=4, layers=2, classes=2, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList([EncoderLayer(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        n, t = ids.shape
        positions = torch.arange(t, device=ids.device).expand(n, t)
        x = self.tok(ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x).mean(dim=1))


class TorchTransformer(nn.Module):
    """The ``transformer`` model's architecture (pre-norm, GELU, feed-forward 4d, no dropout) from PyTorch's own
    blocks: ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` inside), and
    the position table a bare ``nn.Parameter`` added to the token embeddings."""

    def __init__(self, vocab=1000, d=128, heads=4, layers=2, classes=2, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, max_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.tok(ids) + self.pos).mean(dim=1))  # sequences of max_len tokens


class LSTMClassifier(nn.Module):
    """Embedding(10,000, 64) -> nn.LSTM(64, 128, batch_first) -> Linear on the last hidden state."""

    def __init__(self, vocab=10_000, d=64, hidden=128, classes=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, ids):
        _, (h, _) = self.lstm(self.emb(ids))
        return self.fc(h[-1])


def deep_narrow(blocks=16, width=32, classes=10):
    """``blocks`` blocks of Linear(width, width) + LayerNorm + GELU, then a Linear(width, classes) head: 66
    parameters of at most 1,024 values each; per layer little arithmetic, so the per-layer cost of each library's own
    code is what a step costs (issue 34; benchmarks/compile_speed.py; tests/test_compile_option.py counts its
    graphs)."""
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


# name -> (model factory, a batch of n inputs, number of classes); each benchmark picks its batch sizes
CASES = {
    "mlp": (mlp, lambda n: torch.randn(n, 1, 28, 28), 10),
    "cnn": (mnist_cnn, lambda n: torch.randn(n, 1, 28, 28), 10),
    "resnet": (ResNetGN, lambda n: torch.randn(n, 3, 32, 32), 10),
    "transformer": (Transformer, lambda n: torch.randint(0, 1000, (n, 64)), 2),
    "torch-transformer": (TorchTransformer, lambda n: torch.randint(0, 1000, (n, 64)), 2),
    "lstm": (LSTMClassifier, lambda n: torch.randint(0, 10_000, (n, 50)), 2),  # sequences of 50 tokens
    "deep-narrow": (deep_narrow, lambda n: torch.randn(n, 32), 10),
}


def median_ms(steps: Dict[str, Callable[[], None]], repeats: int, warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
    """Median milliseconds per step; the engines take turns, so drift in machine load hits all alike.
    ``clock=time.thread_time``: the calling thread's CPU time (set one intra-op thread: with more, the work of
    torch's other threads, and of the threads fxdp draws large noise on, goes uncounted), which other jobs on a
    shared machine disturb far less than wall time."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = clock()
            step()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


class OneHeadAttention(nn.Module):
    """One head of causal self-attention with a residual, LayerNorm, an MLP and a learned position table
    (benchmarks/compile_speed.py times it; tests/runtime/test_torch_compile.py checks it)."""

    def __init__(self, vocab=20, t=6, d=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)))

    def forward(self, idx):
        n, t = idx.shape
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device).expand(n, t))
        scores = self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5
        att = scores.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        h = self.norm(h + self.o(att @ self.v(h)))
        return self.head(F.gelu(self.mlp(h)).mean(1))
