"""The user-level DP step against the example-level one, side by side in one run, at the same records per batch.

For each model of benchmarks/dp_step_speed.py (its batch sizes), one full step (forward, backward, clip, noise,
optimizer step) of:

- ``plain``: plain PyTorch (the floor);
- ``example``: fxdp's default, the compiled model with the book-keeping sink and the DPOptimizer, every record
  its own unit;
- ``user``: the same model and batch with the UserLevelDPOptimizer, the batch's records grouped into users of
  ``--records-per-user`` records (4 by default): per-user norms (fxdp/sinks/bookkeeping/users.py), one clip
  factor per user.
- ``user-materialised`` (``--materialised``): the user step with per-sample gradients materialised
  (GradSampleSink: index_add per user), for comparison.

Engines take turns (``models.median_ms``), so drift in the machine's load hits all alike. The issue's target:
``user / example <= 1.1``.

Usage: python benchmarks/user_level_speed.py [--models mlp,cnn,resnet,transformer,lstm] [--repeats 10]
       [--records-per-user 4] [--threads 2] [--cpu-time] [--materialised]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from dp_step_speed import BATCH, CLIP, LR, NOISE, plain_step  # noqa: E402

import fxdp  # noqa: E402
from fxdp.optim import DPOptimizer, UserLevelDPOptimizer  # noqa: E402
from fxdp.sinks.bookkeeping import BookkeepingSink  # noqa: E402
from fxdp.sinks.contract import sink_of  # noqa: E402

ROWS = "rows of the models: "  # --rows-only: the rows as one line of JSON (benchmarks/compare_revisions.py)


def example_step(model, x, y, per_user: int, materialised: bool = False) -> Callable[[], None]:
    sink = BookkeepingSink()
    dp_model = fxdp.compile_for_dp(model, example_inputs=x, sink=sink)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), noise_multiplier=NOISE, max_grad_norm=CLIP,
                      expected_batch_size=len(x), sink=sink)

    def step():
        opt.zero_grad()
        F.cross_entropy(dp_model(x), y).backward()
        opt.step()

    return step


def user_step(model, x, y, per_user: int, materialised: bool = False) -> Callable[[], None]:
    sink = None if materialised else BookkeepingSink()
    dp_model = fxdp.compile_for_dp(model, example_inputs=x, sink=sink)
    users = len(x) // per_user
    counts = torch.full((users,), per_user, dtype=torch.long)
    counts[-1] += len(x) - users * per_user  # (the last user takes the rest)
    opt = UserLevelDPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), noise_multiplier=NOISE,
                               max_grad_norm=CLIP, expected_batch_size=users, sink=sink_of(dp_model))

    def step():
        opt.zero_grad()
        opt.observe_batch(empty=False, users=counts)  # what the user-level loader tells at each batch
        F.cross_entropy(dp_model(x), y).backward()
        opt.step()

    return step


def measure(name: str, repeats: int, per_user: int, clock, materialised: bool):
    (factory, make_x, classes), n = models.CASES[name], BATCH[name]
    torch.manual_seed(0)
    model = factory()
    x, y = make_x(n), torch.randint(0, classes, (n,))
    makers = {"plain": lambda m: plain_step(m, x, y), "example": lambda m: example_step(m, x, y, per_user),
              "user": lambda m: user_step(m, x, y, per_user)}
    if materialised:
        makers["user-materialised"] = lambda m: user_step(m, x, y, per_user, materialised=True)
    steps = {engine: make(copy.deepcopy(model)) for engine, make in makers.items()}
    ms = models.median_ms(steps, repeats, clock=clock)
    return [[name, n, n // per_user, engine, f"{ms[engine]:.1f}", f"{ms[engine] / ms['plain']:.2f}",
             "" if engine == "plain" or engine == "example" else f"{ms[engine] / ms['example']:.2f}"]
            for engine in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,resnet,transformer,lstm")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--records-per-user", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, each step timed by its CPU time")
    parser.add_argument("--materialised", action="store_true", help="also the user step with p.grad_sample")
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # compare_revisions.py
    args = parser.parse_args()
    torch.set_num_threads(1 if args.cpu_time else args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    rows = []
    for name in args.models.split(","):
        rows += measure(name, args.repeats, args.records_per_user, clock, args.materialised)
    if args.rows_only:
        print(ROWS + json.dumps(rows))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{'CPU time' if args.cpu_time else 'wall time'}, median of {args.repeats} steps, engines taking turns")
    print(tabulate(rows, headers=["model", "records", "users", "step", "ms", "x plain", "x example"]))


if __name__ == "__main__":
    main()
