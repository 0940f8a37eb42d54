"""A whole DP-SGD step with the book-keeping sink equals the same step with the materialising sink.

For every layer kind with a per-sample rule (and the generic rule), with flat and per-layer clipping,
``loss_reduction`` "mean" and "sum", noise off: ``DPOptimizer`` reading a :class:`BookkeepingSink` writes
the same ``p.grad`` as ``DPOptimizer`` reading ``p.grad_sample`` from a :class:`GradSampleSink`, and both
equal the clipped sum computed here from per-sample gradients of batches of one. Bounds are small, so
every sample is clipped (a factor of 1 would hide a wrong norm).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdp
from fxdp.optim import DPOptimizer
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import GradSampleSink
from tests.support.per_sample_reference import batch_loss, expected_grad_samples

CLIP = 0.05  # far below every per-sample gradient norm here: all samples are clipped


class Head(nn.Module):
    """``layer``, then a fixed linear read-out of its flattened output (so any output shape gives (N, 3))."""

    def __init__(self, layer: nn.Module, features: int):
        super().__init__()
        self.layer = layer
        self.out = nn.Linear(features, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.layer(x)).flatten(1))


class Scaled(nn.Module):
    """A layer with no hand-written rule: the generic rule serves it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return x * self.scale


class TiedAndFrozen(nn.Module):
    """One Linear used twice (tied), a frozen Linear, a batch moved to dim 1 and back before a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.ln = nn.LayerNorm(4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):  # x: (N, T, 4)
        h = self.shared(torch.tanh(self.shared(x))) + self.frozen(x)
        h = self.ln(h.transpose(0, 1)).transpose(0, 1)  # (T, N, 4) -> LayerNorm -> (N, T, 4)
        return self.out(h.sum(1))


class TiedLM(nn.Module):
    """One (V, d) table as the input embedding (padding index 0) and as the output layer's weight (tied)."""

    def __init__(self, vocab=11, d=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


class Positions(nn.Module):
    """A position embedding: ``arange(T)`` expanded over the batch, so every sample looks up the same rows."""

    def __init__(self, t=5, d=4):
        super().__init__()
        self.pos = nn.Embedding(t, d)

    def forward(self, x):  # x: (N, T, d)
        n, t = x.shape[0], x.shape[1]
        return x + self.pos(torch.arange(t, device=x.device).expand(n, t))


def _ids(n, vocab, t):
    return torch.randint(1, vocab, (n, t), generator=torch.Generator().manual_seed(1))


# (name, model factory, batch of n inputs, how the book-keeping sink handles `layer`); every layer kind
# that has a rule appears, and every way of book-keeping (outer, ghost, per-sample kept or recomputed, index)
KINDS = [
    ("linear-vectors", lambda: Head(nn.Linear(6, 4), 4), lambda n: torch.randn(n, 6), "outer"),
    ("linear-vectors-widening", lambda: Head(nn.Linear(3, 8), 8), lambda n: torch.randn(n, 3), "outer"),
    ("linear-sequences", lambda: Head(nn.Linear(6, 4), 3 * 4), lambda n: torch.randn(n, 3, 6), "per_sample"),
    ("linear-sequences-ghost", lambda: Head(nn.Linear(8, 8), 2 * 8), lambda n: torch.randn(n, 2, 8), "ghost"),
    ("conv1d", lambda: Head(nn.Conv1d(2, 3, 3, padding=1), 3 * 7), lambda n: torch.randn(n, 2, 7), "per_sample"),
    ("conv2d", lambda: Head(nn.Conv2d(2, 4, 3, stride=2, padding=1), 4 * 3 * 3), lambda n: torch.randn(n, 2, 6, 6),
     "per_sample"),
    ("conv2d-ghost", lambda: Head(nn.Conv2d(2, 16, 3), 16), lambda n: torch.randn(n, 2, 3, 3), "ghost"),
    ("conv2d-per-sample-recomputed", lambda: Head(nn.Conv2d(4, 8, 3, padding=1), 8 * 16),
     lambda n: torch.randn(n, 4, 4, 4), "per_sample"),
    ("conv2d-groups", lambda: Head(nn.Conv2d(4, 4, 2, groups=2), 4 * 3 * 3), lambda n: torch.randn(n, 4, 4, 4),
     "per_sample"),
    ("conv3d", lambda: Head(nn.Conv3d(1, 2, 2), 2 * 2 * 2 * 2), lambda n: torch.randn(n, 1, 3, 3, 3), "per_sample"),
    ("embedding", lambda: Head(nn.Embedding(9, 4, padding_idx=0), 5 * 4), lambda n: _ids(n, 9, 5), "index"),
    ("embedding-bag", lambda: Head(nn.EmbeddingBag(9, 4, mode="mean"), 4), lambda n: _ids(n, 9, 5), "materialise"),
    ("layer-norm", lambda: Head(nn.LayerNorm(4), 3 * 4), lambda n: torch.randn(n, 3, 4) * 2 + 1, "materialise"),
    ("rms-norm", lambda: Head(nn.RMSNorm(4), 3 * 4), lambda n: torch.randn(n, 3, 4) * 2 + 1, "materialise"),
    ("group-norm", lambda: Head(nn.GroupNorm(2, 4), 4 * 9), lambda n: torch.randn(n, 4, 3, 3) * 2 + 1, "materialise"),
    ("instance-norm", lambda: Head(nn.InstanceNorm1d(3, affine=True), 3 * 5), lambda n: torch.randn(n, 3, 5) + 1,
     "materialise"),
    ("generic", lambda: Head(Scaled(), 4), lambda n: torch.randn(n, 4), None),
    ("position-embedding", lambda: Head(Positions(), 5 * 4), lambda n: torch.randn(n, 5, 4), None),
    ("tied-frozen-moved", TiedAndFrozen, lambda n: torch.randn(n, 3, 4), None),
    ("tied-embedding-and-output", TiedLM, lambda n: _ids(n, 11, 5) * (torch.arange(5) < 4), None),  # last: padding
]


def private_grads(model, x, R, *, sink, clipping, loss_reduction, n_params):
    """One DP-SGD step (noise off, lr 0) of ``model`` compiled with ``sink``: the gradients it writes, and
    the compiled model."""
    dp = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction=loss_reduction, sink=sink)
    bound = CLIP if clipping == "flat" else [CLIP] * n_params
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=bound,
                      expected_batch_size=len(x), loss_reduction=loss_reduction, clipping=clipping, sink=sink)
    opt.zero_grad()
    batch_loss(dp(x), R, loss_reduction).backward()
    opt.step()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}, dp


