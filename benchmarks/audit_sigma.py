"""The audit's lower bound on epsilon next to the accountant's epsilon, across noise multipliers.

    python benchmarks/audit_sigma.py                      # the table (markdown) for docs/audit.md
    python benchmarks/audit_sigma.py --plot docs/audit_sigma.png

One audited run per (sigma, canary kind): MLP 64-32-10 on digits (scikit-learn's, or the stand-in of
the same size when it is not installed), C = 1, batch 64, 2 epochs, 1000 canaries, delta = 1e-5, 95%
confidence, seed 0 — the settings of ``fxdp audit`` and of tests/audit/test_audit.py.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from fxdp.audit import epsilon_lower_bound, guess_grid, one_run
from fxdp.audit.digits import digits

SIGMAS = (0.0, 0.1, 0.5, 1.0, 2.0)


def measure(sigma: float, canary: str, args) -> dict:
    data, _ = digits(args.seed)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    start = time.perf_counter()
    result = one_run(model, data, noise_multiplier=sigma, max_grad_norm=1.0, batch_size=64, epochs=args.epochs,
                     canaries=args.canaries, canary=canary, delta=1e-5, confidence=0.95, seed=args.seed)
    return {"sigma": sigma, "canary": canary, "result": result, "seconds": time.perf_counter() - start}


def ceiling(canaries: int) -> float:
    """The highest bound ``canaries`` canaries can give: every guess of the best grid pair right."""
    grid = guess_grid(canaries)
    return max(epsilon_lower_bound(canaries, kp + kn, kp + kn, delta=1e-5, confidence=1 - 0.05 / len(grid))
               for kp, kn in grid)


def table(rows) -> str:
    lines = ["| sigma | epsilon claimed (RDP) | lower bound, gradient canaries | right guesses | "
             "lower bound, input canaries | right guesses |",
             "|---|---|---|---|---|---|"]
    by_sigma = {}
    for row in rows:
        by_sigma.setdefault(row["sigma"], {})[row["canary"]] = row["result"]
    for sigma, results in by_sigma.items():
        g, i = results["gradient"], results.get("input")
        claimed = "∞ (no noise)" if math.isinf(g.epsilon_claimed) else f"{g.epsilon_claimed:.2f}"
        cells = [f"{sigma:g}", claimed, f"{g.epsilon_lower:.2f}", f"{g.correct} / {g.guesses}"]
        cells += [f"{i.epsilon_lower:.2f}", f"{i.correct} / {i.guesses}"] if i else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path: str, top: float = 7.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grad = [r for r in rows if r["canary"] == "gradient"]
    inp = [r for r in rows if r["canary"] == "input"]
    xs = range(len(grad))  # one slot per sigma, evenly spaced
    fig, ax = plt.subplots(figsize=(5.6, 4.0), dpi=100)
    claims = [r["result"].epsilon_claimed for r in grad]
    ax.plot(xs, [min(c, top) for c in claims], "o-", color="tab:gray", label="claimed (accountant, RDP)")
    for x, c in zip(xs, claims):
        if c > top:  # off the scale: say how far
            ax.annotate("∞" if math.isinf(c) else f"{c:.0f}", (x, top), textcoords="offset points",
                        xytext=(-6, -13), fontsize=8, color="tab:gray")
    ax.plot(xs, [r["result"].epsilon_lower for r in grad], "s-", color="tab:blue",
            label="lower bound, gradient canaries")
    if inp:
        ax.plot(xs, [r["result"].epsilon_lower for r in inp], "^-", color="tab:orange",
                label="lower bound, input canaries")
    canaries = grad[0]["result"].canaries
    ax.axhline(ceiling(canaries), color="tab:blue", linestyle=":", linewidth=1,
               label=f"most {canaries} canaries can show (every guess right)")
    ax.set_xticks(list(xs), [f"{r['sigma']:g}" for r in grad])
    ax.set_xlabel("noise multiplier σ")
    ax.set_ylabel("ε at δ = 1e-5")
    ax.set_ylim(0, top * 1.08)
    ax.set_title("One-run audit: digits MLP, 2 epochs, 1000 canaries, 95%", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sigmas", type=float, nargs="+", default=list(SIGMAS))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-input", action="store_true", help="gradient canaries only")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of the bounds and claims")
    args = parser.parse_args()
    _, source = digits(args.seed)
    print(f"data: {source}")
    rows = []
    for sigma in args.sigmas:
        for canary in ("gradient",) if args.no_input else ("gradient", "input"):
            row = measure(sigma, canary, args)
            r = row["result"]
            print(f"sigma={sigma:g} {canary:8s} lower={r.epsilon_lower:.3f} claimed={r.epsilon_claimed:.3f} "
                  f"right={r.correct}/{r.guesses} ({row['seconds']:.1f} s)", flush=True)
            rows.append(row)
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
