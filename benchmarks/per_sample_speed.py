"""Time one training step that materialises per-sample gradients, side by side in one run:

- plain PyTorch (non-private forward + backward): the floor, ratio 1.00;
- fxdp (``fxdp.compile_for_dp``, the compiled graph);
- Opacus's hooks engine (``opacus.GradSampleModule``), when ``opacus`` is installed
  (``pip install -e .[bench]``; it is not a dependency of fxdp).

Usage: python benchmarks/per_sample_speed.py [--repeats 20] [--models mlp,cnn,resnet,transformer,lstm]
(Opacus runs the lstm model with its DPLSTM, swapped in by its ModuleValidator.fix.)
Prints one row per model: milliseconds per step and the ratio to the non-private step.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import fxdp  # noqa: E402

BATCH = {"mlp": 256, "cnn": 128, "resnet": 32, "transformer": 32, "lstm": 32}


def _make_step(model, x, y, clear):
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        F.cross_entropy(model(x), y).backward()
        for p in params:
            p.grad = None
        clear()

    return step


def run(names, repeats):
    try:
        import opacus
    except ImportError:
        opacus = None
        print("opacus is not installed: only fxdp is timed (pip install opacus to compare)")
    rows = []
    for name in names:
        (factory, make_x, classes), n = models.CASES[name], BATCH[name]
        torch.manual_seed(0)
        model = factory()
        x, y = make_x(n), torch.randint(0, classes, (n,))
        fx_model = fxdp.compile_for_dp(copy.deepcopy(model), example_inputs=x)
        steps = {
            "plain": _make_step(model, x, y, lambda: None),
            "fxdp": _make_step(fx_model, x, y, lambda: fxdp.zero_grad_sample(fx_model)),
        }
        if opacus is not None:
            op_copy = copy.deepcopy(model)
            if any(isinstance(m, torch.nn.LSTM) for m in op_copy.modules()):  # Opacus needs its DPLSTM
                op_copy = opacus.validators.ModuleValidator.fix(op_copy)
            op_model = opacus.GradSampleModule(op_copy)
            steps["opacus"] = _make_step(op_model, x, y, lambda: op_model.zero_grad(set_to_none=True))
        ms = models.median_ms(steps, repeats, warmup=2)
        row = [name, n, f"{ms['plain']:.1f}", f"{ms['fxdp']:.1f} ({fxdp.report(fx_model).mode})",
               f"{ms['fxdp'] / ms['plain']:.2f}"]
        if opacus is not None:
            row += [f"{ms['opacus']:.1f}", f"{ms['opacus'] / ms['plain']:.2f}", f"{ms['fxdp'] / ms['opacus']:.2f}"]
        rows.append(row)
    headers = ["model", "batch", "plain ms", "fxdp ms (engine)", "fxdp/plain"]
    if opacus is not None:
        headers += ["opacus ms", "opacus/plain", "fxdp/opacus"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {repeats} steps per engine")
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--models", default=",".join(BATCH))
    args = parser.parse_args()
    run(args.models.split(","), args.repeats)