def clipped_reference(expected, clipping, loss_reduction, n):
    """The clipped sum from per-sample gradients of batches of one, as DP-SGD defines it."""
    norms = {k: g.flatten(1).pow(2).sum(1) for k, g in expected.items()}
    if clipping == "flat":
        total = torch.stack(list(norms.values())).sum(0).sqrt()
        factors = {k: (CLIP / (total + 1e-6)).clamp(max=1.0) for k in expected}
    else:
        factors = {k: (CLIP / (sq.sqrt() + 1e-6)).clamp(max=1.0) for k, sq in norms.items()}
    scale = 1.0 / n if loss_reduction == "mean" else 1.0
    return {k: torch.tensordot(factors[k], g, dims=1) * scale for k, g in expected.items()}, factors


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("name,make,make_x,method", KINDS, ids=[k[0] for k in KINDS])
def test_bookkeeping_step_equals_the_materialised_step(name, make, make_x, method, clipping, loss_reduction):
    torch.manual_seed(0)
    model, x = make().double(), make_x(5)
    x = x.double() if x.is_floating_point() else x
    expected, R = expected_grad_samples(model, x)
    n_params = len(expected)
    got, book = {}, BookkeepingSink()
    for label, sink in (("bookkeeping", book), ("materialised", GradSampleSink())):
        got[label], dp = private_grads(copy.deepcopy(model), x, R, sink=sink, clipping=clipping,
                                       loss_reduction=loss_reduction, n_params=n_params)
        if label == "bookkeeping" and method is not None:
            assert book.plans[dp.layer].method == method
    want, factors = clipped_reference(expected, clipping, loss_reduction, len(x))
    assert all(bool((c < 1).all()) for c in factors.values()), "every sample must be clipped"
    for k in want:
        torch.testing.assert_close(got["bookkeeping"][k], got["materialised"][k], msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(got["bookkeeping"][k], want[k], msg=lambda m: f"{k}: {m}")


def test_noise_is_added_once_with_the_scaled_std_and_the_clipped_sum_on_top():
    """With noise on, the book-keeping step's gradient minus the noise-free one is N(0, (sigma C / B)^2): the
    noise is drawn at the scaled std into the gradient and the clipped sum added to it, not scaled twice."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 20))
    x = torch.randn(8, 40)
    sigma, batch = 1.7, 16
    grads = []
    for noise in (0.0, sigma):
        m = copy.deepcopy(model)
        sink = BookkeepingSink()
        dp = fxdp.compile_for_dp(m, example_inputs=x, sink=sink)
        opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), noise_multiplier=noise, max_grad_norm=CLIP,
                          expected_batch_size=batch, sink=sink, generator=torch.Generator().manual_seed(2))
        opt.zero_grad()
        dp(x).pow(2).sum().backward()
        opt.step()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    diff = (grads[1] - grads[0]) * batch / (sigma * CLIP)
    assert diff.numel() > 1800 and abs(float(diff.mean())) < 0.1 and abs(float(diff.std()) - 1) < 0.05
    assert grads[0].abs().max() > 0


def test_a_compiled_position_embedding_is_bookkept_from_its_one_row_of_indices():
    model = Head(Positions(), 5 * 4)
    sink = BookkeepingSink()
    dp = fxdp.compile_for_dp(model, example_inputs=torch.randn(3, 5, 4), sink=sink)
    dp(torch.randn(6, 5, 4)).sum().backward()
    assert sink.plans[model.layer.pos].method == "index"
    use = sink._segments[model.layer.pos.weight].uses[0]
    assert torch.equal(use.common_indices(), torch.arange(5))


LONG = [  # the ghost norm splits 32 or more positions in two halves (odd counts too)
    ("linear-33-positions", lambda: Head(nn.Linear(5, 6), 33 * 6), lambda n: torch.randn(n, 33, 5)),
    ("linear-64-positions", lambda: Head(nn.Linear(4, 3), 64 * 3), lambda n: torch.randn(n, 8, 8, 4)),
    ("conv2d-36-positions", lambda: Head(nn.Conv2d(3, 4, 3, padding=1), 4 * 36), lambda n: torch.randn(n, 3, 6, 6)),
    ("conv1d-groups-40-positions", lambda: Head(nn.Conv1d(4, 6, 3, stride=2, groups=2), 6 * 40),
     lambda n: torch.randn(n, 4, 81)),
]


@pytest.mark.parametrize("name,make,make_x", LONG, ids=[k[0] for k in LONG])
def test_ghost_norms_of_long_sequences(name, make, make_x):
    torch.manual_seed(0)
    model, x = make().double(), make_x(4).double()
    expected, R = expected_grad_samples(model, x)
    book = BookkeepingSink("ghost")
    got, dp = private_grads(copy.deepcopy(model), x, R, sink=book, clipping="per_layer", loss_reduction="mean",
                            n_params=len(expected))
    assert book.plans[dp.layer].method == "ghost"
    want, _ = clipped_reference(expected, "per_layer", "mean", len(x))
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("method", ["ghost", "per_sample"])
def test_tied_linear_in_a_compiled_model_both_norm_forms(method, loss_reduction):
    """The cross terms of a parameter used twice, with G as the compiled model delivers it (a mean loss's G
    carries 1/N, folded into the norms)."""
    torch.manual_seed(0)
    model, x = TiedAndFrozen().double(), torch.randn(5, 3, 4).double()
    expected, R = expected_grad_samples(model, x)
    book = BookkeepingSink(method)
    got, _ = private_grads(copy.deepcopy(model), x, R, sink=book, clipping="flat", loss_reduction=loss_reduction,
                           n_params=len(expected))
    want, _ = clipped_reference(expected, "flat", loss_reduction, len(x))
    assert book.tied  # the shared layer's weight and bias were seen twice in one backward pass
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{k}: {m}")


def test_a_capture_forms_the_summed_loss_gradient_once_when_read():
    from fxdp.sinks.contract import LayerCapture

    g = torch.arange(6.0).view(2, 3)
    capture = LayerCapture(2, dict, backprops=g, backprops_scale=2.0)
    assert capture.backprops_unscaled is g and capture.backprops_scale == 2.0
    torch.testing.assert_close(capture.backprops, g * 2)
    assert capture.backprops is capture.backprops and capture.backprops_scale == 1.0  # formed once
    assert torch.equal(g, torch.arange(6.0).view(2, 3))  # the delivered tensor is not changed in place


def test_a_table_tied_as_embedding_and_output_layer_is_never_materialised(monkeypatch):
    """The norm of a tied input/output embedding comes from index norms, ghost dots and their cross terms:
    no (N, V, d) per-sample gradient is formed, and the step equals batches of one."""
    from fxdp.sinks.bookkeeping.embedding import EmbeddingWeight
    from fxdp.sinks.bookkeeping.linear import LinearWeight

    torch.manual_seed(0)
    model, x = TiedLM(vocab=13, d=6).double(), _ids(4, 13, 6) * (torch.arange(6) < 5)
    expected, R = expected_grad_samples(model, x)

    def refuse(self):
        raise AssertionError(f"{type(self).__name__} materialised its per-sample gradients")

    monkeypatch.setattr(EmbeddingWeight, "grad_samples", refuse)
    want, _ = clipped_reference(expected, "flat", "mean", len(x))
    for method in ("ghost", "per_sample"):  # the output layer's use: ghost dots, or its own kept per-sample gradient
        if method == "ghost":
            monkeypatch.setattr(LinearWeight, "grad_samples", refuse)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(EmbeddingWeight, "grad_samples", refuse)
        sink = BookkeepingSink(method=method)
        got, _ = private_grads(copy.deepcopy(model), x, R, sink=sink, clipping="flat", loss_reduction="mean",
                               n_params=len(expected))
        assert list(sink.tied.values()) == [2]
        for k in want:
            torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{method} {k}: {m}")


class SharedInput(nn.Module):
    """Three Linear layers reading one input, as an attention layer's query, key and value projections, and
    one reading another tensor."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.other = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(4, 3), nn.Linear(3, 3)

    def forward(self, x):  # (N, T, 4)
        h = torch.tanh(self.q(x)) * torch.sigmoid(self.k(x))
        return h.sum(-1, keepdim=True) * self.other(torch.tanh(self.v(x)))


@pytest.mark.parametrize("t", [5, 33])  # one Gram block, or the halves
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_projections_of_one_input_share_its_gram_blocks(t, clipping):
    torch.manual_seed(0)
    model, x = SharedInput().double(), torch.randn(4, t, 4, dtype=torch.float64)
    expected, R = expected_grad_samples(model, x)
    book = BookkeepingSink("ghost")
    got, dp = private_grads(copy.deepcopy(model), x, R, sink=book, clipping=clipping, loss_reduction="mean",
                            n_params=len(expected))
    shared = sorted(k for k, p in dp.named_parameters() if p in book.shared_inputs)
    assert shared == ["k.weight", "q.weight", "v.weight"], shared
    want, _ = clipped_reference(expected, clipping, "mean", len(x))
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{k}: {m}")
