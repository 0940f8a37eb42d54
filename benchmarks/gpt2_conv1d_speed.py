"""One DP-SGD step (book-keeping sink + DPOptimizer) of a small GPT-2, with transformers' ``Conv1D`` served by
its hand-written rule (folded into a layer call, book-kept like nn.Linear) and without it (the rule removed
before compiling: the projections' ``addmm`` are functional sites with the generic rule, as before that
rule existed), as ratios to a plain step, side by side in one run, taking turns.

Usage: python benchmarks/gpt2_conv1d_speed.py [--repeats 10] [--layers 2] [--embd 64] [--seq 32] [--batch 8]
       [--vocab 1000] [--cpu-time]
(``--cpu-time``: one intra-op thread, each step timed by that thread's CPU time, less disturbed by other jobs.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from dp_step_speed import peak_memory_mb  # noqa: E402

import fxdp  # noqa: E402
from fxdp.grad_sample import registry  # noqa: E402
from fxdp.optim import DPOptimizer  # noqa: E402
from fxdp.sinks.bookkeeping import BookkeepingSink  # noqa: E402

import transformers  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402


def gpt2(args):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=4, n_positions=args.seq,
                                  vocab_size=args.vocab, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").train()


def loss_of(out, ids):
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def plain_step(args, ids):
    model = gpt2(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        loss_of(model(input_ids=ids), ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def dp_step(args, ids, with_rule: bool):
    model = gpt2(args)
    saved = registry.GRAD_SAMPLERS.snapshot(), dict(registry.GRAD_SAMPLERS.by_path)
    if not with_rule:  # as before Conv1D had a rule: the generic rule on the projections' addmm
        registry.GRAD_SAMPLERS.by_path.clear()
        registry.GRAD_SAMPLERS.entries.pop(Conv1D, None)
    try:
        sink = BookkeepingSink()
        dp = fxdp.compile_for_dp(model, example_inputs={"input_ids": ids}, sink=sink)
    finally:
        registry.GRAD_SAMPLERS.restore(saved[0])
        registry.GRAD_SAMPLERS.by_path.update(saved[1])
    rules = {site.rule for site in dp.fxdp_batch_guard.sites if "c_attn" in site.target or "addmm" in site.target}
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=ids.shape[0], sink=sink)

    def step():
        loss_of(dp(input_ids=ids), ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, rules


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="independent timing rounds (ratios per round)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    before, before_rules = dp_step(args, ids, with_rule=False)
    after, after_rules = dp_step(args, ids, with_rule=True)
    print(f"GPT-2 {args.layers} layers, n_embd {args.embd}, T={args.seq}, batch {args.batch}, vocab {args.vocab}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{'CPU time' if args.cpu_time else 'wall time'}; c_attn rule before: {sorted(before_rules)}, "
          f"after: {sorted(after_rules)}")
    steps = {"plain": plain_step(args, ids), "before (generic)": before, "after (Conv1D rule)": after}
    clock = time.thread_time if args.cpu_time else time.perf_counter
    for r in range(args.rounds):
        ms = models.median_ms(steps, args.repeats, warmup=2, clock=clock)
        print(f"round {r + 1}: plain {ms['plain']:.1f} ms; before {ms['before (generic)']:.1f} ms "
              f"= {ms['before (generic)'] / ms['plain']:.2f}x plain; after {ms['after (Conv1D rule)']:.1f} ms "
              f"= {ms['after (Conv1D rule)'] / ms['plain']:.2f}x plain; before/after "
              f"{ms['before (generic)'] / ms['after (Conv1D rule)']:.2f}")
    memory = {name: peak_memory_mb(step) for name, step in steps.items()}
    print("peak memory above the step's start (torch profiler): "
          + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in memory.items()))


if __name__ == "__main__":
    main()
