"""Fine-tuning a GPT-2-architecture language model for sequence classification: one training step (forward,
backward, clip, noise, optimizer step) side by side in one run, engines taking turns, as a ratio to a plain step,
and the peak memory of each, for full fine-tuning and for LoRA (peft, rank ``--rank`` on the attention and
projection layers, the head trainable):

- ``plain``: plain PyTorch, the floor (ratio 1.00), once with every parameter trained, once with the adapters;
- ``noise only``: just the noise draws of one step (one ``torch.normal`` per trainable parameter, what Opacus
  adds): a floor under (DP step / plain step - 1) for any DP-SGD drawing torch's Gaussian noise so (on the CPU
  torch's sampler runs on one thread whatever the number of threads);
- ``fxdp noise only``: the same noise as fxdp's optimizer adds it (``fxdp.optim.add_gaussian_noise_all_``: a
  large CPU draw in blocks, each from a generator of its own, on torch's number of threads);
- ``fxdp``: ``fxdp.PrivacyEngine().make_private`` called as an Opacus user calls it, without example_inputs (the
  model is captured from the loader's first batch), book-keeping sink and DP optimizer;
- ``fxdp-compiled`` (only when named in ``--engines``): the same with ``compile=True``, where this fxdp's
  ``make_private`` has that option; "not available" where it does not (the keyword refused with a TypeError);
- ``opacus-hooks`` / ``opacus-ghost`` / ``opacus-functorch`` / ``opacus-ew``: every Opacus mode that runs the model
  (``pip install opacus``); a mode that fails on the model is listed with its error instead of a time.

The default sizes are those of issue 25: the real GPT-2 vocabulary (50,257), 4 layers, width 256, 4 heads,
128 tokens, batch 8; ``--size small`` is GPT-2 small (124M parameters: 12 layers, width 768, 12 heads), at 256
tokens. Batches are fixed (``poisson_sampling=False``): only the step is timed. Peak memory on the CPU is the
torch profiler's (see benchmarks/dp_step_speed.py), on a GPU ``torch.cuda.max_memory_allocated`` above the
level at the step's start.

``--device cuda`` runs every engine on the GPU (each step timed between two ``torch.cuda.synchronize``);
``--bf16`` runs forward and loss under ``torch.autocast`` in bfloat16 (parameters and the DP step in float32).

``--phases``: instead of the table, where fxdp's DP step spends its time beyond a plain step (full fine-tuning;
the phases of benchmarks/dp_step_profile.py, plain and DP steps taking turns, as fractions of the plain step),
with the noise draws alone as the floor.

Usage: python benchmarks/lm_finetune_speed.py [--phases] [--size small] [--device cuda] [--bf16] [--repeats 10]
       [--rounds 3] [--layers 4] [--width 256] [--heads 4] [--seq 128] [--batch 8] [--vocab 50257] [--rank 8]
       [--engines fxdp,opacus-ghost] [--threads 2] [--cpu-time] [--no-lora] [--no-full] [--json rows.json]
(``--json``: also write every row, as numbers, to a JSON file; benchmarks/gpu_suite.py reads it.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from dp_step_speed import peak_memory_mb  # noqa: E402

import fxdp  # noqa: E402

NOISE, CLIP, LR, LABELS = 1.0, 1.0, 1e-3, 2
OPACUS_MODES = ("hooks", "ghost", "functorch", "ew")
SIZES = {"issue": dict(layers=4, width=256, heads=4, seq=128), "small": dict(layers=12, width=768, heads=12, seq=256)}


def autocast(args):
    """The forward's context: bfloat16 autocast with ``--bf16``, else nothing."""
    if args.bf16:
        return torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def timed(args, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the GPU's queue drained before and after, so that a clock around it times the step's
    kernels and not their launch (on the CPU: ``step`` itself)."""
    if not args.device.startswith("cuda"):
        return step

    def synchronized():
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()

    return synchronized


def cuda_peak_memory_mb(step: Callable[[], None]) -> float:
    """The most memory torch's CUDA allocator held during one step, above the level at its start."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2**20


def build(args, lora: bool):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_positions=args.seq,
                                     vocab_size=args.vocab, num_labels=LABELS, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=1, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2ForSequenceClassification(config).train()
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=args.rank, lora_alpha=2 * args.rank,
                                                           lora_dropout=0.0, target_modules=["c_attn", "c_proj"],
                                                           fan_in_fan_out=True))
    return model.to(args.device)


