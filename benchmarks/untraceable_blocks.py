"""Models no front end captures: the step with per-sample gradients on the hooks engine with blocks
(fxdp/engines/blocks.py) against a plain step and against the loop a user could write today (each sample alone,
its gradient by autograd). Prints milliseconds per step and the ratios side by side.

    PYTHONPATH=. python benchmarks/untraceable_blocks.py [--batch 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxdp  # noqa: E402
from tests.support.untraceable_zoo import AdaptiveDepthNet, ChunkedEncoder  # noqa: E402


def batch(name: str, n: int):
    g = torch.Generator().manual_seed(0)
    if name == "ChunkedEncoder":
        lengths = torch.randint(1, 17, (n,), generator=g)
        ids = torch.randint(1, 11, (n, 16), generator=g) * (torch.arange(16) < lengths[:, None])
        return (ids,), torch.randint(0, 3, (n,), generator=g)
    return (torch.randn(n, 2, 4, generator=g),), torch.randint(0, 2, (n,), generator=g)


def timed(step, repeats: int) -> float:
    step()  # warm-up (and the engine's one-time test)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, batch {args.batch}, 1 thread; ms per step (forward + backward)")
    print(f"{'model':18} {'plain':>8} {'blocks':>8} {'loop':>8} {'blocks/plain':>13} {'loop/blocks':>12}")
    for cls in (ChunkedEncoder, AdaptiveDepthNet):
        torch.manual_seed(0)
        model = cls()
        bare = copy.deepcopy(model)  # the plain step and the loop run a copy without the engine's hooks
        inputs, y = batch(cls.__name__, args.batch)
        private = fxdp.compile_for_dp(model, example_inputs=inputs)

        def plain():
            bare.zero_grad()
            F.cross_entropy(bare(*inputs), y).backward()

        def blocks():
            private.zero_grad()
            F.cross_entropy(private(*inputs), y).backward()

        def loop():
            params = list(bare.parameters())
            for i in range(len(y)):
                loss = F.cross_entropy(bare(*[t[i:i + 1] for t in inputs]), y[i:i + 1])
                torch.autograd.grad(loss, params, allow_unused=True)

        t_plain = timed(plain, args.repeats)
        t_blocks = timed(blocks, args.repeats)
        t_loop = timed(loop, args.repeats)
        print(f"{cls.__name__:18} {t_plain:8.2f} {t_blocks:8.2f} {t_loop:8.2f} {t_blocks / t_plain:13.1f} "
              f"{t_loop / t_blocks:12.2f}")


if __name__ == "__main__":
    main()
