"""The noise in one call (fxdp/optim/noise.py, "Device draws"): drawn on a GPU, all tensors' noise comes from one
flat ``torch.normal`` and one ``torch._foreach_add_`` of views of it (:func:`fused_add_gaussian_noise_`). The
route is tested here on CPU tensors, called directly or forced by ``noise._FUSED_ON_CPU``: what must hold is that
each tensor's noise is N(0, std^2), independent of the other tensors' and of the next step's, repeats from a seeded
generator, lands in place, and that secure mode and the CPU's own draws are untouched by it.

Statistical bounds: the mean of n values of N(0, s^2) has std s / sqrt(n), the sample variance over s^2 has std
about sqrt(2 / n), a correlation of independent values std 1 / sqrt(n); bounds of 5 standard errors fail a right
sampler with probability under 1e-6 each, and seeds are fixed, so runs repeat."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxdp.optim.noise as noise
from fxdp.optim import DPOptimizer
from fxdp.optim.noise import NOISE_CHUNK, add_gaussian_noise_all_, fused_add_gaussian_noise_

SHAPES = [(100, 50), (5000,), (7,), (64, 64, 3), (3, 1), (0,), (20_000,)]


def _zeros(shapes=SHAPES, dtype=torch.float32):
    return [torch.zeros(s, dtype=dtype) for s in shapes]


def _assert_gaussian(z: torch.Tensor, std: float) -> None:
    z = z.double().flatten()
    n = z.numel()
    assert abs(z.mean().item()) < 5 * std / math.sqrt(n), (z.mean().item(), n)
    assert abs(z.var().item() / std ** 2 - 1) < 5 * math.sqrt(2 / n), (z.var().item(), n)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double().flatten(), b.double().flatten()]))[0, 1])


@pytest.fixture
def fused_on_cpu(monkeypatch):
    monkeypatch.setattr(noise, "_FUSED_ON_CPU", True)


def test_the_values_are_one_flat_draw_cut_into_the_tensors_shapes():
    """The design, pinned: one draw of the total size from the generator, tensor k taking the next numel values."""
    outs = [torch.randn(s) for s in SHAPES]
    before = [o.clone() for o in outs]
    fused_add_gaussian_noise_(outs, 0.3, generator=torch.Generator().manual_seed(4))
    flat = torch.normal(0.0, 0.3, size=(sum(o.numel() for o in outs),), generator=torch.Generator().manual_seed(4))
    for out, base, part in zip(outs, before, flat.split([o.numel() for o in outs])):
        assert torch.equal(out, base + part.view(out.shape))


def test_each_tensors_noise_has_mean_0_and_std_sigma():
    outs = _zeros()
    fused_add_gaussian_noise_(outs, 2.5, generator=torch.Generator().manual_seed(0))
    for out in outs:
        if out.numel() >= 1000:
            _assert_gaussian(out, 2.5)
    _assert_gaussian(torch.cat([o.flatten() for o in outs]), 2.5)


def test_tensors_and_steps_are_independent():
    """No tensor's noise is correlated with another's of the same step, nor with any tensor's of the next step."""
    shapes, generator = [(20_000,)] * 4, torch.Generator().manual_seed(1)
    steps = []
    for _ in range(2):
        outs = _zeros(shapes)
        fused_add_gaussian_noise_(outs, 1.0, generator=generator)
        steps.append(outs)
    draws = [t for step in steps for t in step]
    for i in range(len(draws)):
        for j in range(i + 1, len(draws)):
            assert abs(_corr(draws[i], draws[j])) < 5 / math.sqrt(20_000), (i, j)


def test_the_noise_repeats_from_a_seeded_generator_or_torch_manual_seed():
    def draw(seed=None, generator_seed=None):
        outs = _zeros()
        if seed is not None:
            torch.manual_seed(seed)
        generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
        fused_add_gaussian_noise_(outs, 1.0, generator=generator)
        return torch.cat([o.flatten() for o in outs])

    assert torch.equal(draw(generator_seed=3), draw(generator_seed=3))
    assert not torch.equal(draw(generator_seed=3), draw(generator_seed=4))
    assert torch.equal(draw(seed=8), draw(seed=8))
    assert not torch.equal(draw(seed=8), draw(seed=9))
    generator = torch.Generator().manual_seed(3)
    first, second = _zeros(), _zeros()
    fused_add_gaussian_noise_(first, 1.0, generator=generator)
    fused_add_gaussian_noise_(second, 1.0, generator=generator)
    assert not torch.equal(torch.cat([o.flatten() for o in first]), torch.cat([o.flatten() for o in second]))


def test_added_in_place_to_the_values_there_whatever_the_dtype_or_layout():
    outs = [torch.randn(300, 200).t(), torch.randn(1000, dtype=torch.float64), torch.randn(2000).to(torch.bfloat16),
            torch.randn(40, 30)]
    before = [o.clone() for o in outs]
    storage = [o.data_ptr() for o in outs]
    fused_add_gaussian_noise_(outs, 0.5, generator=torch.Generator().manual_seed(2))
    assert [o.data_ptr() for o in outs] == storage
    for out, base in zip(outs, before):
        assert out.dtype == base.dtype and out.shape == base.shape and out.stride() == base.stride()
        added = out.double() - base.double()
        assert (added != 0).float().mean() > 0.99
        if out.numel() >= 1000:
            _assert_gaussian(added, 0.5)