def batch(args) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(2, args.vocab, (args.batch, args.seq), generator=gen),
              "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.long),
              "labels": torch.randint(0, LABELS, (args.batch,), generator=gen)}
    return {k: v.to(args.device) for k, v in inputs.items()}


def _loader(inputs):
    rows = [{k: v[i] for k, v in inputs.items()} for i in range(len(inputs["labels"]))]
    return DataLoader(rows, batch_size=len(rows))


def _split(inputs):
    return {k: v for k, v in inputs.items() if k != "labels"}, inputs["labels"]


def plain_step(args, inputs, lora):
    model = build(args, lora)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    x, y = _split(inputs)

    def step():
        with autocast(args):
            loss = F.cross_entropy(model(**x).logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def noise_step(args, inputs, lora):
    """Only the noise of a DP step: one draw of N(0, (sigma C)^2) per trainable parameter (see the docstring)."""
    params = [p for p in build(args, lora).parameters() if p.requires_grad]

    def step():
        for p in params:
            torch.normal(0.0, NOISE * CLIP, size=p.shape, device=p.device, dtype=torch.float32)

    return step


def fxdp_noise_step(args, inputs, lora):
    """Only the noise of fxdp's DP step: N(0, (sigma C)^2) added to a tensor of each trainable parameter's shape
    as its optimizer adds it (``add_gaussian_noise_all_``: large draws in blocks, in parallel)."""
    from fxdp.optim import add_gaussian_noise_all_

    grads = [torch.zeros_like(p, dtype=torch.float32) for p in build(args, lora).parameters() if p.requires_grad]
    return lambda: add_gaussian_noise_all_(grads, NOISE * CLIP)


class NotAvailable(Exception):
    """An engine this installation does not have (reported as "not available", not as a failure)."""


def fxdp_step(args, inputs, lora, **options):
    model = build(args, lora)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    try:
        dp_model, dp_opt, _ = fxdp.PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=_loader(inputs), noise_multiplier=NOISE, max_grad_norm=CLIP,
            poisson_sampling=False, **options)  # no example_inputs: captured from the loader's first batch
    except TypeError as exc:
        if options and "unexpected keyword" in str(exc):
            raise NotAvailable(f"make_private(..., {', '.join(options)}=...) is not in this fxdp") from exc
        raise
    x, y = _split(inputs)

    def step():
        dp_opt.zero_grad()
        with autocast(args):
            loss = F.cross_entropy(dp_model(**x).logits.float(), y)
        loss.backward()
        dp_opt.step()

    step()
    if options:  # compiled on the first calls, not in the timed ones
        step()
    try:
        report = fxdp.report(dp_model)
        return step, f"engine {report.engine} ({report.front_end})"
    except Exception:  # noqa: BLE001 - a compiled model may not answer fxdp.report; the step is what is timed
        return step, ""


def fxdp_compiled_step(args, inputs, lora):
    return fxdp_step(args, inputs, lora, compile=True)


