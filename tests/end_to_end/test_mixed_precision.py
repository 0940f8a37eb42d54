"""Mixed precision: models stored in bfloat16 and float32 models under ``torch.autocast`` (bfloat16 on the
CPU). With ``FXDP_TEST_DEVICE=cuda`` the comparisons with float64 batches of one run on a GPU, float16 included
(``docs/mixed_precision.md`` gives the run).

What must hold: each sample's norm is that of its own gradient (to the dtype's precision), the clipped sum
is formed in float32 from the half-precision per-sample gradients, and the noise is drawn in float32 and
added to the float32 sum before the one rounding to the parameter's dtype.

Tolerances. bfloat16 keeps 8 significant bits: unit roundoff u = 2**-8 (about 0.004). Every op of the
forward and backward in bfloat16 rounds its result with a relative error of at most u, and the model below
puts about a dozen such ops on the path from a parameter to the loss and back. The per-sample gradients,
their norms and the clipped sum are therefore compared with the float64 reference (each sample alone, as a
batch of one, from the same parameter values) at a relative tolerance of 16 u = 2**-4 in norm. Errors fxdp
could make (a sample not clipped, a wrong row, a norm of the wrong gradient) are O(1): the clip factors here
lie between about 0.2 and 1, and the test checks that the unclipped sum is far outside the tolerance.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.optim import DPOptimizer
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import sink_of

DEVICE = os.environ.get("FXDP_TEST_DEVICE", "cpu")
U_BF16 = 2.0 ** -8  # bfloat16's unit roundoff (8 significant bits)
RTOL = 16 * U_BF16  # see the module docstring
UNIT_ROUNDOFF = {torch.bfloat16: U_BF16, torch.float16: 2.0 ** -11}


class Mix(nn.Module):
    """No rule for its matmul: the generic rule re-runs it (under the forward's autocast settings)."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        return x @ self.w


class Tiny(nn.Module):
    """Embedding, Linear layers on sequences (book-kept), LayerNorm, a Conv1d, a layer with no rule, a head."""

    def __init__(self, vocab=30, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.conv = nn.Conv1d(2 * d, d, 3, padding=1)
        self.mix = Mix(d)
        self.head = nn.Linear(d, 4)

    def forward(self, idx):
        h = self.norm(F.gelu(self.up(self.emb(idx))))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(self.mix(h)).mean(1))


def _batch(n=6, t=5, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 30, (n, t), generator=g), torch.randint(0, 4, (n,), generator=g)
    return x.to(device), y.to(device)


def _reference(model: nn.Module, x, y):
    """{name: (N, *shape)} float64 per-sample gradients, each sample run alone as a batch of one."""
    ref = copy.deepcopy(model).double()
    names = [k for k, p in ref.named_parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(ref(x[i:i + 1]), y[i:i + 1], reduction="sum")
        rows.append(torch.autograd.grad(loss, [dict(ref.named_parameters())[k] for k in names]))
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(names)}


# name: (the parameters' dtype, autocast's dtype or None)
PRECISIONS = {
    "bf16 weights": (torch.bfloat16, None),
    "autocast bf16, fp32 weights": (torch.float32, torch.bfloat16),
    "autocast bf16, bf16 weights": (torch.bfloat16, torch.bfloat16),
}
if DEVICE == "cuda":  # float16 is a GPU format: the CPU has no autocast to it worth testing
    PRECISIONS.update({"fp16 weights": (torch.float16, None),
                       "autocast fp16, fp32 weights": (torch.float32, torch.float16)})
ENGINES = {
    "fx book-keeping": ("fx", True),
    "fx materialised": ("fx", False),
    "hooks materialised": ("hooks", False),
    "hooks book-keeping": ("hooks", True),
}


def _private(model, x, mode, bookkept, noise=0.0, generator=None):
    dp = fxdp.compile_for_dp(model, (x,), loss_reduction="sum", grad_sample_mode=mode,
                             sink=BookkeepingSink() if bookkept else None)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=noise, max_grad_norm=1.0,
                      expected_batch_size=None, loss_reduction="sum", sink=sink_of(dp), generator=generator)
    return dp, opt


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_norms_and_clipped_sum_match_float64_batches_of_one(precision, engine):
    dtype, autocast = PRECISIONS[precision]
    rtol = 16 * UNIT_ROUNDOFF[autocast or dtype]  # see the module docstring
    mode, bookkept = ENGINES[engine]
    torch.manual_seed(0)
    model = Tiny().to(DEVICE, dtype)
    x, y = _batch(device=DEVICE)
    want = _reference(model, x, y)  # from the very parameter values the half-precision model holds
    names = list(want)
    flat = torch.cat([want[k].flatten(1) for k in names], 1)
    norms = flat.norm(dim=1)
    clip = 0.5 * float(norms.median())  # at least half the samples clipped, with factors of 0.5 or less
    factors = (clip / norms).clamp(max=1.0)
    assert float(factors.min()) < 0.7
    want_sum = {k: torch.tensordot(factors, want[k], dims=1) for k in names}
    unclipped = {k: want[k].sum(0) for k in names}

    dp, opt = _private(model, x, mode, bookkept)
    opt.max_grad_norm = clip
    with torch.autocast(DEVICE, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = dp(x)
    F.cross_entropy(logits.float(), y, reduction="sum").backward()

    params = dict(model.named_parameters())
    got_norms = opt.sink.squared_norms([params[k] for k in names])
    assert {sq.dtype for sq in got_norms.values()} == {torch.float32}
    total = sum(got_norms[params[k]].double() for k in names).sqrt()
    assert _rel(total, norms) < rtol, (total, norms)

    opt.step()
    for k in names:
        p = params[k]
        assert p.grad.dtype == p.dtype
        err = _rel(p.grad, want_sum[k])
        assert err < rtol, f"{k}: clipped sum off by {err:.3g} (relative) against float64 batches of one"
        if float((unclipped[k] - want_sum[k]).norm() / want_sum[k].norm()) > 4 * rtol:
            assert _rel(unclipped[k].to(p.dtype), want_sum[k]) > 2 * rtol  # the check tells clipped from not


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_per_sample_gradients_of_a_bf16_model_match_float64_batches_of_one(mode):
    torch.manual_seed(1)
    model = Tiny().to(DEVICE, torch.bfloat16)
    x, y = _batch(seed=1, device=DEVICE)
    want = _reference(model, x, y)
    dp = fxdp.compile_for_dp(model, (x,), loss_reduction="sum", grad_sample_mode=mode)
    F.cross_entropy(dp(x).float(), y, reduction="sum").backward()
    for k, p in model.named_parameters():
        # materialised in float32: the products of the bfloat16 values the layer computed with
        assert p.grad_sample.dtype in (torch.float32, torch.bfloat16)
        for i in range(x.shape[0]):
            assert _rel(p.grad_sample[i], want[k][i]) < RTOL, f"{k}, sample {i}"


def test_sums_of_many_samples_are_not_rounded_to_bf16_before_the_noise():
    """B identical samples, each clipped to C: the float32 sum is B times one clipped gradient. A bfloat16
    accumulator would stall (adding C/B-sized rows to a sum ~2**8 times larger rounds them away)."""
    torch.manual_seed(2)
    layer = nn.Linear(8, 1, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 8).to(torch.bfloat16).expand(600, 8).contiguous()
    for bookkept in (False, True):
        layer.weight.grad = None
        dp, opt = _private(layer, x, "fx", bookkept)
        opt.max_grad_norm = 1e-3
        dp(x).float().sum().backward()
        one = x[0].double()  # d(out)/dw for one sample
        want = 600 * 1e-3 * one / one.norm()
        opt.step()
        assert _rel(layer.weight.grad[0], want) < 2 * U_BF16  # the one rounding to bfloat16, and no other


def test_noise_on_a_bf16_parameter_is_drawn_in_float32_and_rounded_once():
    """The noise added to a bfloat16 parameter's gradient has std sigma * C / B, is drawn in float32 and added to
    the float32 clipped sum, and the result is rounded once to bfloat16 (not a bfloat16 draw, nor noise added to
    a sum already rounded)."""
    torch.manual_seed(3)
    layer = nn.Linear(256, 256, bias=False).to(torch.bfloat16)  # 65536 coordinates, more than one noise chunk
    x = torch.randn(4, 256).to(torch.bfloat16)
    sigma, clip, batch = 1.3, 0.7, 16
    dp = fxdp.compile_for_dp(layer, (x,), sink=BookkeepingSink())
    opt = DPOptimizer(torch.optim.SGD(layer.parameters(), lr=0.0), noise_multiplier=sigma, max_grad_norm=clip,
                      expected_batch_size=batch, sink=sink_of(dp), generator=torch.Generator().manual_seed(7))
    sums = {}
    take = opt.sink.take_clipped_sums

    def spy(*args, **kwargs):  # the scaled clipped sums, before the noise goes into their buffers
        out = take(*args, **kwargs)
        sums.update({p: s.clone() for p, s in out.items()})
        return out

    opt.sink.take_clipped_sums = spy
    dp(x).float().sum().backward()
    opt.step()
    grad, s = layer.weight.grad, sums[layer.weight]
    assert grad.dtype == torch.bfloat16 and s.dtype == torch.float32
    std = sigma * clip / batch
    draw = torch.normal(0.0, std, size=grad.shape, dtype=torch.float32, generator=torch.Generator().manual_seed(7))
    assert torch.equal(grad, (s + draw).to(torch.bfloat16))
    rounded_twice = s.to(torch.bfloat16) + draw.to(torch.bfloat16)
    assert not torch.equal(grad, rounded_twice)  # (what rounding the sum before the noise would give)
    noise = grad.double() - s.double()
    # 65536 draws: standard error of the std 1/sqrt(2 * 65536) = 0.3%; rounding each value to bfloat16 moves it
    # by at most u = 0.4% of its size
    assert abs(float(noise.std()) / std - 1) < 0.02


def test_the_half_precision_update_of_an_sgd_step_is_the_rounded_float32_one():
    """What docs/mixed_precision.md says of the update: the parameter moves by the rounded private gradient;
    the parameter's own rounding then happens in the optimizer (post-processing)."""
    torch.manual_seed(4)
    model = Tiny().to(torch.bfloat16)
    x, y = _batch(seed=4)
    dp = fxdp.compile_for_dp(model, (x,), sink=BookkeepingSink())
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=6, sink=sink_of(dp), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(dp(x).float(), y).backward()
    opt.step()
    for k, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and bool(torch.isfinite(p).all())
        assert torch.equal(p.detach(), before[k] - 0.5 * p.grad), k  # SGD in bfloat16 on the rounded gradient
