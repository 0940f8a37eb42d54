"""Time one training step that materialises per-sample gradients, side by side in one run:

- plain PyTorch (non-private forward + backward): the floor, ratio 1.00;
- fxdp (``fxdp.compile_for_dp``, the compiled graph);
- Opacus's hooks engine (``opacus.GradSampleModule``), when ``opacus`` is installed
  (``pip install -e .[bench]``; it is not a dependency of fxdp).

Usage: python benchmarks/per_sample_speed.py [--repeats 10] [--models mlp,cnn,resnet,transformer]
Prints one row per model: milliseconds per step and the ratio to the non-private step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import fxdp  # noqa: E402

CASES = {
    "mlp": (models.mlp, lambda n: torch.randn(n, 1, 28, 28), 256, 10),
    "cnn": (models.mnist_cnn, lambda n: torch.randn(n, 1, 28, 28), 128, 10),
    "resnet": (models.ResNetGN, lambda n: torch.randn(n, 3, 32, 32), 32, 10),
    "transformer": (models.Transformer, lambda n: torch.randint(0, 1000, (n, 64)), 32, 2),
}


def _step_time(model, x, y, repeats, clear):
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        out = model(x)
        F.cross_entropy(out, y).backward()
        for p in params:
            p.grad = None
        clear()

    for _ in range(2):  # warm-up
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _clear_grad_sample(model):
    return lambda: fxdp.zero_grad_sample(model)


def run(names, repeats):
    try:
        import opacus
    except ImportError:
        opacus = None
        print("opacus is not installed: only fxdp is timed (pip install opacus to compare)")
    rows = []
    for name in names:
        factory, make_x, n, classes = CASES[name]
        torch.manual_seed(0)
        model = factory()
        x, y = make_x(n), torch.randint(0, classes, (n,))
        plain = _step_time(model, x, y, repeats, lambda: None)

        fx_model = fxdp.compile_for_dp(copy.deepcopy(model), example_inputs=x)
        engine = fxdp.report(fx_model).mode
        fx = _step_time(fx_model, x, y, repeats, _clear_grad_sample(fx_model))
        row = [name, n, f"{plain:.1f}", f"{fx:.1f} ({engine})", f"{fx / plain:.2f}"]
        if opacus is not None:
            op_model = opacus.GradSampleModule(copy.deepcopy(model))
            op = _step_time(op_model, x, y, repeats, lambda: op_model.zero_grad(set_to_none=True))
            row += [f"{op:.1f}", f"{op / plain:.2f}", f"{fx / op:.2f}"]
        rows.append(row)
    headers = ["model", "batch", "plain ms", "fxdp ms", "fxdp/plain"]
    if opacus is not None:
        headers += ["opacus ms", "opacus/plain", "fxdp/opacus"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {repeats} steps")
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--models", default=",".join(CASES))
    args = parser.parse_args()
    run(args.models.split(","), args.repeats)
