"""Accuracy of DP-SGD, banded MF and BLT noise at the same epsilon on digits (examples/train_digits.py) or the text
example (examples/finetune_text.py, ``--example text``), side by side.

    python benchmarks/correlated_noise_accuracy.py --epsilons 1 2 4 8 --seeds 10 [--example text]

For each epsilon and noise (``--noise`` of the example: gaussian, banded-mf, blt), trains the example's default
model and configuration (digits: 15 epochs, batch size 256; text: 10 epochs, batch size 1024; delta 1e-5) with the
noise calibrated to that epsilon, over ``--seeds`` seeds (0, 1, ...), and prints the test accuracy's mean and
standard deviation, the calibrated noise multiplier and the expected root-mean-square error of the prefix sums of
the noise (the quantity the strategies minimise: ``sigma * sqrt(error / n)`` with the strategy's error per unit of
sensitivity, DP-SGD's ``n (n+1) / 2``), in units of the clipping bound (noise of the sums of clipped gradients).
Everything else (split, model, learning rate) is the example's. ``--error-only`` prints the calibrated sigma and
the RMSE without training (seconds).
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


EXAMPLES = {"digits": "train_digits.py", "text": "finetune_text.py"}


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(EXAMPLES[name][:-3], ROOT / "examples" / EXAMPLES[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.NAME = name
    return module


def run(example, noise: str, epsilon: float, seed: int, extra):
    from fxdp.optim.correlated import prefix_sum_rmse
    from fxdp.privacy_engine import PrivacyEngine

    args = example.parse_args(["--noise", noise, "--target-epsilon", str(epsilon), "--seed", str(seed), *extra,
                               *(["--no-progress"] if example.NAME == "digits" else [])])
    torch.manual_seed(args.seed)
    seen = {}

    def on_private(model, optimizer, loader, *_):
        seen.update(sigma=optimizer.noise_multiplier, mechanism=optimizer.noise_mechanism,
                    steps=args.epochs * len(loader))

    if example.NAME == "digits":
        history = example.train(args, PrivacyEngine(accountant=args.accountant), progress=False,
                                on_private=on_private, example_inputs=torch.zeros(2, 1, 8, 8))
    else:
        history = example.train(args, on_private=on_private)
    _, accuracy, spent = history[-1]
    rmse = prefix_sum_rmse(seen["mechanism"], seen["sigma"], seen["steps"])
    return accuracy, spent, seen["sigma"], rmse


def expected_errors(example, epsilons, noises, extra) -> None:
    """Without training: the calibrated sigma and the prefix-sum RMSE of each noise at each epsilon, as
    make_private_with_epsilon calibrates them for the example's loader."""
    from torch.utils.data import DataLoader

    from fxdp.accounting import get_noise_multiplier
    from fxdp.correlated_noise import correlated_noise_multiplier
    from fxdp.optim.correlated import prefix_sum_rmse

    print("epsilon  " + "".join(f"{noise:>26s}" for noise in noises) + "   (sigma / prefix-sum RMSE)")
    for epsilon in epsilons:
        cells = []
        for noise in noises:
            args = example.parse_args(["--noise", noise, "--target-epsilon", str(epsilon), *extra])
            loader = DataLoader(_training_set(example, args), batch_size=args.batch_size)
            mechanism = example.noise_mechanism_for(args, len(loader))
            if noise == "gaussian":
                mechanism, steps = None, args.epochs * len(loader)
                sigma = get_noise_multiplier(target_epsilon=epsilon, target_delta=args.delta,
                                             sample_rate=1 / len(loader), steps=steps, accountant="pld")
            else:
                per_pass = -(-len(loader) // args.bands) * args.bands if noise == "banded-mf" else len(loader)
                steps = args.epochs * per_pass
                sigma = correlated_noise_multiplier(mechanism, loader, target_epsilon=epsilon,
                                                    target_delta=args.delta, epochs=args.epochs,
                                                    epsilon_tolerance=0.01)
            cells.append(f"{sigma:7.3f} / {prefix_sum_rmse(mechanism, sigma, steps):7.2f}")
        print(f"{epsilon:7g}  " + "".join(f"{cell:>26s}" for cell in cells))


def _training_set(example, args):
    if example.NAME == "digits":
        return example.load_digits_split(args.train_subset)[0]
    tokenizer = example.text_data.HashingTokenizer(vocab_size=args.vocab_size)
    split = example.text_data.load_docstring_classification(tokenizer)[0]
    return range(len(split.labels) if args.train_subset is None else min(args.train_subset, len(split.labels)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--noises", nargs="+", default=["gaussian", "banded-mf", "blt"])
    parser.add_argument("--error-only", action="store_true",
                        help="no training: only the calibrated sigma and the expected prefix-sum RMSE per epsilon")
    parser.add_argument("--example", choices=sorted(EXAMPLES), default="digits",
                        help="digits: examples/train_digits.py; text: examples/finetune_text.py")
    parser.add_argument("--example-args", nargs=argparse.REMAINDER, default=[],
                        help="further options of the example (e.g. --epochs 5)")
    options = parser.parse_args()
    example = load_example(options.example)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; example {options.example}, options: defaults {' '.join(options.example_args)}")
    if options.error_only:
        expected_errors(example, options.epsilons, options.noises, options.example_args)
        return
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
