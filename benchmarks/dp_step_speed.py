"""Time one full DP-SGD training step (forward, backward, clip, noise, optimizer step), side by side in one
run, engines taking turns, as a ratio to a non-private step (forward, backward, optimizer step):

- ``plain``: plain PyTorch, the floor (ratio 1.00);
- ``noise only``: just the noise draws of one step (see :func:`noise_only`): how much of a DP step's cost
  beyond a plain one no implementation drawing torch's Gaussian noise can avoid;
- ``fxdp``: the compiled model with the book-keeping sink and fxdp's DP optimizer;
- ``fxdp-compiled`` (only when named in ``--engines``): ``make_private(..., compile=True)``, where this fxdp has
  that option; "not available" where it does not (``make_private`` refuses the keyword with a TypeError);
- ``opacus-hooks`` / ``opacus-ghost`` / ``opacus-functorch`` / ``opacus-ew``: every Opacus mode that runs
  the model (``pip install opacus``; not a dependency of fxdp). A mode that fails on a model is listed
  with its error instead of a time. Opacus needs its own LSTM (``opacus.layers.DPLSTM``, with the same
  state_dict) and attention (``DPMultiheadAttention``): its ``ModuleValidator.fix`` swaps them in for the
  ``lstm`` and ``torch-transformer`` models; fxdp trains the stock ``nn.LSTM`` and ``nn.MultiheadAttention``.

Peak memory: the largest amount of memory torch allocated above its level at the start of a step, from
the torch profiler's CPU memory events (``profile_memory=True``; each op's own allocations minus frees,
summed in start order), one profiled step per engine after the timed ones. Python objects are not counted.
Page faults: the median of three more steps per engine, taking turns, of the minor page faults the process
took (``getrusage``): memory the C library handed back to the system after a step and takes again.

Each model is measured in a fresh Python process of its own (``--same-process``: all in this one), as a
user trains one model per process. In one shared process a model's times depended on the models measured
before it: the C library's allocator raises its thresholds each time a large block is freed (up to 32 MiB)
and then serves large blocks without new pages, which helps an engine that allocates much each step. Opacus's
ExpandedWeights on the transformer measured 1.31-1.47x a plain step after the other four models and 1.66-1.83x
alone (see docs/performance.md), fxdp 1.37-1.44 and 1.38-1.40.

Usage: python benchmarks/dp_step_speed.py [--repeats 20] [--threads 2]
       [--models mlp,cnn,resnet,transformer,torch-transformer,lstm,deep-narrow]
       [--engines fxdp,opacus-ghost] [--cpu-time] [--same-process] [--device cuda] [--batch-scale 4] [--batch 8]
(``--cpu-time``: one intra-op thread, each step timed by that thread's CPU time, which other jobs on a shared
machine disturb far less than wall time; the targets are set for wall time at 2 threads on a quiet machine.
``--device cuda``: models and batches on the GPU, each step ended by ``torch.cuda.synchronize()`` so that its
time includes its kernels, peak memory from ``torch.cuda.max_memory_allocated``; ``--batch-scale`` multiplies
every batch size, since the sizes above leave a GPU mostly waiting on kernel launches; ``--batch`` sets every
model's batch size instead, as benchmarks/gpu_suite.py does.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import fxdp  # noqa: E402
from fxdp.sinks.bookkeeping import BookkeepingSink  # noqa: E402

# name -> batch size; the sizes the issue names
BATCH = {"mlp": 256, "cnn": 256, "resnet": 64, "transformer": 32, "torch-transformer": 32, "lstm": 32,
         "deep-narrow": 4}
NOISE, CLIP, LR = 1.0, 1.0, 0.05
DEVICE = "cpu"  # --device
OPACUS_MODES = ("hooks", "ghost", "functorch", "ew")


def plain_step(model, x, y) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def noise_only(model, x, y) -> Callable[[], None]:
    """Only the Gaussian noise of a DP-SGD step: one draw of N(0, (sigma C)^2) per trainable parameter from
    torch's CPU generator, which fxdp and Opacus both add to every step. Its ratio to the plain step is a
    floor under (DP step / plain step - 1) for any DP-SGD that draws its noise this way: torch's CPU sampler
    runs on one thread, whatever the number of threads."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:
            torch.normal(0.0, NOISE * CLIP, size=p.shape, device=p.device)

    return step


