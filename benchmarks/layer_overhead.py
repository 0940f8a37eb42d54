"""What a DP-SGD step costs per layer beyond the arithmetic: a stack of small Linear layers (8 -> 8, batch 2),
whose kernels take a few microseconds, so that a step's time is mostly the library's own code per layer
(Python, autograd nodes, hooks). Prints microseconds per layer and step for a plain step, fxdp and every
Opacus mode that is installed, and each one's cost per layer beyond the plain step's, side by side in one run,
taking turns, timed by the thread's CPU time on one thread (a busy machine disturbs it less than wall time).

Usage: python benchmarks/layer_overhead.py [--layers 20] [--repeats 30]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from tabulate import tabulate
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from dp_step_speed import OPACUS_MODES, fxdp_step, opacus_step, plain_step  # noqa: E402

STEPS_PER_SAMPLE = 20  # steps per timed sample: one step of 20 small layers takes well under a millisecond


def stack(layers: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(8, 8), nn.Tanh())], nn.Linear(8, 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = stack(args.layers)
    x, y = torch.randn(2, 8), torch.tensor([0, 1])
    makers = {"plain": plain_step, "fxdp": fxdp_step}
    try:
        import opacus  # noqa: F401

        makers.update({f"opacus-{mode}": opacus_step(mode) for mode in OPACUS_MODES})
    except ImportError:
        print("opacus is not installed: only fxdp is timed (pip install opacus to compare)")
    steps, failed = {}, {}
    for name, make in makers.items():
        try:
            one = make(copy.deepcopy(model), x, y)
        except Exception as exc:  # a mode that cannot run the model is reported, not timed
            failed[name] = f"{type(exc).__name__}: {exc}"[:70]
            continue
        steps[name] = lambda one=one: [one() for _ in range(STEPS_PER_SAMPLE)]
    ms = models.median_ms(steps, args.repeats, clock=time.thread_time)
    layers = args.layers + 1
    per_layer = {name: t * 1e3 / STEPS_PER_SAMPLE / layers for name, t in ms.items()}
    rows = [[name, f"{us:.0f}", f"{us - per_layer['plain']:.0f}", f"{ms[name] / ms['plain']:.1f}"]
            for name, us in per_layer.items()]
    rows += [[name, "fails", "", why] for name, why in failed.items()]
    print(f"{layers} Linear layers (8 -> 8), batch 2, torch {torch.__version__}, 1 thread, CPU time, median of "
          f"{args.repeats} samples of {STEPS_PER_SAMPLE} steps; engines take turns")
    print(tabulate(rows, headers=["engine", "us per layer and step", "beyond plain", "vs plain"], tablefmt="github"))


if __name__ == "__main__":
    main()
