"""The ``--noise`` options the examples share: DP-SGD's independent noise, or noise correlated across steps
(banded matrix factorization, a BLT; docs/correlated_noise.md), its strategy optimised for the run's steps."""

from __future__ import annotations

import argparse

NOISES = ("gaussian", "banded-mf", "blt")


def add_noise_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--noise", default="gaussian", choices=NOISES,
                        help="gaussian: DP-SGD's independent noise; banded-mf / blt: noise correlated across steps")
    parser.add_argument("--bands", type=int, default=4, help="bands of --noise banded-mf")
    parser.add_argument("--buffers", type=int, default=3, help="buffers of --noise blt")


def noise_mechanism_for(args: argparse.Namespace, batches_per_epoch: int):
    """``"gaussian"``, or the correlated noise mechanism of ``--noise``, its strategy optimised for the run's steps."""
    if args.noise == "gaussian":
        return "gaussian"
    from fxdp.optim.correlated import BandedMatrixFactorization, BufferedLinearToeplitz, optimize_banded_toeplitz

    if args.noise == "banded-mf":  # make_private's cyclic loader: the batches of a pass rounded up to bands
        steps = args.epochs * -(-batches_per_epoch // args.bands) * args.bands
        return BandedMatrixFactorization(coefficients=optimize_banded_toeplitz(args.bands, steps))
    # BLT: make_private's fixed-epoch loader puts a sample's steps one epoch (batches_per_epoch steps) apart
    return BufferedLinearToeplitz.optimized(args.buffers, steps=args.epochs * batches_per_epoch,
                                            min_separation=batches_per_epoch)


def expected_error_against_dp_sgd(args: argparse.Namespace, optimizer, batches_per_epoch: int) -> str:
    """The expected error of the correlated noise against DP-SGD's at the same epsilon and number of steps (DP-SGD
    with Poisson sampling at rate 1 / batches per epoch), before training."""
    from fxdp.accounting import get_noise_multiplier
    from fxdp.optim.correlated import error_report

    steps = args.epochs * batches_per_epoch
    dp_sgd = get_noise_multiplier(target_epsilon=args.target_epsilon, target_delta=args.delta,
                                  sample_rate=1 / batches_per_epoch, steps=steps, accountant="pld")
    return error_report([("gaussian", None, dp_sgd), (args.noise, optimizer.noise_mechanism,
                                                      optimizer.noise_multiplier)], steps)


def sampling_of(args: argparse.Namespace, loader) -> str:
    """How the loader samples, for the examples' set-up line."""
    if args.noise == "gaussian":
        return "Poisson sampling"
    return f"{args.noise} noise, cyclic sampling of {loader.partitions} parts, each part"
