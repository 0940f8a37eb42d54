"""Communication per step and memory per rank of private training across processes: DDP against FSDP2.

    python benchmarks/fsdp_communication.py [--layers 16] [--width 1024] [--batch 16] [--steps 3]
                                            [--worlds 1,2,4] [--modes ddp,fsdp]

For each mode and world size, the ranks of this script are launched on localhost (gloo, CPU; file-store
rendezvous) and train a stack of ``--layers`` Linear(width, width) + Tanh layers with
``PrivacyEngine.make_private`` (Poisson sampling, sigma 1, C 1, SGD with momentum) for one warm-up step and
``--steps`` measured ones.

Bytes: every torch.distributed collective the step calls (FSDP2's own all-gathers and reduce-scatters
included: it calls them through ``torch.distributed``) is wrapped and counted, per logical step, with the
size of the full tensor it works on (all-reduce: the tensor; reduce-scatter: its input; all-gather: its
output; broadcast: the tensor) and what a ring sends from each rank (``2 (w-1)/w`` of that for an
all-reduce, ``(w-1)/w`` for a reduce-scatter or an all-gather). Counted from the calls the code makes, not
from the wire.

Memory per rank: ``rss`` is the measured peak: the growth of the process's peak resident set (``getrusage``)
from before the model is built to the end of the measured steps, with ``MALLOC_MMAP_THRESHOLD_=65536`` so that
the C library hands every freed block above 64 KiB back to the system and the resident set follows the live
tensors. ``state`` is what lives between steps (this rank's parameters, gradients and optimizer state, from
the tensors' sizes). ``step peak`` is the torch profiler's count of CPU allocations above the level at the
start of one more step (``profile_memory=True``); it OVERSTATES FSDP's: FSDP frees each unit's all-gathered
parameters by resizing their storage to zero, which the profiler does not record as a free. The FSDP model
is built on the meta device and each rank materialises its shards only (as FSDP2 asks for models larger than
one device); the DDP model is built whole on every rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = {  # name -> (which argument is the full tensor, ring factor as a function of the world size)
    "all_reduce": (0, lambda w: 2 * (w - 1) / w),
    "reduce_scatter_tensor": (1, lambda w: (w - 1) / w),
    "reduce_scatter_single": (1, lambda w: (w - 1) / w),
    "all_gather_into_tensor": (0, lambda w: (w - 1) / w),
    "all_gather_single": (0, lambda w: (w - 1) / w),
    "broadcast": (0, lambda w: 1.0),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16, help="expected global (Poisson) batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--modes", default="ddp,fsdp")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- one rank ------------------------------------------------------------------------------------------


class Counter:
    """Wraps the collectives of torch.distributed; counts (calls, full bytes, ring bytes sent) per phase."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.world, self.phase, self.counts, self.depth = world, "build", {}, 0
        for name, (arg, ring) in COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original, arg, ring))

    def _wrap(self, name, original, arg, ring):
        def counted(*args, **kwargs):
            if self.depth:  # a collective torch implements with another one (an old name calling the new): once
                return original(*args, **kwargs)
            t = args[arg] if len(args) > arg else next(iter(kwargs.values()))
            calls, full, sent = self.counts.get((self.phase, name), (0, 0, 0.0))
            self.counts[self.phase, name] = (calls + 1, full + t.numel() * t.element_size(),
                                             sent + t.numel() * t.element_size() * ring(self.world))
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted


def make_layers(layers: int, width: int):
    from torch import nn

    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())],
                         nn.Linear(width, 10))