def opacus_step(mode):
    def make(args, inputs, lora):
        from opacus import PrivacyEngine

        model = build(args, lora)
        kwargs = dict(module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR),
                      data_loader=_loader(inputs), noise_multiplier=NOISE, max_grad_norm=CLIP, grad_sample_mode=mode,
                      poisson_sampling=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mode == "ghost":
                dp_model, opt, criterion, _ = PrivacyEngine().make_private(criterion=torch.nn.CrossEntropyLoss(),
                                                                           **kwargs)
            else:
                dp_model, opt, _ = PrivacyEngine().make_private(**kwargs)
                criterion = torch.nn.CrossEntropyLoss()
        x, y = _split(inputs)

        def step():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with autocast(args):
                    loss = criterion(dp_model(**x).logits.float(), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        step()  # a mode that cannot run the model fails here, not in the timed loop
        return step

    return make


def phases(args, inputs) -> None:
    """Print the DP step's phases (full fine-tuning) as fractions of the plain step, medians over ``--repeats``."""
    import statistics

    import dp_step_profile

    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.device.startswith("cuda"):  # each phase's kernels finished before its timer reads the clock
        def clock():
            torch.cuda.synchronize()
            return time.perf_counter()
    dp_step_profile.CLOCK = clock
    plain_model = build(args, False)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=LR)
    model = build(args, False)
    dp_model, dp_opt, _ = fxdp.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=_loader(inputs),
        noise_multiplier=NOISE, max_grad_norm=CLIP, poisson_sampling=False)
    x, y = _split(inputs)
    noise, fxdp_noise = noise_step(args, inputs, False), fxdp_noise_step(args, inputs, False)
    plain, dp = dp_step_profile.Timers(), dp_step_profile.Timers()
    sink = dp_model.fxdp_sink
    dp.wrap(sink, "add", "  capture (in backward)")
    dp.wrap(sink, "_publish", "  norms (end of backward)")
    dp.wrap(dp_opt, "_factors", "clip (checks, factors)")
    dp.wrap(sink, "take_clipped_sums", "clipped sums")
    dp.wrap(dp_opt, "_write_private_grads", "_write")
    dp.wrap(dp_opt.original_optimizer, "step", "optimizer")

    def plain_step():
        with autocast(args):
            loss = plain.phase("forward", lambda: F.cross_entropy(plain_model(**x).logits.float(), y))
        plain.phase("backward", loss.backward)
        plain.phase("optimizer", plain_opt.step)
        plain.phase("zero_grad", lambda: plain_opt.zero_grad(set_to_none=True))

    def dp_step():
        dp.phase("zero_grad", dp_opt.zero_grad)
        with autocast(args):
            loss = dp.phase("forward", lambda: F.cross_entropy(dp_model(**x).logits.float(), y))
        dp.phase("backward", loss.backward)
        dp.phase("step", dp_opt.step)

    steps = {"plain": timed(args, plain_step), "dp": timed(args, dp_step), "noise": timed(args, noise),
             "fxdp noise": timed(args, fxdp_noise)}
    for step in steps.values():
        step()
    plain.steps.clear(), dp.steps.clear()
    plain.current.clear(), dp.current.clear()
    totals = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            t0 = clock()
            step()
            totals[name].append(clock() - t0)
        plain.end_step(), dp.end_step()
    base = statistics.median(totals["plain"]) * 1e3
    p, d = plain.medians_ms(), dp.medians_ms()
    # the noise and the writing of p.grad: what _write_private_grads takes besides the clipped sums it asks for
    d["noise + write"] = statistics.median(w - c for w, c in zip(dp.steps["_write"], dp.steps["clipped sums"])) * 1e3
    d.pop("_write"), d.pop("step")
    print(f"plain step {base:.1f} ms, DP step {statistics.median(totals['dp']) * 1e3:.1f} ms = "
          f"{statistics.median(totals['dp']) * 1e3 / base:.2f} x plain; the noise draws alone "
          f"{statistics.median(totals['noise']) * 1e3:.1f} ms = {statistics.median(totals['noise']) * 1e3 / base:.3f} "
          f"x plain (one torch.normal per parameter), as fxdp draws them "
          f"{statistics.median(totals['fxdp noise']) * 1e3:.1f} ms = "
          f"{statistics.median(totals['fxdp noise']) * 1e3 / base:.3f} x plain (medians of {args.repeats})")
    print(f"{'phase':28s} {'plain ms':>9s} {'dp ms':>9s} {'dp/plain step':>14s}")
    for k in ["forward", "backward", "  capture (in backward)", "  norms (end of backward)", "clip (checks, factors)",
              "clipped sums", "noise + write", "optimizer", "zero_grad"]:
        print(f"{k:28s} {p.get(k, float('nan')):9.2f} {d.get(k, float('nan')):9.2f} {d.get(k, 0) / base:14.3f}")


