"""The audit's lower bound on epsilon next to the accountant's epsilon, across noise multipliers.

    python benchmarks/audit_sigma.py                      # the table (markdown) for docs/audit.md
    python benchmarks/audit_sigma.py --plot docs/audit_sigma.png

One audited run per (sigma, canary kind): MLP 64-32-10 on digits (scikit-learn's, or the stand-in of
the same size when it is not installed), C = 1, batch 64, 2 epochs, 1000 canaries, delta = 1e-5, 95%
confidence, seed 0 — the settings of ``fxdp audit`` and of tests/test_audit.py.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from fxdp.audit import one_run
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


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grad = [r for r in rows if r["canary"] == "gradient"]
    inp = [r for r in rows if r["canary"] == "input"]
    sigmas = [r["sigma"] for r in grad]
    cap = 1.3 * max(r["result"].epsilon_claimed for r in grad if math.isfinite(r["result"].epsilon_claimed))
    fig, ax = plt.subplots(figsize=(5.2, 3.4), dpi=100)
    claimed = [min(r["result"].epsilon_claimed, cap) for r in grad]
    ax.plot(sigmas, claimed, "o-", color="tab:gray", label="claimed (accountant, RDP)")
    ax.plot(sigmas, [r["result"].epsilon_lower for r in grad], "s-", color="tab:blue",
            label="lower bound, gradient canaries")
    if inp:
        ax.plot([r["sigma"] for r in inp], [r["result"].epsilon_lower for r in inp], "^-", color="tab:orange",
                label="lower bound, input canaries")
    for r, y in zip(grad, claimed):
        if not math.isfinite(r["result"].epsilon_claimed) or r["result"].epsilon_claimed > cap:
            ax.annotate("claimed: " + ("∞" if math.isinf(r["result"].epsilon_claimed) else
                                       f"{r['result'].epsilon_claimed:.0f}") + " (off scale)",
                        (r["sigma"], y), textcoords="offset points", xytext=(6, -4), fontsize=7)
    ax.set_xlabel("noise multiplier σ")
    ax.set_ylabel("ε at δ = 1e-5")
    ax.set_ylim(0, cap * 1.05)
    ax.set_title("One-run audit, digits MLP, 1000 canaries, 95%", fontsize=9)
    ax.legend(fontsize=7)
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