def test_a_large_total_is_drawn_in_several_flat_draws(monkeypatch):
    """More than DEVICE_DRAW_VALUES values: several draws, each tensor in one; the values still independent."""
    monkeypatch.setattr(noise, "DEVICE_DRAW_VALUES", 25_000)
    draws = []
    real_normal = torch.normal
    monkeypatch.setattr(torch, "normal", lambda *a, **k: draws.append(k["size"]) or real_normal(*a, **k))
    outs = _zeros([(20_000,), (20_000,), (4000,), (30_000,), (10,)])
    fused_add_gaussian_noise_(outs, 1.0, generator=torch.Generator().manual_seed(6))
    assert draws == [(20_000,), (24_000,), (30_000,), (10,)]
    for out in outs[:-1]:
        _assert_gaussian(out, 1.0)
    assert abs(_corr(outs[0], outs[1])) < 5 / math.sqrt(20_000)


def test_forced_the_optimizers_step_adds_noise_of_std_sigma_c(fused_on_cpu, monkeypatch):
    """Through the DP optimizer (an empty batch: p.grad is noise alone), on the device route."""
    calls = []
    real = noise.fused_add_gaussian_noise_
    monkeypatch.setattr(noise, "fused_add_gaussian_noise_", lambda outs, std, **k: calls.append(len(outs))
                        or real(outs, std, **k))
    sigma, clip = 1.7, 0.6
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 120), nn.Tanh(), nn.Linear(120, 50))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=sigma, max_grad_norm=clip,
                      expected_batch_size=1, loss_reduction="sum", generator=torch.Generator().manual_seed(5))
    opt.zero_grad()
    opt.observe_batch(empty=True)
    opt.step()
    assert calls == [4]  # one call for the four parameters
    grads = [p.grad for p in model.parameters()]
    _assert_gaussian(torch.cat([g.flatten() for g in grads]), sigma * clip)
    assert abs(_corr(grads[0].flatten()[:6000], grads[2].flatten()[:6000])) < 5 / math.sqrt(6000)


def test_secure_mode_never_takes_the_device_route(fused_on_cpu, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("secure noise drawn by the fused route")

    monkeypatch.setattr(noise, "fused_add_gaussian_noise_", refuse)
    drawn = []
    real = noise.secure_standard_normal
    monkeypatch.setattr(noise, "secure_standard_normal", lambda n: drawn.append(n) or real(n))
    outs = _zeros([(30,), (NOISE_CHUNK + 5,), (40, 40)])
    add_gaussian_noise_all_(outs, 1.2, secure_mode=True)
    assert drawn == [30, NOISE_CHUNK + 5, 1600]
    _assert_gaussian(outs[1], 1.2)


def test_cpu_draws_are_one_torch_normal_per_small_tensor_in_order():
    """Off the device route, a CPU tensor of up to NOISE_CHUNK values gets exactly the values of a torch.normal of
    its shape drawn after the previous tensor's (as Opacus draws them: the digits example matches it per seed),
    whatever its dtype, from a generator or from torch's default one."""
    shapes = [(5,), (32, 32), (NOISE_CHUNK,), (10, 3), (1,), (17,)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float32, torch.float64]
    for seeded in ("generator", "global"):
        outs = [torch.full(s, 0.25, dtype=d) for s, d in zip(shapes, dtypes)]
        if seeded == "generator":
            add_gaussian_noise_all_(outs, 0.9, generator=torch.Generator().manual_seed(7))
            generator = torch.Generator().manual_seed(7)
        else:
            torch.manual_seed(7)
            add_gaussian_noise_all_(outs, 0.9)
            torch.manual_seed(7)
            generator = None
        for out, shape, dtype in zip(outs, shapes, dtypes):
            draw_dtype = torch.promote_types(dtype, torch.float32)
            want = torch.full(shape, 0.25, dtype=dtype) + torch.normal(
                0.0, 0.9, size=shape, generator=generator, dtype=draw_dtype).to(dtype)
            assert torch.equal(out, want), (seeded, shape, dtype)


def test_many_small_tensors_are_added_a_few_at_a_time_with_the_same_values(monkeypatch):
    """The small tensors' additions are deferred and done by torch._foreach_add_, at most _PENDING_VALUES values of
    noise held at a time; the values are those of adding each tensor's draw in turn."""
    monkeypatch.setattr(noise, "_PENDING_VALUES", 3000)
    adds = []
    real = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda a, b: adds.append(len(a)) or real(a, b))
    shapes = [(1000,)] * 7
    outs = _zeros(shapes)
    add_gaussian_noise_all_(outs, 1.0, generator=torch.Generator().manual_seed(1))
    assert adds == [3, 3, 1]
    generator = torch.Generator().manual_seed(1)
    for out in outs:
        assert torch.equal(out, torch.normal(0.0, 1.0, size=(1000,), generator=generator))