def fxdp_step(model, x, y) -> Callable[[], None]:
    """The compiled model delivering to a book-keeping sink, and fxdp's DP optimizer reading it."""
    from fxdp.optim import DPOptimizer  # noqa: E402  (fails, and is reported, where fxdp.optim is missing)

    sink = BookkeepingSink()
    dp_model = fxdp.compile_for_dp(model, example_inputs=x, sink=sink)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), noise_multiplier=NOISE, max_grad_norm=CLIP,
                      expected_batch_size=len(x), sink=sink)

    def step():
        opt.zero_grad()
        F.cross_entropy(dp_model(x), y).backward()
        opt.step()

    return step


class NotAvailable(Exception):
    """An engine this installation does not have (reported as "not available", not as a failure)."""


def fxdp_compiled_step(model, x, y) -> Callable[[], None]:
    """``fxdp.PrivacyEngine().make_private(..., compile=True)``, where that option exists."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    try:
        dp_model, opt, _ = fxdp.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
            noise_multiplier=NOISE, max_grad_norm=CLIP, poisson_sampling=False, compile=True)
    except TypeError as exc:
        if "compile" in str(exc) and "unexpected keyword" in str(exc):
            raise NotAvailable("make_private(..., compile=True) is not in this fxdp") from exc
        raise

    def step():
        opt.zero_grad()
        F.cross_entropy(dp_model(x), y).backward()
        opt.step()

    step(), step()  # compiled on the first calls, not in the timed ones
    return step


def opacus_step(mode: str):
    def make(model, x, y) -> Callable[[], None]:
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        if any(isinstance(m, (nn.LSTM, nn.MultiheadAttention)) for m in model.modules()):
            model = ModuleValidator.fix(model)  # Opacus trains its DPLSTM / DPMultiheadAttention instead
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
        kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
                      noise_multiplier=NOISE, max_grad_norm=CLIP, grad_sample_mode=mode, poisson_sampling=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mode == "ghost":  # ghost clipping runs its second backward from the loss it wraps
                dp_model, opt, criterion, _ = PrivacyEngine().make_private(criterion=nn.CrossEntropyLoss(), **kwargs)
            else:
                dp_model, opt, _ = PrivacyEngine().make_private(**kwargs)
                criterion = nn.CrossEntropyLoss()

        def step():
            with warnings.catch_warnings():  # Opacus's hooks warn at every step
                warnings.simplefilter("ignore")
                criterion(dp_model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        step()  # a mode that cannot run the model fails here, not in the timed loop
        return step

    return make


def synchronised(step: Callable[[], None]) -> Callable[[], None]:
    """On a GPU, the step returns once its kernels have run (else the clock would time their launch only)."""
    if DEVICE == "cpu":
        return step

    def run():
        step()
        torch.cuda.synchronize()

    return run


def peak_memory_mb(step: Callable[[], None]) -> float:
    """Peak of torch's allocations during one step, above the level at its start: the torch profiler's CPU
    memory events, or on a GPU the CUDA allocator's own peak."""
    if DEVICE != "cpu":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak / 2**20


