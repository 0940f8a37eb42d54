"""How long the batch_dim pass takes on a 100-layer model (the aim: well under a second).

    python benchmarks/batch_dim_speed.py

Traces once, then times ``propagate_batch_dim`` (fake tensors, no real compute) over a few runs and
prints the best and the median. The model: 100 blocks of Linear + LayerNorm + GELU + residual on
(N, T, d) sequences, with a transpose(1, 2)/Conv1d every tenth block, so views, contractions,
normalisation and elementwise rules all run (about 430 nodes).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from fxdp.passes.batch_dim import propagate_batch_dim
from fxdp.frontends.fx import trace


class Block(nn.Module):
    def __init__(self, d: int, conv: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)
        self.act = nn.GELU()
        self.conv = nn.Conv1d(d, d, 3, padding=1) if conv else None

    def forward(self, x):
        h = self.act(self.lin(self.norm(x)))
        if self.conv is not None:
            h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return x + h


class Deep(nn.Module):
    def __init__(self, layers: int = 100, d: int = 64):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, conv=(i % 10 == 9)) for i in range(layers)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))


def main(repeats: int = 5) -> None:
    torch.manual_seed(0)
    model = Deep()
    x = torch.randn(32, 16, 64)
    gm = trace(model).graph_module
    nodes = len(gm.graph.nodes)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = propagate_batch_dim(gm, x)
        times.append(time.perf_counter() - start)
    layers = sum(1 for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.LayerNorm)))
    print(f"batch_dim pass on a 100-block model ({layers} layers with parameters, {nodes} graph nodes), "
          f"input {tuple(x.shape)}")
    print(f"  best {min(times) * 1000:.1f} ms, median {statistics.median(times) * 1000:.1f} ms "
          f"over {repeats} runs (first run {times[0] * 1000:.1f} ms); findings: {len(result.report.findings)}")


if __name__ == "__main__":
    main()
