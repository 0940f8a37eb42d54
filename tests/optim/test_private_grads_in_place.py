"""The DP step writes each private gradient into its clipped sum's own buffer: the sink forms the sums
and frees each layer's records as it goes (``take_clipped_sums``), and the noise is added in place a chunk
at a time (``add_gaussian_noise_``) with exactly the values ``gaussian_noise`` draws for each parameter, in
the parameters' order."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdp
from fxdp.optim import DPOptimizer
from fxdp.optim.noise import NOISE_BLOCK, NOISE_CHUNK, add_gaussian_noise_, gaussian_noise
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.bookkeeping.linear import LinearWeight
from fxdp.sinks.contract import GradSampleSink

SIZES = [5, 17, NOISE_CHUNK - 1, NOISE_CHUNK, NOISE_CHUNK + 1, NOISE_CHUNK + 15, NOISE_CHUNK + 16,
         NOISE_CHUNK + 17, 2 * NOISE_CHUNK + 8, 3 * NOISE_CHUNK + 100, NOISE_BLOCK + 1, 2 * NOISE_BLOCK + 40_017]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("size", SIZES)
def test_noise_added_in_chunks_is_the_one_draw_noise(size, dtype):
    base = torch.randn(size, dtype=torch.float64).to(dtype)
    for seeded in ("generator", "global"):
        if seeded == "generator":
            want = base + gaussian_noise(base, 0.3, generator=torch.Generator().manual_seed(5))
            got = add_gaussian_noise_(base.clone(), 0.3, generator=torch.Generator().manual_seed(5))
        else:
            torch.manual_seed(5)
            want = base + gaussian_noise(base, 0.3)
            torch.manual_seed(5)
            got = add_gaussian_noise_(base.clone(), 0.3)
        assert got.dtype == dtype
        assert torch.equal(got, want), f"{seeded}: {(got != want).sum()} of {size} values differ"


def test_noise_of_a_non_contiguous_tensor_is_added_whole():
    base = torch.randn(400, 300).t()
    want = base + gaussian_noise(base, 2.0, generator=torch.Generator().manual_seed(1))
    got = add_gaussian_noise_(base.clone(memory_format=torch.preserve_format), 2.0,
                              generator=torch.Generator().manual_seed(1))
    assert torch.equal(got, want)


class Net(nn.Module):
    """Three Linear layers, the first larger than one noise chunk."""

    def __init__(self):
        super().__init__()
        wide = NOISE_CHUNK // 40 + 7
        self.a, self.b, self.c = nn.Linear(40, wide), nn.Linear(wide, 30), nn.Linear(30, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("sink_kind", ["bookkeeping", "materialised"])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_private_gradient_is_the_scaled_clipped_sum_plus_noise_drawn_in_parameter_order(sink_kind, loss_reduction):
    """p.grad equals, parameter by parameter, scale * clipped sum (the same step without noise) plus the
    noise gaussian_noise draws for the parameters one after the other from the same generator."""
    torch.manual_seed(0)
    model, x = Net().double(), torch.randn(6, 40, dtype=torch.float64)
    sigma, clip, batch = 1.3, 0.5, 8
    scale = 1.0 / batch if loss_reduction == "mean" else 1.0
    grads = []
    for noise in (0.0, sigma):
        m = copy.deepcopy(model)
        sink = BookkeepingSink() if sink_kind == "bookkeeping" else GradSampleSink()
        dp = fxdp.compile_for_dp(m, example_inputs=x, sink=sink, loss_reduction=loss_reduction)
        opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), noise_multiplier=noise, max_grad_norm=clip,
                          expected_batch_size=batch, loss_reduction=loss_reduction, sink=sink,
                          generator=torch.Generator().manual_seed(7))
        opt.zero_grad()
        out = dp(x).pow(2).sum(1)
        (out.mean() if loss_reduction == "mean" else out.sum()).backward()
        opt.step()
        grads.append([p.grad.clone() for p in m.parameters()])
    generator = torch.Generator().manual_seed(7)
    assert max(p.numel() for p in model.parameters()) > NOISE_CHUNK
    for p, clean, noisy in zip(model.parameters(), *grads):
        noise = gaussian_noise(p, sigma * clip * scale, generator=generator)
        torch.testing.assert_close(noisy, clean + noise, rtol=0, atol=1e-12)
        assert clean.abs().max() > 0


def test_bookkeeping_frees_each_layers_records_once_its_sums_are_formed():
    """When the first layer's weight sum is formed, the later layers' inputs and output gradients are no
    longer held (their parameters' records were dropped), so never are all of them alive with all sums."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(6, 40)
    sink = BookkeepingSink()
    dp = fxdp.compile_for_dp(model, example_inputs=x, sink=sink)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=6, sink=sink)
    held_when = {}
    original = LinearWeight.clipped_sum

    def recording(use, c):
        held_when[use.g.shape[-1]] = {id(p) for p in sink._segments}
        return original(use, c)

    opt.zero_grad()
    dp(x).sum().backward()
    LinearWeight.clipped_sum = recording
    try:
        opt.step()
    finally:
        LinearWeight.clipped_sum = original
    first = held_when[model.a.out_features]
    assert id(model.a.weight) in first
    assert not {id(p) for p in (*model.b.parameters(), *model.c.parameters())} & first
    assert not sink._segments


def test_the_default_take_reads_scaled_sums_and_clears():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(3, 2))
    p.grad_sample = torch.randn(4, 3, 2)
    factors = {p: torch.rand(4)}
    sink = GradSampleSink()
    want = torch.tensordot(factors[p], p.grad_sample, dims=1) * 0.25
    got = sink.take_clipped_sums([p], factors, alpha=0.25)
    torch.testing.assert_close(got[p], want)
    assert p.grad_sample is None


def test_chunks_are_drawn_into_one_buffer_per_thread_kept_between_calls():
    """No new 256 KiB buffer per parameter and step; two threads adding noise at once never share one."""
    import threading

    from fxdp.optim.noise import _chunk_buffer

    first = _chunk_buffer(torch.float32)
    add_gaussian_noise_(torch.zeros(3 * NOISE_CHUNK), 1.0, generator=torch.Generator().manual_seed(0))
    assert _chunk_buffer(torch.float32) is first
    assert _chunk_buffer(torch.float64) is not first and _chunk_buffer(torch.float64).dtype == torch.float64
    other = []
    thread = threading.Thread(target=lambda: other.append(_chunk_buffer(torch.float32)))
    thread.start()
    thread.join()
    assert other[0] is not first and other[0].data_ptr() != first.data_ptr()