def rank_main(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.out}/store", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=600))
    counter = Counter(args.world)
    from fxdp.privacy_engine import PrivacyEngine

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    if args.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (args.world,))
        with torch.device("meta"):
            model = make_layers(args.layers, args.width)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():  # this rank's rows only: no full weight is ever made here
            for p in model.parameters():
                p.to_local().normal_(0, args.width ** -0.5)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(make_layers(args.layers, args.width))
    n = args.batch * (args.steps + 2)  # a warm-up step, the measured ones, a profiled one
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g))
    loader = DataLoader(data, batch_size=max(1, args.batch // args.world), sampler=DistributedSampler(data))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)

    def step(x, y):
        counter.phase = "forward+backward"
        optimizer.zero_grad()
        out = model(x)
        (F.cross_entropy(out, y) if len(y) else out.sum()).backward()
        counter.phase = "optimizer step"
        optimizer.step()
        counter.phase = "other"

    batches = iter(loader)  # lazily: a batch is a step's once the loader hands it out (fxdp checks)
    step(*next(batches))  # warm-up: FSDP's lazy initialisation, the book-keeping plans
    counter.counts.clear()
    started = time.process_time()
    for _ in range(args.steps):
        step(*next(batches))
    cpu_s = (time.process_time() - started) / args.steps
    measured = dict(counter.counts)

    def local_bytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in params) + sum(
        local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    grads = sum(local_bytes(p) for p in params)  # written by every step (p.grad, this rank's shard)
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024  # before the profiler's own buffers
    from torch.profiler import ProfilerActivity, profile

    x, y = next(batches)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(x, y)
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    result = dict(rank=args.rank, counts={f"{ph}|{name}": v for (ph, name), v in measured.items()},
                  steps=args.steps, state=state, grads=grads, step_peak=peak, cpu_s=cpu_s,
                  rss=rss,
                  parameters=sum(p.numel() for p in params))
    Path(args.out, f"rank{args.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the launcher --------------------------------------------------------------------------------------


def launch(args, mode: str, world: int):
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")  # freed blocks go back: RSS follows the tensors
        if any(name == "lo" for _, name in socket.if_nameindex()):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        common = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
                  "--steps", str(args.steps), "--mode", mode, "--world", str(world), "--out", out]
        logs = [open(Path(out, f"log{r}"), "w") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, __file__, *common, "--rank", str(r)], env=env, stdout=logs[r],
                                  stderr=subprocess.STDOUT) for r in range(world)]
        deadline = time.monotonic() + args.timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{mode} x{world} failed:\n" + "\n".join(Path(out, f"log{r}").read_text()[-3000:]
                                                                        for r in range(world)))
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    print(f"{args.layers} x Linear({args.width}, {args.width}) + Tanh, head Linear({args.width}, 10); expected global "
          f"batch {args.batch}; {args.steps} measured steps after one warm-up; gloo on CPU, one thread per rank")
    print("per logical step and rank, in MiB (2^20 bytes): 'full' = the full tensors the collectives work on, "
          "'ring sent' = what a ring sends from each rank")
    rows = []
    for mode in args.modes.split(","):
        for world in map(int, args.worlds.split(",")):
            ranks = launch(args, mode, world)
            r0 = ranks[0]
            per_phase = {}
            for key, (calls, full, sent) in r0["counts"].items():
                phase, name = key.split("|")
                c, f, s = per_phase.get(phase, (0, 0, 0.0))
                per_phase[phase] = (c + calls / r0["steps"], f + full / r0["steps"], s + sent / r0["steps"])
                print(f"  {mode} x{world}  {phase:16s} {name:24s} {calls / r0['steps']:6.1f} calls  "
                      f"{int(full / r0['steps']):12d} B = {mb(full / r0['steps']):>8s} full  {mb(sent / r0['steps']):>8s} ring sent")
            total_full = sum(f for _, f, _ in per_phase.values())
            total_sent = sum(s for _, _, s in per_phase.values())
            peak = max(r["state"] + r["step_peak"] for r in ranks)
            rows.append((mode, world, r0["parameters"], total_full, total_sent,
                         max(r["state"] for r in ranks), max(r["step_peak"] for r in ranks), peak,
                         max(r["rss"] for r in ranks), max(r["cpu_s"] for r in ranks)))
    print()
    print("mode  ranks  parameters  full bytes/step  full MiB/step  ring sent MiB/step  state MiB  step peak MiB  peak MiB  "
          "rss MiB  cpu s/step")
    for mode, world, n, full, sent, state, step_peak, peak, rss, cpu in rows:
        print(f"{mode:5s} {world:5d}  {n:10d}  {int(full):15d}  {mb(full):>13s}  {mb(sent):>18s}  {mb(state):>9s}  "
              f"{mb(step_peak):>13s}  {mb(peak):>8s}  {mb(rss):>7s}  {cpu:10.2f}")


if __name__ == "__main__":
    main()
