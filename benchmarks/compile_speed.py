"""torch.compile (inductor) of a private model, side by side in one run: a plain step eager and compiled, a DP
step (make_private, book-keeping, noise) eager, compiled by the user (``torch.compile(model)``) and made with
``make_private(..., compile=True)``, several rounds interleaved so that a load that comes and goes touches all
alike. Prints per model the min and median ms per step (wall time, and on CPU the process's CPU time, steadier on a
shared machine) and each variant's ratio to the plain eager step.

    python benchmarks/compile_speed.py [--device cuda] [--rounds 5] [--steps 20] [--models deep-narrow mlp-784]

Figures in docs/torch_compile.md."""
import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from fxdp.privacy_engine import PrivacyEngine  # noqa: E402

VARIANTS = ("plain eager", "plain compiled", "fxdp eager", "fxdp compiled", "fxdp compile=True")


def make_step(variant, make, make_x, batch, device, classes=3):
    """A function running one training step of ``variant`` (warmed up: compiled already)."""
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = make_x(batch).to(device), torch.randint(0, classes, (batch,), device=device)
    if variant.startswith("fxdp"):
        data = TensorDataset(x.cpu(), y.cpu())
        model, opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=batch), noise_multiplier=1.0,
            max_grad_norm=1.0, example_inputs=(x,), poisson_sampling=False, compile=variant.endswith("=True"))
    run = torch.compile(model) if variant.endswith("compiled") else model

    def step():
        opt.zero_grad()
        F.cross_entropy(run(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    return step


def time_steps(step, steps, device):
    """(wall ms, CPU ms) per step."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3


def mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))


# key -> (name, model, a batch of n inputs, batch size, classes)
MODELS = {
    "mlp": ("mlp 64-256-256-3, batch 64", mlp, lambda n: torch.randn(n, 64), 64, 3),
    "attention-16": ("attention d=16 T=6, batch 64", models.OneHeadAttention, lambda n: torch.randint(0, 20, (n, 6)),
                     64, 3),
    "attention-64": ("attention d=64 T=32, batch 32", lambda: models.OneHeadAttention(vocab=100, t=32, d=64),
                     lambda n: torch.randint(0, 100, (n, 32)), 32, 3),
    "deep-narrow": ("deep-narrow 16 x (Linear 32 + LayerNorm + GELU), batch 4", models.deep_narrow,
                    lambda n: torch.randn(n, 32), 4, 10),
    "mlp-784": ("models.mlp 784-512-256-10, batch 64", models.mlp, lambda n: torch.randn(n, 1, 28, 28), 64, 10),
}
DEFAULT_MODELS = ("mlp", "attention-16", "attention-64", "deep-narrow", "mlp-784")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (ignored on cuda)")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f", {args.threads} threads")
          + f", {args.rounds} rounds x {args.steps} steps, interleaved; load average {os.getloadavg()[0]:.1f}")
    for key in args.models:
        name, make, make_x, batch, classes = MODELS[key]
        started = time.perf_counter()
        steps = {v: make_step(v, make, make_x, batch, args.device, classes) for v in VARIANTS}
        print(f"\n{name} (built and compiled in {time.perf_counter() - started:.0f} s)")
        wall = {v: [] for v in VARIANTS}
        cpu = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                w, c = time_steps(steps[v], args.steps, args.device)
                wall[v].append(w)
                cpu[v].append(c)
        base_w, base_c = statistics.median(wall["plain eager"]), statistics.median(cpu["plain eager"])
        for v in VARIANTS:
            w, c = wall[v], cpu[v]
            line = (f"  {v:17s} wall min {min(w):8.2f} median {statistics.median(w):8.2f} ms/step "
                    f"({statistics.median(w) / base_w:5.2f}x plain eager)")
            if args.device == "cpu":
                line += f" | CPU median {statistics.median(c):8.2f} ms/step ({statistics.median(c) / base_c:5.2f}x)"
            print(line)
        fe = statistics.median(wall["fxdp eager"])
        for v in ("fxdp compiled", "fxdp compile=True"):
            fc = statistics.median(wall[v])
            print(f"  {v} vs fxdp eager: {fe / fc:.2f}x faster (wall medians)" if fc < fe else
                  f"  {v} vs fxdp eager: {fc / fe:.2f}x slower (wall medians)")


if __name__ == "__main__":
    main()