def measure(args, inputs, lora: bool):
    try:
        import opacus  # noqa: F401

        modes = OPACUS_MODES
    except ImportError:
        modes = ()
        print("opacus is not installed: only fxdp is timed (pip install opacus to compare)")
    makers: Dict[str, Callable] = {"plain": plain_step, "noise only": noise_step,
                                   "fxdp noise only": fxdp_noise_step, "fxdp": fxdp_step,
                                   **{f"opacus-{m}": opacus_step(m) for m in modes}}
    if "fxdp-compiled" in (args.engines or ()):
        makers["fxdp-compiled"] = fxdp_compiled_step
    if args.engines:
        floors = ("plain", "noise only", "fxdp noise only")
        makers = {k: v for k, v in makers.items() if k in args.engines or k in floors}
    steps, failed, notes = {}, {}, {}
    for name, make in makers.items():
        try:
            made = make(args, inputs, lora)
        except NotAvailable as exc:
            failed[name] = f"not available: {exc}"
            continue
        except Exception as exc:  # noqa: BLE001 - a mode that cannot run the model is a result too
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            continue
        step, notes[name] = made if isinstance(made, tuple) else (made, "")
        steps[name] = timed(args, step)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    ratios = {name: [] for name in steps}
    for _ in range(args.rounds):
        ms = models.median_ms(steps, args.repeats, warmup=1, clock=clock)
        for name in steps:
            ratios[name].append((ms[name], ms[name] / ms["plain"]))
    peak = cuda_peak_memory_mb if args.device.startswith("cuda") else peak_memory_mb
    memory = {name: peak(step) for name, step in steps.items()}
    rows = []
    for name in steps:
        times = ", ".join(f"{r:.2f}x" for _, r in ratios[name])
        mem = "-" if "noise only" in name else f"{memory[name]:.0f}"
        mem_ratio = "-" if "noise only" in name else f"{memory[name] / memory['plain']:.2f}x"
        rows.append([name, f"{ratios[name][-1][0]:.1f}", times, mem, mem_ratio, notes[name]])
        RESULTS.append(dict(lora=lora, batch=args.batch, engine=name, ms=ratios[name][-1][0],
                            ratios=[r for _, r in ratios[name]], peak_mib=memory[name],
                            memory_ratio=memory[name] / memory["plain"], error=""))
    rows += [[name, "-", error, "-", "-", ""] for name, error in failed.items()]
    RESULTS.extend(dict(lora=lora, batch=args.batch, engine=name, ms=None, ratios=[], peak_mib=None,
                        memory_ratio=None, error=error) for name, error in failed.items())
    return rows


RESULTS: list = []  # every row measure() made, as numbers (--json writes them)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="issue",
                        help="issue: 4 layers, width 256, 4 heads, T=128; small: GPT-2 small (12, 768, 12, T=256); "
                             "--layers/--width/--heads/--seq override it")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--bf16", action="store_true", help="forward and loss under bfloat16 autocast")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="independent timing rounds (a ratio per round)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--engines", type=lambda s: s.split(","), default=None,
                        help="comma-separated subset of fxdp, opacus-hooks, opacus-ghost, opacus-functorch, opacus-ew")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true", help="one intra-op thread, timed by its CPU time")
    parser.add_argument("--no-lora", action="store_true", help="full fine-tuning only")
    parser.add_argument("--no-full", action="store_true", help="LoRA only")
    parser.add_argument("--phases", action="store_true", help="where fxdp's full fine-tuning step spends its time")
    parser.add_argument("--json", default=None, help="also write every row, as numbers, to this JSON file")
    args = parser.parse_args()
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device.startswith("cuda") and args.cpu_time:
        parser.error("--cpu-time times the CPU's work; on a GPU the step is timed by wall clock")
    if args.cpu_time:
        torch.set_num_threads(1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    inputs = batch(args)
    where = (torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda")
             else f"CPU, {torch.get_num_threads()} thread(s)")
    print(f"GPT-2 architecture, sequence classification: {args.layers} layers, width {args.width}, {args.heads} heads, "
          f"vocab {args.vocab}, T={args.seq}, batch {args.batch}; torch {torch.__version__}, {where}, "
          f"{'CPU time' if args.cpu_time else 'wall time'}{', bf16 autocast' if args.bf16 else ''}")
    if args.phases:
        phases(args, inputs)
        return
    headers = ["engine", "ms/step", "x plain (per round)", "peak MiB", "x plain memory", ""]
    for lora in [v for v, off in ((False, args.no_full), (True, args.no_lora)) if not off]:
        title = f"LoRA r={args.rank} (attention and projections; head trainable)" if lora else "full fine-tuning"
        print(f"\n{title}")
        print(tabulate(measure(args, inputs, lora), headers=headers))
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": where, "torch": torch.__version__, "rows": RESULTS}, f, indent=1)


if __name__ == "__main__":
    main()
