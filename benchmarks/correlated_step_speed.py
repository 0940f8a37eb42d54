"""Time fxdp's DP step with correlated noise against the same step with independent noise, side by side in one run
(issue 35's target: the step with BLT at most 1.05x the step with independent noise on the models of
benchmarks/dp_step_speed.py).

Engines, taking turns on the same model and batch (each built as dp_step_speed.py's ``fxdp`` engine: the compiled
model, the book-keeping sink, fxdp's ``DPOptimizer``):

- ``plain``: plain PyTorch (forward, backward, SGD step), the floor;
- ``gaussian``: fxdp's DP step with independent noise (``noise_mechanism="gaussian"``, the default);
- ``blt``: the same step with ``BufferedLinearToeplitz`` noise of ``--buffers`` buffers;
- ``blt-foreach``: the same BLT noise computed as fxdp did before its state became one flat tensor
  (:class:`ForeachBLT`: ``torch._foreach_*`` calls per buffer over groups of parameters), to measure what that bought;
- ``blt-loop``: the same BLT noise computed as before the ``torch._foreach_*`` change, one loop over the parameters
  of per-tensor operations (:class:`LoopBLT`);
- ``banded``: with ``BandedMatrixFactorization(--bands)`` noise;
- ``tree``: with ``TreeAggregation`` noise (at most ``log2(steps) + 1`` node noises kept).

The mechanisms are set to follow a cycle that every step continues (the benchmark feeds the same batch each
step; the cycle check itself is timed). The ratios printed are each engine's median step over the ``gaussian``
one's. Each model runs in a fresh process of its own (as dp_step_speed.py). On a shared machine the step medians
vary by several percent between engines that do the same work; the noise of one step is therefore also timed
alone (the fastest of 60 calls), and its extra cost over the independent draw added to the gaussian step's median
("implied vs gaussian"): the ratio the correlated noise costs, less disturbed by the machine.

Usage: python benchmarks/correlated_step_speed.py [--repeats 20] [--cpu-time] [--threads 2]
       [--models mlp,cnn,resnet,transformer,lstm] [--engines blt,blt-foreach,blt-loop,banded,tree]
       [--buffers 4] [--bands 8]
(``--cpu-time``: one intra-op thread, each step timed by that thread's CPU time: steadier on a shared machine.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
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
from fxdp.optim import DPOptimizer  # noqa: E402
from fxdp.optim.correlated import BandedMatrixFactorization, BufferedLinearToeplitz, TreeAggregation  # noqa: E402
from fxdp.optim.noise import add_gaussian_noise_all_  # noqa: E402
from fxdp.sinks.bookkeeping import BookkeepingSink  # noqa: E402

PLANNED = 100_000  # the steps the BLT and tree noise are planned for (more than any run here takes)
# a BLT of 1..8 buffers: decays spread in (0, 1), scales summing to below 1 (the bounds of fxdp's sensitivity)
THETA = [0.999, 0.99, 0.95, 0.8, 0.6, 0.4, 0.2, 0.1]
OMEGA = [0.05, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05]


class LoopBLT(BufferedLinearToeplitz):
    """BLT noise computed with a Python loop over the parameters, per-tensor operations (fxdp's code before it used
    ``torch._foreach_*``): the same recurrence, its state one list of tensors per buffer."""

    def add_noise_(self, outs, std, *, secure_mode=False, generator=None):
        draws = self._unit_draws(outs, secure_mode, generator)
        for k, (out, w) in enumerate(zip(outs, draws)):
            for omega, buffer in zip(self.omega, self._lists):
                w.sub_(buffer[k], alpha=omega)
            for theta, buffer in zip(self.theta, self._lists):
                buffer[k].mul_(theta).add_(w)
            out.add_(w, alpha=std * self.scale)
        self.steps += 1

    def _unit_draws(self, outs, secure_mode, generator):
        """The step checked, its unit draws (one zero tensor per out, the noise added), the state made at the first
        step: what both former recurrences do before their passes."""
        self.check_step()
        draws = [torch.zeros_like(out) for out in outs]
        add_gaussian_noise_all_(draws, 1.0, secure_mode=secure_mode, generator=generator)
        if not getattr(self, "_lists", None):
            self._lists = [[torch.zeros_like(out) for out in outs] for _ in self.theta]
        return draws


class ForeachBLT(LoopBLT):
    """BLT noise as fxdp computed it before its state became one flat tensor (fxdp.optim.correlated.blt_state):
    ``torch._foreach_*`` calls per buffer and operation on groups of consecutive parameters of at most 2^15 values
    (a larger one alone), ``3 d + 1`` passes over the state."""

    def add_noise_(self, outs, std, *, secure_mode=False, generator=None):
        draws = self._unit_draws(outs, secure_mode, generator)
        groups, held = [], 1 << 15
        for k, out in enumerate(outs):
            if held + out.numel() > 1 << 15:
                groups.append([])
                held = 0
            groups[-1].append(k)
            held += out.numel()
        for group in groups:
            w = [draws[k] for k in group]
            buffers = [[buffer[k] for k in group] for buffer in self._lists]
            for omega, buffer in zip(self.omega, buffers):
                torch._foreach_sub_(w, buffer, alpha=omega)
            for theta, buffer in zip(self.theta, buffers):
                torch._foreach_mul_(buffer, theta)
                torch._foreach_add_(buffer, w)
            torch._foreach_add_([outs[k] for k in group], w, alpha=std * self.scale)
        self.steps += 1


BLTS = {"blt": BufferedLinearToeplitz, "blt-foreach": ForeachBLT, "blt-loop": LoopBLT}


def mechanism(name: str, buffers: int, bands: int):
    if name in BLTS:
        return BLTS[name](THETA[:buffers], OMEGA[:buffers], steps=PLANNED)
    if name == "banded":
        return BandedMatrixFactorization(bands)
    if name == "tree":
        return TreeAggregation(steps=PLANNED)
    return "gaussian"


def fxdp_step(noise) -> Callable:
    def make(model, x, y) -> Callable[[], None]:
        sink = BookkeepingSink()
        dp_model = fxdp.compile_for_dp(model, example_inputs=x, sink=sink)
        if not isinstance(noise, str):  # every step continues the cycle (the same batch each step here)
            noise.follow_cycle(lambda: noise.steps % noise._separation, noise._separation)
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), noise_multiplier=NOISE, max_grad_norm=CLIP,
                          expected_batch_size=len(x), sink=sink, noise_mechanism=noise)

        def step():
            opt.zero_grad()
            F.cross_entropy(dp_model(x), y).backward()
            opt.step()

        return step

    return make


def measure(name: str, repeats: int, engines, buffers: int, bands: int, clock) -> list:
    makers = {"plain": plain_step, "gaussian": fxdp_step("gaussian"),
              **{e: fxdp_step(mechanism(e, buffers, bands)) for e in engines}}
    (factory, make_x, classes), n = models.CASES[name], BATCH[name]
    torch.manual_seed(0)
    model = factory()
    x, y = make_x(n), torch.randint(0, classes, (n,))
    steps = {engine: make(copy.deepcopy(model), x, y) for engine, make in makers.items()}
    ms = models.median_ms(steps, repeats, clock=clock)
    noise = noise_ms(model, engines, buffers, bands, clock)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    labels = {**{e: f"{e} ({buffers} buffers)" for e in BLTS}, "banded": f"banded ({bands} bands)"}
    rows = []
    for e in makers:
        extra = "" if e == "plain" else f"{noise[e] - noise['gaussian']:.3f}"
        implied = "" if e == "plain" else f"{(ms['gaussian'] + noise[e] - noise['gaussian']) / ms['gaussian']:.3f}"
        rows.append([name, parameters, labels.get(e, e), f"{ms[e]:.2f}", f"{ms[e] / ms['plain']:.3f}",
                     f"{ms[e] / ms['gaussian']:.3f}", "" if e == "plain" else f"{noise[e]:.3f}", extra, implied])
    return rows


def noise_ms(model, engines, buffers: int, bands: int, clock, repeats: int = 60) -> dict:
    """The noise of one step alone, on zero tensors shaped as the model's parameters: the fastest of ``repeats``
    calls, engines taking turns (the minimum: what the work costs when the shared machine lets it run; the step
    medians above carry the machine's noise). ``gaussian``: fxdp's independent draw (add_gaussian_noise_all_)."""
    grads = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    calls = {"gaussian": lambda: add_gaussian_noise_all_(grads, NOISE * CLIP)}
    for e in engines:
        mech = mechanism(e, buffers, bands)
        mech.follow_cycle(lambda mech=mech: mech.steps % mech._separation, mech._separation)
        calls[e] = lambda mech=mech: mech.add_noise_(grads, NOISE * CLIP)
    best = {e: float("inf") for e in calls}
    for _ in range(repeats):
        for e, call in calls.items():
            t0 = clock()
            call()
            best[e] = min(best[e], clock() - t0)
    return {e: t * 1e3 for e, t in best.items()}


ROWS = "rows of one model: "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--models", default="mlp,cnn,resnet,transformer,lstm")
    parser.add_argument("--engines", default="blt,blt-foreach,blt-loop,banded,tree")
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--bands", type=int, default=8)
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1 if args.cpu_time else args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    engines = [e for e in args.engines.split(",") if e]
    if args.rows_only:
        print(ROWS + json.dumps(measure(args.models, args.repeats, engines, args.buffers, args.bands, clock)))
        return
    rows = []
    for name in args.models.split(","):  # each model in a fresh process
        argv = _without_models(sys.argv[1:])
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--models", name, "--rows-only"],
                              capture_output=True, text=True)
        lines = done.stdout.splitlines()
        if done.returncode != 0 or not lines or not lines[-1].startswith(ROWS):
            raise RuntimeError(f"measuring {name} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        rows += json.loads(lines[-1][len(ROWS):])
    timed = "CPU time of the one thread" if args.cpu_time else f"wall time, {args.threads} threads"
    print(f"torch {torch.__version__}, {timed}, median of {args.repeats} steps per engine, engines taking turns, "
          "each model in its own process")
    print(tabulate(rows, headers=["model", "parameters", "engine", "ms/step", "vs plain", "vs gaussian",
                                  "noise ms (min)", "noise - gaussian's", "implied vs gaussian"], tablefmt="github"))
    print("implied vs gaussian: (the gaussian step's median + this noise's extra cost, measured alone) / the gaussian "
          "step's median")


def _without_models(argv):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--models":
            skip = True
            continue
        if not a.startswith("--models="):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
