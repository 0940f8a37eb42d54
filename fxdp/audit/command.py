"""``fxdp audit``: audit a private training run of an MLP (64-32-10) on digits from the command line.

Prints the :class:`~fxdp.audit.bound.AuditResult`. Exit status: 0 the lower bound does not exceed the
accountant's epsilon, 1 it does (the run leaks more than claimed), 2 usage errors.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

DESCRIPTION = (
    "Train an MLP (64-32-10) privately on digits with fxdp's PrivacyEngine while auditing the run with "
    "canaries (Steinke, Nasr & Jagielski 2023), and print the empirical lower bound on epsilon next to "
    "the accountant's epsilon. Exit status: 0 consistent, 1 the lower bound exceeds the claim, 2 usage error.")
EXAMPLE = "fxdp audit --noise-multiplier 1 --epochs 2 --canaries 1000"
NOISES = ("gaussian", "banded-mf", "blt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--noise-multiplier", type=float, required=True, metavar="SIGMA",
                   help="noise multiplier sigma of DP-SGD (0: no noise, no privacy)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, metavar="C", help="clipping bound (default 1)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    p.add_argument("--batch-size", type=int, default=64, help="expected Poisson batch size (default 64)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    p.add_argument("--canaries", type=int, default=1000, help="number of canaries, each in with probability "
                                                              "1/2 (default 1000)")
    p.add_argument("--canary", choices=("gradient", "input"), default="gradient",
                   help="gradient: white-box canaries in a parameter block of their own (default); "
                        "input: black-box random inputs with random labels, scored by their loss")
    p.add_argument("--delta", type=float, default=1e-5, help="delta of both epsilons (default 1e-5)")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the bound (default 0.95)")
    p.add_argument("--accountant", default=None,
                   help="the accountant that claims epsilon (default rdp; pld with --noise banded-mf or blt)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, canaries, sampling and noise")
    p.add_argument("--privacy-unit", choices=("example", "user"), default="example",
                   help="user: a user-level run (digits split into users of --records-per-user consecutive records), "
                        "audited with canary users whose records are all in or all out together")
    p.add_argument("--records-per-user", type=int, default=4, metavar="R",
                   help="records of each synthetic user with --privacy-unit user (default 4)")
    p.add_argument("--max-records-per-user", type=int, default=None, metavar="K",
                   help="k, the most records of a user in a step (default R)")
    p.add_argument("--canary-records", type=int, default=None,
                   help="records of each canary user (default k)")
    p.add_argument("--noise", choices=NOISES, default="gaussian",
                   help="gaussian: DP-SGD's independent noise (default); banded-mf / blt: noise correlated across "
                        "steps, with make_private's cyclic loader (accounted with PLD)")
    p.add_argument("--bands", type=int, default=4, help="bands of --noise banded-mf (default 4)")
    p.add_argument("--buffers", type=int, default=2, help="buffers of --noise blt (default 2)")


def run(args: argparse.Namespace) -> int:
    from fxdp.audit.digits import digits
    from fxdp.audit.one_run import one_run

    for name in ("epochs", "batch_size", "canaries", "records_per_user", "bands", "buffers"):
        if getattr(args, name) < 1:
            print(f"fxdp audit: error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if not 0 < args.confidence < 1:
        print("fxdp audit: error: --confidence must lie strictly between 0 and 1", file=sys.stderr)
        return 2
    data, source = digits(args.seed)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    print(f"data: {source}, {len(data)} samples; model: MLP 64-32-10", flush=True)
    extra = {}
    if args.privacy_unit == "user":
        k = args.max_records_per_user or args.records_per_user
        extra = dict(privacy_unit="user", user_ids=[i // args.records_per_user for i in range(len(data))],
                     max_records_per_user=k, canary_records=args.canary_records)
        print(f"users: {-(-len(data) // args.records_per_user)} of {args.records_per_user} records, up to {k} a "
              f"step; canary users of {min(args.canary_records or k, k)} records", flush=True)
    try:
        if args.noise != "gaussian":
            extra["noise_mechanism"] = _mechanism(args, -(-len(data) // args.batch_size))
            print(f"noise: {extra['noise_mechanism']!r}", flush=True)
        result = one_run(model, data, noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
                         batch_size=args.batch_size, epochs=args.epochs, canaries=args.canaries,
                         canary=args.canary, delta=args.delta, confidence=args.confidence, seed=args.seed,
                         lr=args.lr, accountant=args.accountant, **extra)
    except ValueError as exc:  # settings the PrivacyEngine, the accountant or the audit refuse
        print(f"fxdp audit: error: {exc}", file=sys.stderr)
        return 2
    print(result)
    return 0 if result.consistent else 1


def _mechanism(args: argparse.Namespace, batches: int):
    """The correlated noise of ``--noise``, its strategy optimised for the run's steps on make_private's cyclic
    loader (banded MF: the batches of a pass rounded up to a multiple of the bands; BLT: a sample's steps one pass
    apart)."""
    from fxdp.optim.correlated import BandedMatrixFactorization, BufferedLinearToeplitz, optimize_banded_toeplitz

    if args.noise == "banded-mf":
        steps = args.epochs * -(-batches // args.bands) * args.bands
        return BandedMatrixFactorization(coefficients=optimize_banded_toeplitz(args.bands, steps))
    return BufferedLinearToeplitz.optimized(args.buffers, steps=args.epochs * batches, min_separation=batches)
