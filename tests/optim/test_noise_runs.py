"""Small CPU tensors whose sizes are multiples of 16 get their noise from one draw (fxdp/optim/noise.py, _ALIGNED):
the values must be, value for value, those of one ``torch.normal`` per tensor in order, whatever sizes are between
them (other small sizes, large tensors drawn in blocks, dtypes), and the generator must end where the per-tensor
draws leave it."""

from __future__ import annotations

import pytest
import torch

import fxdp.optim.noise as noise
from fxdp.optim.noise import NOISE_CHUNK, add_gaussian_noise_all_, gaussian_noise

# the deep-narrow model's parameters (benchmarks/models.py) in order, then sizes that break a run: 10 and 7 (not
# multiples of 16), 0, a large tensor (drawn in blocks), a run longer than one piece (_RUN_VALUES)
DEEP_NARROW = [(32, 32), (32,), (32,), (32,)] * 16 + [(10, 32), (10,)]
MIXED = [(16,), (48,), (10,), (32, 2), (7,), (0,), (64,), (NOISE_CHUNK + 5,), (16,), (NOISE_CHUNK,), (NOISE_CHUNK,),
         (256, 4), (3,), (32,)]


def _one_by_one(shapes, dtypes, std, seed):
    """What one gaussian_noise per tensor (torch.normal below NOISE_CHUNK) draws, and the generator afterwards."""
    generator = torch.Generator().manual_seed(seed)
    draws = [gaussian_noise(torch.zeros(s, dtype=d), std, generator=generator) for s, d in zip(shapes, dtypes)]
    return draws, torch.rand(5, generator=generator)


@pytest.mark.parametrize("shapes", [DEEP_NARROW, MIXED], ids=["deep-narrow", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_draw_for_a_run_gives_each_tensor_its_own_draw(shapes, dtype):
    outs = [torch.zeros(s, dtype=dtype) for s in shapes]
    generator = torch.Generator().manual_seed(5)
    add_gaussian_noise_all_(outs, 0.7, generator=generator)
    expected, after = _one_by_one(shapes, [dtype] * len(shapes), 0.7, 5)
    for out, want in zip(outs, expected):
        assert torch.equal(out, want)
    assert torch.equal(torch.rand(5, generator=generator), after)  # the generator moved exactly as far


def test_dtypes_alternating_break_the_runs_and_keep_the_values():
    shapes = [(32,), (16,), (64,), (32,), (48,), (16,)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float64, torch.float16, torch.float32]
    outs = [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]
    generator = torch.Generator().manual_seed(9)
    add_gaussian_noise_all_(outs, 2.0, generator=generator)
    expected, after = _one_by_one(shapes, dtypes, 2.0, 9)
    for out, want in zip(outs, expected):
        assert out.dtype == want.dtype and torch.equal(out, want)
    assert torch.equal(torch.rand(5, generator=generator), after)


def test_a_run_is_drawn_in_pieces_of_bounded_size(monkeypatch):
    sizes = []
    normal = torch.normal

    def counting(*args, **kwargs):
        sizes.append(kwargs["size"])
        return normal(*args, **kwargs)

    monkeypatch.setattr(noise.torch, "normal", counting)
    add_gaussian_noise_all_([torch.zeros(s) for s in DEEP_NARROW], 1.0, generator=torch.Generator().manual_seed(0))
    # 65 tensors of sizes multiple of 16 (17,728 values) in one draw, the head's bias of 10 in one of its own
    assert sizes == [(16 * (1024 + 96) + 320,), (10,)]
    sizes.clear()
    add_gaussian_noise_all_([torch.zeros(NOISE_CHUNK // 2) for _ in range(5)], 1.0)
    assert [s[0] for s in sizes] == [NOISE_CHUNK, NOISE_CHUNK, NOISE_CHUNK // 2]


def test_the_noise_of_a_run_has_the_law_asked_for():
    """N(0, std^2) per coordinate and uncorrelated across the tensors of one draw and across steps."""
    std = 1.5
    outs = [torch.zeros(s, dtype=torch.float64) for s in DEEP_NARROW[:-1]]
    steps = []
    for _ in range(40):
        for out in outs:
            out.zero_()
        add_gaussian_noise_all_(outs, std)
        steps.append(torch.cat([o.flatten() for o in outs]))
    values = torch.stack(steps)  # (steps, values)
    n = values.numel()
    assert abs(values.mean().item()) < 5 * std / n ** 0.5
    assert abs(values.std().item() / std - 1) < 0.02
    per_tensor = [v.std().item() / std for v in torch.stack(steps).split([o.numel() for o in outs], dim=1)]
    assert all(abs(r - 1) < 0.25 for r in per_tensor)
    # neighbouring tensors (a weight and the bias after it) and consecutive steps uncorrelated
    first, second = values[:, :1024].flatten(), values[:, 1024:1056].repeat(1, 32).flatten()
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 0.05
    assert abs(torch.corrcoef(torch.stack([values[:-1].flatten(), values[1:].flatten()]))[0, 1].item()) < 0.01
