"""Test accuracy of private training on scikit-learn's digits, fxdp and Opacus side by side in one run.

Both libraries train the same model (``examples/train_digits.py``) with the same hyper-parameters, the
same data split and, per seed, the same initial weights, each calibrating its noise to the same
target epsilon with its own RDP accountant; the libraries take turns, seed by seed. Both draw their
Poisson masks and their noise from torch's global generator, seeded per run, so for one seed the two
runs differ only by the noise multiplier each calibration chose and by floating-point rounding.
(``--noise-multiplier 2.62`` compares them at one fixed sigma instead.)

Usage: python benchmarks/digits_vs_opacus.py [--seeds 5] [any option of examples/train_digits.py]
Needs ``pip install -e ".[examples]" opacus`` (Opacus is not a dependency of fxdp).
Prints one row per seed (accuracy, epsilon, noise multiplier of each library), then mean +- std.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_digits  # noqa: E402


def run(library: str, args: argparse.Namespace, seed: int):
    """(test accuracy, epsilon, noise multiplier, seconds) of one training run."""
    if library == "fxdp":
        from fxdp.privacy_engine import PrivacyEngine

        mode = args.fxdp_mode
    else:
        from opacus import PrivacyEngine

        mode = "hooks"
    run_args = argparse.Namespace(**{**vars(args), "grad_sample_mode": mode, "seed": seed})
    sigma = []
    torch.manual_seed(seed)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns about its secure-mode default and hooks
        history = train_digits.train(
            run_args,
            PrivacyEngine(accountant="rdp"),
            progress=False,
            on_private=lambda model, optimizer, loader: sigma.append(optimizer.noise_multiplier),
        )
    _, accuracy, epsilon = history[-1]
    return accuracy, epsilon, sigma[0], time.perf_counter() - start


def mean_std(values):
    return f"{100 * statistics.mean(values):.1f} +- {100 * statistics.stdev(values):.1f}" if len(values) > 1 \
        else f"{100 * values[0]:.1f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="number of seeds (0, 1, ...)")
    parser.add_argument("--fxdp-mode", default="fx", help="fxdp's grad_sample_mode")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    own, rest = parser.parse_known_args(argv)
    args = train_digits.parse_args(rest)
    args.fxdp_mode = own.fxdp_mode
    if own.threads:
        torch.set_num_threads(own.threads)
    import opacus

    target = f"noise multiplier {args.noise_multiplier}" if args.noise_multiplier is not None \
        else f"target epsilon {args.target_epsilon}"
    print(f"digits, {args.epochs} epochs, expected batch {args.batch_size}, lr {args.lr}, C {args.max_grad_norm}, "
          f"{target}, delta {args.delta}; fxdp (grad_sample_mode={args.fxdp_mode}) vs Opacus {opacus.__version__}")
    rows, results = [], {"fxdp": [], "opacus": []}
    for seed in range(own.seeds):
        # Take turns, and alternate who goes first, so a slow patch of the machine hits both.
        order = ("fxdp", "opacus") if seed % 2 == 0 else ("opacus", "fxdp")
        out = {library: run(library, args, seed) for library in order}
        for library in results:
            results[library].append(out[library])
        rows.append([seed] + [f"{v:.4f}" if i == 0 else f"{v:.3f}" if i < 3 else f"{v:.1f}"
                              for library in results for i, v in enumerate(out[library])])
    print(tabulate(rows, headers=["seed", "fxdp acc", "fxdp eps", "fxdp sigma", "fxdp s",
                                  "opacus acc", "opacus eps", "opacus sigma", "opacus s"]))
    summary = []
    for library, runs in results.items():
        summary.append([library, mean_std([r[0] for r in runs]), f"{max(r[1] for r in runs):.3f}",
                        f"{statistics.mean(r[2] for r in runs):.3f}"])
    print()
    print(tabulate(summary, headers=["library", "test accuracy % (mean +- std)", "max epsilon", "sigma"]))
    difference = [f[0] - o[0] for f, o in zip(results["fxdp"], results["opacus"])]
    at_least = sum(d >= 0 for d in difference)
    print(f"\nfxdp - opacus accuracy: {100 * statistics.mean(difference):+.2f} points (mean over {own.seeds} seeds); "
          f"fxdp >= opacus on {at_least} of {own.seeds} seeds")


if __name__ == "__main__":
    main()
