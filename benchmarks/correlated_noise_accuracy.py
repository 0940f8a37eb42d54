"""Accuracy of DP-SGD, banded MF and BLT noise at the same epsilon on digits (examples/train_digits.py), side by side.

    python benchmarks/correlated_noise_accuracy.py --epsilons 1 2 4 8 --seeds 10

For each epsilon and noise (``--noise`` of the example: gaussian, banded-mf, blt), trains the example's default
model and configuration (15 epochs, batch size 256, delta 1e-5) with the noise calibrated to that epsilon, over
``--seeds`` seeds (0, 1, ...), and prints the test accuracy's mean and standard deviation, the calibrated noise
multiplier and the expected root-mean-square error of the prefix sums of the noise (the quantity the strategies
minimise: ``sigma * sqrt(error / n)`` with the strategy's error per unit of sensitivity, DP-SGD's ``n (n+1) / 2``),
in units of the clipping bound (noise of the sums of clipped gradients). Everything else (split, model, learning rate) is the
example's.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_example():
    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "examples" / "train_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(example, noise: str, epsilon: float, seed: int, extra):
    from fxdp.optim.correlated import prefix_sum_rmse
    from fxdp.privacy_engine import PrivacyEngine

    args = example.parse_args(["--noise", noise, "--target-epsilon", str(epsilon), "--seed", str(seed),
                               "--no-progress", *extra])
    torch.manual_seed(args.seed)
    engine = PrivacyEngine(accountant=args.accountant)
    seen = {}

    def on_private(model, optimizer, loader):
        seen.update(sigma=optimizer.noise_multiplier, mechanism=optimizer.noise_mechanism,
                    steps=args.epochs * len(loader))

    history = example.train(args, engine, progress=False, on_private=on_private,
                            example_inputs=torch.zeros(2, 1, 8, 8))
    _, accuracy, spent = history[-1]
    rmse = prefix_sum_rmse(seen["mechanism"], seen["sigma"], seen["steps"])
    return accuracy, spent, seen["sigma"], rmse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--noises", nargs="+", default=["gaussian", "banded-mf", "blt"])
    parser.add_argument("--example-args", nargs=argparse.REMAINDER, default=[],
                        help="further options of examples/train_digits.py (e.g. --epochs 5)")
    options = parser.parse_args()
    example = load_example()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; example options: defaults {' '.join(options.example_args)}")
    rows = []
    for epsilon in options.epsilons:
        for noise in options.noises:
            start = time.perf_counter()
            results = [run(example, noise, epsilon, seed, options.example_args) for seed in range(options.seeds)]
            accuracies = [100 * a for a, _, _, _ in results]
            std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
            rows.append((epsilon, noise, statistics.mean(accuracies), std, max(s for _, s, _, _ in results),
                         results[0][2], results[0][3], time.perf_counter() - start))
            print("eps {:4g}  {:10s} accuracy {:5.1f}% +- {:4.1f}  (eps spent {:.2f}, sigma {:.3f}, "
                  "prefix-sum RMSE {:.2f}; {:.0f} s)".format(*rows[-1]), flush=True)
    print(f"\ntest accuracy (%), mean +- std over {options.seeds} seeds; delta 1e-5")
    print("epsilon  " + "".join(f"{noise:>22s}" for noise in options.noises))
    for epsilon in options.epsilons:
        cells = {noise: (mean, std) for eps, noise, mean, std, *_ in rows if eps == epsilon}
        print(f"{epsilon:7g}  " + "".join(f"{cells[n][0]:15.1f} +- {cells[n][1]:3.1f}" for n in options.noises))
    print("\nexpected RMSE of the prefix sums of the noise (units: the clipping bound)")
    print("epsilon  " + "".join(f"{noise:>22s}" for noise in options.noises))
    for epsilon in options.epsilons:
        cells = {noise: rmse for eps, noise, _, _, _, _, rmse, _ in rows if eps == epsilon}
        print(f"{epsilon:7g}  " + "".join(f"{cells[n]:22.2f}" for n in options.noises))


if __name__ == "__main__":
    main()
