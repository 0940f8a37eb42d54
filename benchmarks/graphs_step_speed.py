"""Speed of a DP-SGD step on a batch of graphs (fxdp's graphs engine), against a non-private step and against the
per-sample-gradient-by-loop baseline (each graph run alone, its gradient clipped, the sum noised: what a user could
do without fxdp), side by side in one run: a GIN on 32 graphs of 20 to 40 nodes.

    pip install -e ".[graphs]" && python benchmarks/graphs_step_speed.py --repeats 20 --threads 1

Prints the median time of each step and the ratios to the plain step. Machine and torch version: say them beside
any figure you quote.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GINConv, global_mean_pool

import fxdp


class GIN(nn.Module):
    def __init__(self, features=16, hidden=64, classes=2):
        super().__init__()
        self.conv1 = GINConv(nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden)))
        self.conv2 = GINConv(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden)))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, edge_index, batch):
        h = self.conv2(self.conv1(x, edge_index).relu(), edge_index).relu()
        return self.head(global_mean_pool(h, batch))


def batch_of_graphs(count=32, generator=None):
    graphs = []
    for i in range(count):
        n = int(torch.randint(20, 41, (), generator=generator))
        graphs.append(Data(x=torch.randn(n, 16, generator=generator),
                           edge_index=torch.randint(0, n, (2, 3 * n), generator=generator), y=torch.tensor([i % 2])))
    return Batch.from_data_list(graphs), graphs


def median_times(steps, repeats):
    """Each step once per round, the rounds interleaved (a busy machine slows all of them alike): the medians."""
    for step in steps:
        step()  # warm-up (the graphs engine's first-batch self-check included)
    times = [[] for _ in steps]
    for _ in range(repeats):
        for step, kept in zip(steps, times):
            start = time.perf_counter()
            step()
            kept.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch, graphs = batch_of_graphs(generator=torch.Generator().manual_seed(0))
    plain = GIN()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def plain_step():
        plain_opt.zero_grad()
        F.cross_entropy(plain(batch.x, batch.edge_index, batch.batch), batch.y).backward()
        plain_opt.step()

    model = GIN()
    dp_model = fxdp.compile_for_dp(model)
    dp_opt = fxdp.optim.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                    max_grad_norm=1.0, expected_batch_size=len(graphs),
                                    sink=fxdp.sinks.contract.sink_of(dp_model))

    def dp_step():
        dp_opt.zero_grad()
        F.cross_entropy(dp_model(batch.x, batch.edge_index, batch.batch), batch.y).backward()
        dp_opt.step()

    loop = GIN()
    params = list(loop.parameters())
    loop_opt = torch.optim.SGD(params, lr=0.1)
    singles = [Batch.from_data_list([g]) for g in graphs]

    def loop_step():  # each graph alone: its gradient, clipped to 1, summed, noised, averaged
        total = [torch.zeros_like(p) for p in params]
        for one in singles:
            grads = torch.autograd.grad(F.cross_entropy(loop(one.x, one.edge_index, one.batch), one.y), params)
            norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
            factor = (1.0 / (norm + 1e-6)).clamp(max=1.0)
            for t, g in zip(total, grads):
                t.add_(g * factor)
        for p, t in zip(params, total):
            p.grad = (t + torch.randn_like(t)) / len(singles)
        loop_opt.step()

    plain_t, dp_t, loop_t = median_times([plain_step, dp_step, loop_step], args.repeats)
    print(f"GIN (2 GINConv, hidden 64), {len(graphs)} graphs of 20-40 nodes ({batch.num_nodes} nodes), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} interleaved rounds")
    print("| step | ms | / plain |")
    print("|---|---|---|")
    for name, t in [("plain (non-private)", plain_t), ("fxdp graphs engine (DP)", dp_t),
                    ("per-graph loop (DP)", loop_t)]:
        print(f"| {name} | {1000 * t:.1f} | {t / plain_t:.2f} |")


if __name__ == "__main__":
    main()
