"""The audit's lower bound on epsilon next to the accountant's, for user-level runs (canary users) and for runs
with correlated noise (banded MF, BLT), beside the example-level DP-SGD run of docs/audit.md, across sigma.

    python benchmarks/audit_units_and_noise.py            # the markdown table for docs/audit.md
    python benchmarks/audit_units_and_noise.py --runs user banded-mf --sigmas 1 --canaries 200   # a quick look

Each row is one ``fxdp audit`` run (the same code path: fxdp.audit.command), printed with the command that
reproduces it: MLP 64-32-10 on digits (scikit-learn's, or the stand-in of the same size), C = 1, batch 64,
2 epochs, lr 0.5, delta 1e-5, 95% confidence, seed 0. The runs:

- ``example``: DP-SGD, example level, RDP (docs/audit.md's table);
- ``user``: user level, digits split into users of 4 consecutive records (450 users, q = 1/29 of them per
  step), k = 4, canary users of 4 records each, RDP;
- ``banded-mf``: 4 bands (strategy optimised for the run's 64 steps), make_private's cyclic Poisson loader
  (32 steps a pass, each part sampled at q = 4/32), PLD;
- ``blt``: 2 buffers (optimised for 58 steps, a sample's steps 29 apart), fixed-epoch participation, PLD.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import time

RUNS = {
    "example": [],
    "user": ["--privacy-unit", "user", "--records-per-user", "4"],
    "banded-mf": ["--noise", "banded-mf", "--bands", "4"],
    "blt": ["--noise", "blt", "--buffers", "2"],
}


def audit(run: str, sigma: float, args) -> dict:
    from fxdp.audit import command

    argv = ["--noise-multiplier", f"{sigma:g}", "--epochs", str(args.epochs), "--canaries", str(args.canaries),
            "--seed", str(args.seed)] + RUNS[run]
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = command.run(parser.parse_args(argv))
    seconds = time.perf_counter() - start
    report = out.getvalue()
    lower = float(report.split("epsilon lower bound")[1].split()[0])
    claimed = float(report.split("epsilon claimed")[1].split()[0])
    right = report.split("guesses")[1].split("right")[0].split()
    return {"run": run, "sigma": sigma, "lower": lower, "claimed": claimed, "right": f"{right[0]} / {right[2]}",
            "code": code, "seconds": seconds, "command": "fxdp audit " + " ".join(argv)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--sigmas", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    p.add_argument("--canaries", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print("| run | σ | ε claimed | lower bound | right guesses | consistent | seconds |")
    print("|---|---|---|---|---|---|---|")
    commands = []
    for run in args.runs:
        for sigma in args.sigmas:
            row = audit(run, sigma, args)
            claimed = "∞" if math.isinf(row["claimed"]) else f"{row['claimed']:.2f}"
            print(f"| {run} | {sigma:g} | {claimed} | {row['lower']:.2f} | {row['right']} | "
                  f"{'yes' if row['code'] == 0 else 'NO'} | {row['seconds']:.0f} |", flush=True)
            commands.append(row["command"])
    print("\ncommands:")
    print("\n".join(commands))


if __name__ == "__main__":
    main()
