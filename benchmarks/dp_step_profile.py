"""Where fxdp's DP-SGD step spends its time beyond a non-private step: one model at a time, the phases of
each step timed separately (median over repeats, plain and DP steps taking turns), as fractions of the
plain step measured in the same run, so that a busy machine moves both alike.

Phases of the DP step (``make_private``'s default: the compiled model with the book-keeping sink):

- ``forward``, ``backward``: as in the plain step; backward includes the sink taking each layer's (A, G)
  (``capture``) and computing the per-sample norms when the pass ends (``norms``), listed separately;
- ``clip``: the optimizer's checks and clip factors (``squared_norms`` read, the factors);
- ``clipped sums``: ``sink.take_clipped_sums`` (one re-weighted weight-gradient product per layer);
- ``noise + write``: noise added into the sums in place, written to ``p.grad``;
- ``optimizer``: the wrapped optimizer's step; ``zero_grad``.

Usage: python benchmarks/dp_step_profile.py --model mlp [--repeats 20] [--threads 2] [--cpu-time] [--ops]
(``--cpu-time``: one thread, timed by its CPU time, which other jobs on a shared machine disturb less than
wall time; ``--ops`` also prints torch profiler's top ops of one DP step.)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from dp_step_speed import BATCH, CLIP, LR, NOISE  # noqa: E402

import fxdp  # noqa: E402
from fxdp.optim import DPOptimizer  # noqa: E402
from fxdp.sinks.bookkeeping import BookkeepingSink  # noqa: E402


CLOCK = time.perf_counter


class Timers:
    def __init__(self):
        self.current = defaultdict(float)
        self.steps = defaultdict(list)

    def wrap(self, obj, name: str, phase: str):
        """Time every call of ``obj.name`` into ``phase`` (an instance attribute shadows the method)."""
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = CLOCK()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[phase] += CLOCK() - t0

        setattr(obj, name, timed)

    def phase(self, phase: str, fn):
        t0 = CLOCK()
        out = fn()
        self.current[phase] += CLOCK() - t0
        return out

    def end_step(self):
        for k, v in self.current.items():
            self.steps[k].append(v)
        self.current = defaultdict(float)

    def medians_ms(self):
        return {k: statistics.median(v) * 1e3 for k, v in self.steps.items()}

    def minima_ms(self):
        return {k: min(v) * 1e3 for k, v in self.steps.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=list(BATCH))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ops", action="store_true")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (time.thread_time): steadier on a busy machine")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK, args.threads = time.thread_time, 1
    torch.set_num_threads(args.threads)

    (factory, make_x, classes), n = models.CASES[args.model], BATCH[args.model]
    torch.manual_seed(0)
    model = factory()
    x, y = make_x(n), torch.randint(0, classes, (n,))

    plain_model = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=LR)
    plain = Timers()

    sink = BookkeepingSink()
    dp_model = fxdp.compile_for_dp(model, example_inputs=x, sink=sink)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), noise_multiplier=NOISE, max_grad_norm=CLIP,
                      expected_batch_size=n, sink=sink)
    dp = Timers()
    dp.wrap(sink, "add", "  capture (in backward)")
    dp.wrap(sink, "_publish", "  norms (end of backward)")
    dp.wrap(opt, "_factors", "clip (checks, factors)")
    dp.wrap(sink, "take_clipped_sums", "clipped sums")
    dp.wrap(opt, "_write_private_grads", "_write")
    dp.wrap(opt.original_optimizer, "step", "optimizer")

    def plain_step():
        out = plain.phase("forward", lambda: plain_model(x))
        loss = F.cross_entropy(out, y)
        plain.phase("backward", loss.backward)
        plain.phase("optimizer", plain_opt.step)
        plain.phase("zero_grad", lambda: plain_opt.zero_grad(set_to_none=True))

    def dp_step():
        dp.phase("zero_grad", opt.zero_grad)
        out = dp.phase("forward", lambda: dp_model(x))
        loss = F.cross_entropy(out, y)
        dp.phase("backward", loss.backward)
        dp.phase("step", opt.step)

    for step in (plain_step, dp_step):
        step()
    plain.end_step(), dp.end_step()
    plain.steps.clear(), dp.steps.clear()
    total_plain, total_dp = [], []
    for _ in range(args.repeats):
        for step, timers, totals in ((plain_step, plain, total_plain), (dp_step, dp, total_dp)):
            t0 = CLOCK()
            step()
            totals.append(CLOCK() - t0)
            timers.end_step()
    base, base_min = statistics.median(total_plain) * 1e3, min(total_plain) * 1e3
    p, d, pm, dm = plain.medians_ms(), dp.medians_ms(), plain.minima_ms(), dp.minima_ms()
    for phases in (d, dm):
        phases["noise + write"] = phases.pop("_write") - phases["clipped sums"] - phases["clip (checks, factors)"]
        phases.pop("step")
    print(f"{args.model}, batch {n}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'CPU time' if args.cpu_time else 'wall time'}, "
          f"{args.repeats} steps each, taking turns; plain step {base:.1f} ms (min {base_min:.1f}), DP step "
          f"{statistics.median(total_dp) * 1e3:.1f} ms (min {min(total_dp) * 1e3:.1f}) = "
          f"{statistics.median(total_dp) * 1e3 / base:.2f} x plain (of minima: {min(total_dp) * 1e3 / base_min:.2f})")
    print(f"{'phase':28s} {'plain ms':>9s} {'dp ms':>9s} {'dp/plain':>9s} {'(minima)':>9s}")
    order = ["forward", "backward", "  capture (in backward)", "  norms (end of backward)", "clip (checks, factors)",
             "clipped sums", "noise + write", "optimizer", "zero_grad"]
    for k in order:
        print(f"{k:28s} {p.get(k, float('nan')):9.2f} {d.get(k, float('nan')):9.2f} {d.get(k, 0) / base:9.3f} "
              f"{dm.get(k, 0) / base_min:9.3f}")
    for plan_line in fxdp.sinks.bookkeeping.describe_plans(
            (type(m).__name__, plan) for m, plan in sink.plans.items()):
        print(plan_line)

    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            dp_step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
