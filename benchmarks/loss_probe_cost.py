"""What judging the user's loss costs (fxdp/runtime/loss_probe.py): the first training step of a compiled model
records the loss's ops and runs the loss pass before its backward; later steps return plain tensors. Prints, for a
classifier's cross-entropy and a language model's per-sample token mean, the first step's loss and backward with the
probe and without it (the same step on a model whose probe is switched off), then the second step of each, medians
of fresh compiles taking turns, by the thread's CPU time on one thread.

Usage: python benchmarks/loss_probe_cost.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import fxdp
from fxdp.runtime.loss_probe import LOSS_WATCH_ATTR


def classifier():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return model, x, y, lambda out, y: F.cross_entropy(out, y)


def token_model():
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 100))
    x = torch.randint(0, 100, (16, 24))
    y = torch.randint(0, 100, (16, 24))
    y[:, 20:] = -100

    def loss(out, y):
        per_token = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
        return fxdp.per_sample_mean(per_token, weights=y != -100)

    return model, x, y, loss


def step_ms(dp, x, y, loss) -> float:
    start = time.thread_time()
    loss(dp(x), y).backward()
    return (time.thread_time() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, make in (("classifier, cross-entropy, batch 32", classifier),
                       ("token model, per-sample token mean, batch 16x24", token_model)):
        probed, unprobed, later, later_unprobed = [], [], [], []
        for _ in range(args.repeats):
            model, x, y, loss = make()
            for probe, into, after in ((True, probed, later), (False, unprobed, later_unprobed)):
                dp = fxdp.compile_for_dp(model, x)
                with torch.no_grad():
                    dp(x)  # the first forward's own work (the analysis of its shapes) is not the probe's
                if not probe:  # as after a judged loss
                    watch = getattr(dp, LOSS_WATCH_ATTR)
                    watch.armed, watch.report = False, fxdp.report(dp)
                model.zero_grad()
                into.append(step_ms(dp, x, y, loss))
                model.zero_grad()
                after.append(step_ms(dp, x, y, loss))
        rows.append([name, f"{statistics.median(probed):.2f}", f"{statistics.median(unprobed):.2f}",
                     f"{statistics.median(probed) - statistics.median(unprobed):.2f}",
                     f"{statistics.median(later):.2f}", f"{statistics.median(later_unprobed):.2f}"])
    print(tabulate(rows, headers=["loss", "first step, probed (ms)", "same, probe off (ms)", "probe's cost (ms)",
                                  "second step (ms)", "same, never probed (ms)"]))


if __name__ == "__main__":
    main()
