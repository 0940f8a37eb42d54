"""fxdp's DP step at two revisions, side by side in one run: is a refactor free?

Each revision's own ``benchmarks/dp_step_speed.py`` measures one model (``--engines fxdp``: a plain step
and fxdp's DP step, taking turns) in a fresh Python process that imports fxdp from that revision's tree.
The revisions take turns too, model by model and round by round, so that both see the same machine.
What is compared is each run's ratio (DP step / plain step, and peak memory / plain), which the plain step
measured in the same process normalises.

``--user-level``: the user-level step instead (``benchmarks/user_level_speed.py``: the user-level step / the
example-level step at the same records, users of 4 records), measured by the working tree's script for both
revisions (an old revision may lack it), each importing fxdp from its own tree.

Usage: python benchmarks/compare_revisions.py OLD [NEW] [--models mlp,cnn,transformer] [--rounds 3]
       [--repeats 10] [--threads 2] [--cpu-time] [--user-level]
OLD and NEW are git revisions (NEW defaults to the working tree as it is, uncommitted changes included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = "rows of one model: "  # the line dp_step_speed.py's --rows-only prints


def export(revision: str, into: str) -> str:
    """The tree of ``revision`` (``git archive``) under ``into``."""
    tree = os.path.join(into, revision.replace("/", "_"))
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def fxdp_ratios(tree: str, model: str, repeats: int, threads: int, cpu_time: bool):
    """(DP step / plain step, peak memory / plain) of fxdp at ``tree`` on ``model``, in a fresh process."""
    script = os.path.join(tree, "benchmarks", "dp_step_speed.py")
    cmd = [sys.executable, script, "--models", model, "--engines", "fxdp", "--repeats", str(repeats),
           "--threads", str(threads), "--rows-only"] + (["--cpu-time"] if cpu_time else [])
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    lines = done.stdout.splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith(ROWS):
        raise RuntimeError(f"{model} at {tree} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    rows = json.loads(lines[-1][len(ROWS):])
    fxdp = next(row for row in rows if row[2] == "fxdp")
    if fxdp[3] == "fails":
        raise RuntimeError(f"fxdp fails on {model} at {tree}: {fxdp[-1]}")
    return float(fxdp[4]), float(fxdp[6])


def user_level_ratios(tree: str, model: str, repeats: int, threads: int, cpu_time: bool):
    """(user-level step / example-level step, user-level step / plain) of fxdp at ``tree`` on ``model``, in a fresh
    process, measured by the working tree's benchmarks/user_level_speed.py."""
    script = os.path.join(ROOT, "benchmarks", "user_level_speed.py")
    cmd = [sys.executable, script, "--models", model, "--repeats", str(repeats), "--threads", str(threads),
           "--rows-only"] + (["--cpu-time"] if cpu_time else [])
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": tree})
    marker = "rows of the models: "
    lines = done.stdout.splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith(marker):
        raise RuntimeError(f"{model} at {tree} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    user = next(row for row in json.loads(lines[-1][len(marker):]) if row[3] == "user")
    return float(user[6]), float(user[5])


def spread(values) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default=None, help="a git revision (default: the working tree)")
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, each step timed by its CPU time (steadier on a shared machine)")
    parser.add_argument("--user-level", action="store_true",
                        help="the user-level step / the example-level step (benchmarks/user_level_speed.py)")
    args = parser.parse_args()
    measure = user_level_ratios if args.user_level else fxdp_ratios
    with tempfile.TemporaryDirectory() as tmp:
        trees = {args.old: export(args.old, tmp), (args.new or "working tree"): export(args.new, tmp) if args.new else ROOT}
        ratios = {(rev, m): [] for rev in trees for m in args.models.split(",")}
        for _ in range(args.rounds):
            for model in args.models.split(","):
                for rev, tree in trees.items():
                    ratios[rev, model].append(measure(tree, model, args.repeats, args.threads, args.cpu_time))
    (old, new), rows = list(trees), []
    for model in args.models.split(","):
        before = [r[0] for r in ratios[old, model]]
        after = [r[0] for r in ratios[new, model]]
        rows.append([model, spread(before), spread(after), f"{statistics.median(after) / statistics.median(before):.2f}",
                     spread([r[1] for r in ratios[old, model]]), spread([r[1] for r in ratios[new, model]])])
    what, first, second = (("user-level step / example-level step", "user/example", "user/plain") if args.user_level
                           else ("fxdp DP step / plain step", "time", "memory"))
    print(f"{what}, {args.rounds} rounds of {args.repeats} steps, revisions taking turns, "
          + ("1 thread, CPU time" if args.cpu_time else f"{args.threads} threads, wall time"))
    print(tabulate(rows, headers=["model", f"{first} {old}", f"{first} {new}", "new/old (medians)",
                                  f"{second} {old}", f"{second} {new}"], tablefmt="github"))


if __name__ == "__main__":
    main()