def measure(name, repeats, engines=None, clock=time.perf_counter, batch_scale=1, batch=None):
    """The table's rows for one model: every engine's step built from one copy each of the same model and
    batch, timed taking turns, then one profiled step each for peak memory."""
    try:
        import opacus  # noqa: F401

        opacus_modes = OPACUS_MODES
    except ImportError:
        opacus_modes = ()
        print("opacus is not installed: only fxdp is timed (pip install opacus to compare)")
    makers = {"plain": plain_step, "noise only": noise_only, "fxdp": fxdp_step,
              **{f"opacus-{m}": opacus_step(m) for m in opacus_modes}}
    if "fxdp-compiled" in (engines or ()):
        makers["fxdp-compiled"] = fxdp_compiled_step
    if engines:
        makers = {k: v for k, v in makers.items() if k in ("plain", "noise only") or k in engines}
    (factory, make_x, classes), n = models.CASES[name], batch or BATCH[name] * batch_scale
    torch.manual_seed(0)
    model = factory().to(DEVICE)
    x, y = make_x(n).to(DEVICE), torch.randint(0, classes, (n,)).to(DEVICE)
    steps, failed = {}, {}
    for engine, make in makers.items():
        try:
            steps[engine] = synchronised(make(copy.deepcopy(model), x, y))
        except NotAvailable as exc:
            failed[engine] = ("not available", str(exc))
        except Exception as exc:  # reported in the table, never hidden
            failed[engine] = ("fails", f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
    ms = models.median_ms(steps, repeats, clock=clock)
    faults = page_faults(steps)
    memory = {engine: peak_memory_mb(step) for engine, step in steps.items()}
    rows = []
    for engine in makers:
        if engine in failed:
            rows.append([name, n, engine, failed[engine][0], "", "", "", "", failed[engine][1]])
            continue
        rows.append([name, n, engine, f"{ms[engine]:.1f}", f"{ms[engine] / ms['plain']:.2f}",
                     f"{memory[engine]:.0f}", f"{memory[engine] / max(memory['plain'], 1e-9):.2f}",
                     faults.get(engine, "n/a"), ""])
    return rows


def page_faults(steps, rounds: int = 3) -> dict:
    """Median minor page faults of one step per engine (``getrusage``), engines taking turns as when timed:
    memory the C library gave back to the system and takes again. Empty where ``resource`` is missing."""
    try:
        import resource
    except ImportError:  # Windows has no resource module
        return {}
    counts = {engine: [] for engine in steps}
    for _ in range(rounds):
        for engine, step in steps.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step()
            counts[engine].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {engine: int(statistics.median(c)) for engine, c in counts.items()}


ROWS = "rows of one model: "  # how a model's own process hands its rows to the parent (one line of JSON)


def measure_in_own_process(name, argv) -> list:
    """:func:`measure` for one model in a fresh Python process (this script with ``--models name``)."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--models", name, "--rows-only"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith(ROWS):
        raise RuntimeError(f"measuring {name} in its own process failed (exit {done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    print("\n".join(lines[:-1]), end="\n" if len(lines) > 1 else "")
    return json.loads(lines[-1][len(ROWS):])


def run(names, repeats, engines=None, clock=time.perf_counter, same_process=False, argv=(), batch_scale=1,
        batch=None):
    rows, own = [], not same_process and len(names) > 1
    for name in names:
        rows += (measure_in_own_process(name, argv) if own
                 else measure(name, repeats, engines, clock, batch_scale, batch))
    timed = "CPU time of the one thread" if clock is time.thread_time else "wall time"
    if DEVICE != "cpu":
        timed += f" on {torch.cuda.get_device_name()}"
    where = "all models in one process" if same_process and len(names) > 1 else "each model in its own process"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {timed}, median of {repeats} steps per "
          f"engine; engines take turns; {where}; peak memory from "
          f"{'torch profiler CPU memory events' if DEVICE == 'cpu' else 'the CUDA allocator'}")
    print(tabulate(rows, headers=["model", "batch", "engine", "ms/step", "vs plain", "peak MiB", "mem vs plain",
                                 "page faults/step", "error"],
                   tablefmt="github"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=",".join(BATCH))
    parser.add_argument("--engines", default="", help="comma-separated subset (plain always runs), default all")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (time.thread_time): steadier on a busy machine")
    parser.add_argument("--same-process", action="store_true",
                        help="measure all models in this one process (by default each has a fresh one)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU)")
    parser.add_argument("--batch-scale", type=int, default=1, help="multiplies every batch size (for a GPU)")
    parser.add_argument("--batch", type=int, default=None, help="every model's batch size (instead of BATCH's)")
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # a model's own process
    args = parser.parse_args()
    DEVICE = args.device
    torch.set_num_threads(1 if args.cpu_time else args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    engines = [e for e in args.engines.split(",") if e]
    if args.rows_only:
        print(ROWS + json.dumps(measure(args.models, args.repeats, engines, clock, args.batch_scale, args.batch)))
    else:
        argv = ["--repeats", str(args.repeats), "--threads", str(args.threads), "--engines", args.engines,
                "--device", args.device, "--batch-scale", str(args.batch_scale)]
        argv += ["--batch", str(args.batch)] if args.batch else []
        run(args.models.split(","), args.repeats, engines, clock, args.same_process,
            argv + (["--cpu-time"] if args.cpu_time else []), args.batch_scale, args.batch)
