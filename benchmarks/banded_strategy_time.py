"""Time to optimise a banded MF strategy for a number of steps, bands and participation pattern, and what it gains.

    python benchmarks/banded_strategy_time.py [--steps 1000 10000] [--bands 8 64 256] [--epochs 1 10 100]

For each number of steps ``n``, bands ``m`` and number of epochs ``e`` (fixed-epoch participation: a sample's steps
``b = n / e`` apart, ``e`` of them; ``e = 1`` is one participation, which is also the objective with amplification),
prints the CPU time of one thread for :func:`fxdp.optim.correlated.optimize_banded_toeplitz` (its cache bypassed:
each call optimises), the expected total squared error of the prefix sums per unit of sensitivity under the pattern
(``expected_prefix_sum_error(..., min_separation=b)``) of the strategy optimised for the pattern, of the
single-participation optimum under the same pattern (what was optimised before participation patterns were taken),
and their ratio ("(refused)": the single-participation optimum has no known sensitivity under the
pattern). Where ``m > b`` the bands overlap and the two differ; where ``m <= b`` they are the same strategy.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxdp.optim.correlated import expected_prefix_sum_error  # noqa: E402
from fxdp.optim.correlated.banded_strategy import _optimize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--bands", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 10, 100])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, one thread, CPU time")
    print(f"{'steps':>6s} {'bands':>6s} {'epochs':>6s} {'min_sep':>7s} {'seconds':>8s} {'error (pattern opt)':>20s} "
          f"{'error (single opt)':>20s} {'ratio':>7s}")
    for n in args.steps:
        for bands in args.bands:
            for epochs in args.epochs:
                b = -(-n // epochs)
                k = -(-n // b)
                _optimize.cache_clear()
                start = time.process_time()
                ours = list(_optimize(bands, n, b if k > 1 else n, k, 200))
                seconds = time.process_time() - start
                single = list(_optimize(bands, n, n, 1, 200))
                mine = expected_prefix_sum_error(ours, n, min_separation=b)
                try:
                    before = expected_prefix_sum_error(single, n, min_separation=b)
                except ValueError:  # overlapping bands of coefficients whose sensitivity fxdp does not have
                    print(f"{n:6d} {bands:6d} {epochs:6d} {b:7d} {seconds:8.2f} {mine:20.6g} {'(refused)':>20s}")
                    continue
                print(f"{n:6d} {bands:6d} {epochs:6d} {b:7d} {seconds:8.2f} {mine:20.6g} {before:20.6g} "
                      f"{mine / before:7.4f}")


if __name__ == "__main__":
    main()
