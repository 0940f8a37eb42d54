"""Where a private step's time goes on the deep-narrow model (benchmarks/models.py), and whether compiling the
optimizer's clip-factor arithmetic would pay: forward and backward, ``optimizer.step()`` and its parts (the norms
read and checked, the clip factor, the clipped sums and the noise, the wrapped optimizer's step), then the clip
factor over the per-parameter squared norms eagerly and torch.compile'd (inductor), its values compared.
CPU thread time, one thread (steadier than wall time on a shared machine).

    python benchmarks/dp_step_parts.py [--batch 4] [--steps 60]

Figures in docs/torch_compile.md ("compile=True")."""
import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
import fxdp.optim.dp_optimizer as dp_optimizer  # noqa: E402
from fxdp.privacy_engine import PrivacyEngine  # noqa: E402


def _timed(times, name, f):
    def timed(*args, **kwargs):
        started = time.thread_time()
        result = f(*args, **kwargs)
        times.setdefault(name, []).append(time.thread_time() - started)
        return result
    return timed


def step_parts(batch, steps):
    torch.manual_seed(0)
    model = models.deep_narrow()
    x, y = torch.randn(batch, 32), torch.randint(0, 10, (batch,))
    private, opt, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch), noise_multiplier=1.0, max_grad_norm=1.0,
        example_inputs=(x,), poisson_sampling=False)
    times = {}
    opt._factors = _timed(times, "  norms read and checked, clip factor included", opt._factors)
    opt._clip_factors = _timed(times, "    clip factor", opt._clip_factors)
    opt._write_private_grads = _timed(times, "  clipped sums (the sink's) and noise", opt._write_private_grads)
    dp_optimizer.add_gaussian_noise_all_ = _timed(times, "    noise", dp_optimizer.add_gaussian_noise_all_)
    opt.original_optimizer.step = _timed(times, "  the wrapped optimizer's step", opt.original_optimizer.step)
    for _ in range(steps):
        opt.zero_grad()
        started = time.thread_time()
        F.cross_entropy(private(x), y).backward()
        times.setdefault("forward and backward", []).append(time.thread_time() - started)
        started = time.thread_time()
        opt.step()
        times.setdefault("optimizer.step()", []).append(time.thread_time() - started)
    for name in ("forward and backward", "optimizer.step()", "  norms read and checked, clip factor included",
                 "    clip factor", "  clipped sums (the sink's) and noise", "    noise",
                 "  the wrapped optimizer's step"):
        print(f"{name:50s} {statistics.median(times[name][steps // 6:]) * 1e3:7.3f} ms")
    return len([p for p in model.parameters()])


def clip_factor(squared_norms, bound: float):
    """The flat clip factor as DPOptimizer._clip_factors forms it: min(1, C / (sqrt(sum_k n_k) + 1e-6))."""
    total = squared_norms[0]
    for sq in squared_norms[1:]:
        total = total + sq
    return (bound / (total.sqrt() + 1e-6)).clamp(max=1.0)


def compiled_clip_factor(params, batch, calls=2000):
    norms = [torch.rand(batch) for _ in range(params)]
    compiled = torch.compile(clip_factor, dynamic=False)
    started = time.perf_counter()
    same = torch.equal(compiled(norms, 1.0), clip_factor(norms, 1.0))
    print(f"\nclip factor over {params} norm tensors: compiled in {time.perf_counter() - started:.1f} s, "
          f"bitwise the eager values: {same}")
    for name, f in (("eager", clip_factor), ("compiled", compiled)):
        rounds = []
        for _ in range(5):
            started = time.thread_time()
            for _ in range(calls):
                f(norms, 1.0)
            rounds.append((time.thread_time() - started) / calls * 1e6)
        print(f"  {name:9s} {statistics.median(rounds):7.1f} us per call")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, deep-narrow, batch {args.batch}, CPU, 1 thread, medians of thread time; "
          f"load average {os.getloadavg()[0]:.1f}")
    compiled_clip_factor(step_parts(args.batch, args.steps), args.batch)


if __name__ == "__main__":
    main()
