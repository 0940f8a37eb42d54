"""The book-keeping sink computes once what a recurrent layer's two projections share: an LSTM's or RNN's
input and recurrent projections get one tensor of gate gradients G, so one G Gram serves both ghost norms, one
``sum_t G`` both biases, and one product ``G^T [A_ih c, A_hh c]`` both clipped sums when their clip factors are
equal. A GRU's projections have different G's and must not share; a frozen projection, a layer called twice
(tied uses) and stacked or bidirectional layers must share only within one layer and direction. Every case is
checked against batches of one. Float64, small sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import fxdp
from fxdp.runtime.recurrent import recurrent_forward
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.bookkeeping import shared as shared_module
from tests.support.per_sample_reference import expected_grad_samples

N, T, D, H = 3, 5, 3, 4
KINDS = {"lstm": nn.LSTM, "rnn": nn.RNN, "gru": nn.GRU}


pytestmark = pytest.mark.usefixtures("float64")  # tight comparisons (tests/support/fixtures.py)


@pytest.fixture
def shared_products(monkeypatch):
    """How many uses each call of the shared clipped-sum product served."""
    calls = []
    original = shared_module.shared_clipped_sums

    def counting(uses, c):
        calls.append(len(uses))
        return original(uses, c)

    monkeypatch.setattr(shared_module, "shared_clipped_sums", counting)
    return calls


def _per_sample(rnn, x, weights, lengths):
    """Each parameter's per-sample gradients from batches of one with the stock module (loss: the outputs times
    fixed weights, summed)."""
    params = [p for p in rnn.parameters() if p.requires_grad]
    rows = []
    for i in range(N):
        x_i = x[i:i + 1, :T if lengths is None else lengths[i]]
        out, _ = rnn(x_i)
        rows.append(torch.autograd.grad((out * weights[i:i + 1, :out.shape[1]]).sum(), params))
    return {p: torch.stack([r[j] for r in rows]) for j, p in enumerate(params)}


def _bookkept(rnn, x, weights, lengths, method="ghost"):
    book = BookkeepingSink(method)
    feed = x if lengths is None else pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    out, _ = recurrent_forward(rnn, feed, deliver=book.add, loss_reduction="sum", param_grads=False)
    if lengths is not None:
        out = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=T)[0]
    (out * weights).sum().backward()
    return book


def _check(book, expected, factors):
    norms = book.squared_norms(expected)
    sums = book.clipped_sums(list(expected), factors)
    for p, g in expected.items():
        torch.testing.assert_close(norms[p], g.flatten(1).pow(2).sum(1), atol=1e-10, rtol=1e-8)
        torch.testing.assert_close(sums[p], torch.tensordot(factors[p], g, dims=1), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("lengths", [None, [3, 5, 2]], ids=["padded", "packed"])
def test_lstm_and_rnn_projections_share_their_one_g_and_gru_projections_do_not(kind, lengths, shared_products):
    torch.manual_seed(0)
    rnn = KINDS[kind](D, H, batch_first=True)
    x, weights = torch.randn(N, T, D), torch.randn(N, T, H)
    expected = _per_sample(rnn, x, weights, lengths)
    shares = kind != "gru"  # a GRU's n gate reads r * (h W_hn^T + b_hn): its two projections see different G's

    # flat clipping: one factor tensor for every parameter, so the clipped sums share one product too
    book = _bookkept(rnn, x, weights, lengths)
    factor = torch.rand(N)
    _check(book, expected, {p: factor for p in expected})
    w_ih, w_hh, b_ih, b_hh = rnn.weight_ih_l0, rnn.weight_hh_l0, rnn.bias_ih_l0, rnn.bias_hh_l0
    assert book.shared == ({w_ih: 2, w_hh: 2} if shares else {})
    assert shared_products == ([2] if shares else [])
    biases = [book._segments[b].uses[0].gs for b in (b_ih, b_hh)]
    assert (biases[0] is biases[1]) == shares

    # per-layer clipping: different factors, so each projection's clipped sum is its own product
    shared_products.clear()
    book = _bookkept(rnn, x, weights, lengths)
    _check(book, expected, {p: torch.rand(N) for p in expected})
    assert shared_products == []


def test_equal_factors_given_as_different_tensors_share_the_product_and_different_ones_do_not(shared_products):
    torch.manual_seed(1)
    rnn = nn.LSTM(D, H, batch_first=True)
    x, weights = torch.randn(N, T, D), torch.randn(N, T, H)
    expected = _per_sample(rnn, x, weights, None)
    factor = torch.rand(N)
    factors = {p: factor.clone() for p in expected}
    factors[rnn.bias_hh_l0] = torch.rand(N)  # a bias's factor does not matter to the weights' product
    book = _bookkept(rnn, x, weights, None)
    _check(book, expected, factors)
    assert shared_products == [2]
    # one weight's factor differs in a single sample: a shared product would give it the other's factor
    shared_products.clear()
    factors[rnn.weight_hh_l0] = factor.clone()
    factors[rnn.weight_hh_l0][1] *= 0.5
    book = _bookkept(rnn, x, weights, None)
    _check(book, expected, factors)
    assert shared_products == []


@pytest.mark.parametrize("frozen", ["weight_hh_l0", "weight_ih_l0", "bias_ih_l0"])
def test_a_frozen_projection_parameter_leaves_the_other_exact(frozen, shared_products):
    torch.manual_seed(2)
    rnn = nn.LSTM(D, H, batch_first=True)
    getattr(rnn, frozen).requires_grad_(False)
    x, weights = torch.randn(N, T, D), torch.randn(N, T, H)
    expected = _per_sample(rnn, x, weights, None)
    assert getattr(rnn, frozen) not in expected
    book = _bookkept(rnn, x, weights, None)
    factor = torch.rand(N)
    _check(book, expected, {p: factor for p in expected})
    assert getattr(rnn, frozen) not in book.squared_norms(rnn.parameters())
    weights_kept = [p for p in (rnn.weight_ih_l0, rnn.weight_hh_l0) if p.requires_grad]
    assert book.shared == ({p: 2 for p in weights_kept} if len(weights_kept) == 2 else {})
    assert shared_products == ([2] if len(weights_kept) == 2 else [])


def test_stacked_bidirectional_layers_share_only_within_one_layer_and_direction(shared_products):
    torch.manual_seed(3)
    rnn = nn.LSTM(D, H, num_layers=2, bidirectional=True, batch_first=True)
    x, weights = torch.randn(N, T, D), torch.randn(N, T, 2 * H)
    expected = _per_sample(rnn, x, weights, None)
    book = _bookkept(rnn, x, weights, None)
    factor = torch.rand(N)
    _check(book, expected, {p: factor for p in expected})
    assert book.shared == {p: 2 for name, p in rnn.named_parameters() if name.startswith("weight")}
    assert shared_products == [2, 2, 2, 2]


def test_a_layer_called_twice_keeps_the_tied_norms(shared_products):
    """Each weight has two uses (one per call) with different G's: the norm of their sum takes the tied path
    (cross terms), not the shared one; the clipped sums still pair each call's two projections."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.fc = nn.LSTM(D, H, batch_first=True), nn.Linear(H, 2)

        def forward(self, x):
            out, _ = self.lstm(x)
            _, (h, _) = self.lstm(x.flip(1))
            return self.fc(out[:, -1] + h[-1])

    torch.manual_seed(4)
    model = Twice()
    x = torch.randn(N, T, D)
    expected, R = expected_grad_samples(model, (x,))
    book = BookkeepingSink("ghost")
    compiled = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction="mean", sink=book)
    ((compiled(x) * R).sum() / N).backward()
    by_param = {p: expected[name] for name, p in model.named_parameters()}
    factor = torch.rand(N)
    _check(book, by_param, {p: factor for p in by_param})
    lstm = model.lstm
    assert book.tied[lstm.weight_ih_l0] == book.tied[lstm.weight_hh_l0] == 2
    assert lstm.weight_ih_l0 not in book.shared and lstm.weight_hh_l0 not in book.shared
    assert shared_products == [2, 2]


def test_a_mean_loss_in_a_compiled_lstm_classifier_shares_and_stays_exact(shared_products):
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lstm, self.fc = nn.Embedding(20, D), nn.LSTM(D, H, batch_first=True), nn.Linear(H, 2)

        def forward(self, ids):
            _, (h, _) = self.lstm(self.emb(ids))
            return self.fc(h[-1])

    torch.manual_seed(5)
    model = Classifier()
    ids = torch.randint(0, 20, (N, T))
    expected, R = expected_grad_samples(model, (ids,))
    book = BookkeepingSink("ghost")
    compiled = fxdp.compile_for_dp(model, example_inputs=ids, sink=book)  # loss_reduction="mean"
    ((compiled(ids) * R).sum() / N).backward()
    by_param = {p: expected[name] for name, p in model.named_parameters()}
    factor = torch.rand(N)
    _check(book, by_param, {p: factor for p in by_param})
    assert book.shared == {model.lstm.weight_ih_l0: 2, model.lstm.weight_hh_l0: 2}
    assert shared_products == [2]
