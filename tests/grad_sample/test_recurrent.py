"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) run step by step as Linear-like projections
(fxdp.runtime.recurrent): outputs and gradients equal the stock module's, per-sample gradients equal
batches of one, and the book-keeping sink's norms and clipped sums equal the materialising sink's, for
every configuration: batch_first either way, one or two layers, one or two directions, with and without
bias, padded or packed (sorted or not) inputs, initial states given or not. Float64, small sizes."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import fxdp
from fxdp.grad_sample.recurrent import LSTMProjection
from fxdp.runtime.recurrent import recurrent_forward
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import GradSampleSink
from tests.support.per_sample_reference import expected_grad_samples

N, T, D, H = 3, 4, 3, 4
KINDS = {"lstm": (nn.LSTM, {}), "gru": (nn.GRU, {}), "rnn": (nn.RNN, {}),
         "rnn_relu": (nn.RNN, {"nonlinearity": "relu"})}
LENGTHS = {"padded": None, "packed_sorted": [4, 3, 1], "packed_unsorted": [2, 4, 3]}


pytestmark = pytest.mark.usefixtures("float64")  # tight comparisons (tests/support/fixtures.py)


def _leaves(value):
    if isinstance(value, PackedSequence):
        return [value.data]
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _leaves(v)]


def _layer(kind, batch_first, layers, bidirectional, bias):
    cls, extra = KINDS[kind]
    return cls(D, H, num_layers=layers, bidirectional=bidirectional, bias=bias, batch_first=batch_first, **extra)


# -- the layer alone: the same outputs and gradients as the stock module, and per-sample gradients, norms and
# -- clipped sums equal to batches of one, for every configuration -------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("inputs", list(LENGTHS))
def test_every_configuration_of_the_layer_alone(kind, inputs):
    torch.manual_seed(0)
    for k, config in enumerate(itertools.product((True, False), (1, 2), (False, True), (True, False), (False, True))):
        _check_layer(kind, inputs, *config, method=(None, "ghost", "per_sample")[k % 3])


def _feed(x, lengths, batch_first, enforce_sorted):
    return x if lengths is None else pack_padded_sequence(x, lengths, batch_first, enforce_sorted=enforce_sorted)


def _padded(out, batch_first):
    """The output batch first (a packed one padded to T steps, zeros after each sequence's end)."""
    if isinstance(out, PackedSequence):
        return pad_packed_sequence(out, batch_first=True, total_length=T)[0]
    return out if batch_first else out.transpose(0, 1)


def _loss(output, state, weights, batch_first):
    """Sum of every output (each step's, each last state) times fixed random weights, batch first."""
    states = [s.transpose(0, 1) for s in _leaves(state)]
    return sum((t * w).sum() for t, w in zip([_padded(output, batch_first), *states], weights))


def _check_layer(kind, inputs, batch_first, layers, bidirectional, bias, with_state, method):
    config = (kind, inputs, batch_first, layers, bidirectional, bias, with_state, method)
    rnn = _layer(kind, batch_first, layers, bidirectional, bias)
    lengths, enforce = LENGTHS[inputs], inputs == "packed_sorted"
    x = torch.randn((N, T, D) if batch_first else (T, N, D), requires_grad=True)
    hx = None
    if with_state:
        h0 = torch.randn(layers * (1 + bidirectional), N, H, requires_grad=True)
        hx = (h0, torch.randn_like(h0).requires_grad_()) if kind == "lstm" else h0
    stock = rnn(_feed(x, lengths, batch_first, enforce), hx)
    ours = recurrent_forward(rnn, _feed(x, lengths, batch_first, enforce), hx)
    assert type(ours[0]) is type(stock[0]), config
    if isinstance(stock[0], PackedSequence):
        assert torch.equal(ours[0].batch_sizes, stock[0].batch_sizes), config
    for a, b in zip(_leaves(ours), _leaves(stock)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=lambda m: f"{config} output: {m}")
    weights = [torch.randn(N, *t.shape[1:]) for t in [_padded(stock[0], batch_first), *(
        s.transpose(0, 1) for s in _leaves(stock[1]))]]
    wrt = [x, *rnn.parameters(), *([] if hx is None else _leaves(hx))]
    expected = torch.autograd.grad(_loss(*stock, weights, batch_first), wrt)
    got = torch.autograd.grad(_loss(*ours, weights, batch_first), wrt)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=lambda m: f"{config} gradient: {m}")

    # batches of one, with the stock module
    params = list(rnn.parameters())
    rows = []
    for i in range(N):
        x_i = x.detach().narrow(0 if batch_first else 1, i, 1)
        hx_i = None if hx is None else tuple(h.detach()[:, i:i + 1] for h in _leaves(hx))
        hx_i = hx_i if hx_i is None or kind == "lstm" else hx_i[0]
        feed_i = _feed(x_i, None if lengths is None else lengths[i:i + 1], batch_first, True)
        rows.append(torch.autograd.grad(_loss(*rnn(feed_i, hx_i), [w[i:i + 1] for w in weights], batch_first), params))
    per_sample = [torch.stack([row[j] for row in rows]) for j in range(len(params))]
    materialising, book = GradSampleSink(), BookkeepingSink(method)
    for sink in (materialising, book):
        out = recurrent_forward(rnn, _feed(x, lengths, batch_first, enforce), hx, deliver=sink.add,
                                loss_reduction="sum", param_grads=sink is materialising)
        _loss(*out, weights, batch_first).backward()
    norms = book.squared_norms(params)
    factors = {p: torch.rand(N) for p in params}
    sums = book.clipped_sums(params, factors)
    for (name, p), g in zip(rnn.named_parameters(), per_sample):
        what = f"{config} {name}"
        torch.testing.assert_close(p.grad_sample, g, atol=1e-10, rtol=1e-8, msg=lambda m: f"{what} grad_sample: {m}")
        torch.testing.assert_close(norms[p], g.flatten(1).pow(2).sum(1), atol=1e-10, rtol=1e-8,
                                   msg=lambda m: f"{what} norms: {m}")
        torch.testing.assert_close(sums[p], torch.tensordot(factors[p], g, dims=1), atol=1e-10, rtol=1e-8,
                                   msg=lambda m: f"{what} clipped sum: {m}")


# -- in a model: per-sample gradients, norms and clipped sums -------------------------------------------------


class Net(nn.Module):
    """An RNN over an embedded input whose loss uses its output at every step and its last state (and cell),
    optionally from an initial state computed per sample; padded or packed inside the model."""

    def __init__(self, kind, batch_first, layers, bidirectional, bias, inputs, with_state):
        super().__init__()
        self.kind, self.batch_first, self.inputs, self.with_state = kind, batch_first, inputs, with_state
        self.inp = nn.Linear(D, D)
        self.rnn = _layer(kind, batch_first, layers, bidirectional, bias)
        self.states = layers * (1 + bidirectional)
        self.init = nn.Linear(D, self.states * H) if with_state else None
        self.head = nn.Linear(H * (1 + bidirectional), 2)
        self.last = nn.Linear(H, 2)

    def forward(self, x, lengths=None):  # x: (N, T, D), batch first
        e = self.inp(x)
        feed = e if self.batch_first else e.transpose(0, 1)
        if lengths is not None:
            feed = pack_padded_sequence(feed, lengths, self.batch_first, enforce_sorted=self.inputs == "packed_sorted")
        hx = None
        if self.with_state:
            h0 = self.init(x[:, 0]).view(x.shape[0], self.states, H).transpose(0, 1).contiguous()
            hx = (h0, torch.tanh(h0)) if self.kind == "lstm" else h0
        out, state = self.rnn(feed, hx)
        if lengths is not None:
            out, _ = pad_packed_sequence(out, self.batch_first, total_length=x.shape[1])
        out = out.sum(1 if self.batch_first else 0)
        h_n, c_n = state if self.kind == "lstm" else (state, None)
        y = self.head(out) + self.last(h_n[-1])
        return y if c_n is None else y + self.last(c_n[0])


def _configs():
    """Every kind with every input kind and initial state given or not; the layer's four other switches
    (batch_first, layers, directions, bias) take all their 16 combinations along the way (every
    combination of all seven switches is checked on the layer alone, above)."""
    shapes = list(itertools.product((True, False), (1, 2), (False, True), (True, False)))
    for k, (kind, inputs, with_state) in enumerate(itertools.product(KINDS, LENGTHS, (False, True))):
        yield (kind, inputs, *shapes[(5 * k) % len(shapes)], with_state)


def _ids(config):
    kind, inputs, batch_first, layers, bidirectional, bias, with_state = config
    return (f"{kind}-{inputs}-{'bf' if batch_first else 'tm'}-l{layers}-{'bi' if bidirectional else 'uni'}"
            f"-{'bias' if bias else 'nobias'}-{'h0' if with_state else 'noh0'}")


CONFIGS = list(_configs())


@pytest.mark.parametrize("config", CONFIGS, ids=[_ids(c) for c in CONFIGS])
def test_per_sample_norms_and_clipped_sums_equal_batches_of_one(config):
    kind, inputs, *_ = config
    torch.manual_seed(CONFIGS.index(config))
    model = Net(kind, *config[2:6], inputs, config[6])
    x = torch.randn(N, T, D)
    args = (x,) if LENGTHS[inputs] is None else (x, torch.tensor(LENGTHS[inputs]))
    state = {k: (v.shape, v.clone()) for k, v in model.state_dict().items()}
    expected, R = expected_grad_samples(model, args)
    params = dict(model.named_parameters())
    # the book-keeping method alternates over the configurations: the choice from shapes, or forced either way
    method = (None, "ghost", "per_sample")[CONFIGS.index(config) % 3]
    reduction = ("sum", "mean")[CONFIGS.index(config) % 2]
    scale = N if reduction == "mean" else 1

    materialising = fxdp.compile_for_dp(model, example_inputs=args, loss_reduction=reduction)
    out = materialising(*args)
    with torch.no_grad():
        torch.testing.assert_close(out, model(*args), atol=1e-12, rtol=1e-10)
    ((out * R).sum() / scale).backward()
    for name, p in params.items():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-10, rtol=1e-8, msg=lambda m: f"{name}: {m}")
        p.grad_sample, p.grad = None, None
    if hasattr(materialising, "remove_hooks"):  # the hooks engine (packed inputs): one wrapper at a time
        materialising.remove_hooks()

    book = BookkeepingSink(method)
    bookkept = fxdp.compile_for_dp(model, example_inputs=args, loss_reduction=reduction, sink=book)
    ((bookkept(*args) * R).sum() / scale).backward()
    norms = book.squared_norms(params.values())
    factors = {p: torch.rand(N) for p in params.values()}
    sums = book.clipped_sums(params.values(), factors)
    for name, p in params.items():
        assert getattr(p, "grad_sample", None) is None, name
        torch.testing.assert_close(norms[p], expected[name].flatten(1).pow(2).sum(1), atol=1e-10, rtol=1e-8,
                                   msg=lambda m: f"{name} norms: {m}")
        torch.testing.assert_close(sums[p], torch.tensordot(factors[p], expected[name], dims=1), atol=1e-10,
                                   rtol=1e-8, msg=lambda m: f"{name} clipped sum: {m}")
    rnn_params = [p for n, p in params.items() if n.startswith("rnn.")]
    if fxdp.report(bookkept).engine == "fx":  # the graph's book-kept layers leave p.grad to the optimizer
        assert all(p.grad is None for p in rnn_params)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: s for k, (s, _) in state.items()}
    assert all(torch.equal(model.state_dict()[k], v) for k, (_, v) in state.items())


def test_padded_inputs_compile_to_the_graph_and_packed_ones_to_the_hooks_engine():
    for inputs, engine in (("padded", "fx"), ("packed_unsorted", "hooks")):
        model = Net("lstm", True, 1, False, True, inputs, False)
        x = torch.randn(N, T, D)
        args = (x,) if LENGTHS[inputs] is None else (x, torch.tensor(LENGTHS[inputs]))
        compiled = fxdp.compile_for_dp(model, example_inputs=args)
        assert fxdp.report(compiled).engine == engine
        if engine == "hooks":
            assert compiled.grad_sample_layers["rnn"] == "recurrent rule"
        else:
            change = next(c for c in fxdp.report(compiled).pass_report("per_sample").changes if c.node == "rnn")
            assert "by the recurrent rule" in change.message


# -- plans and reports --------------------------------------------------------------------------------------


class Classifier(nn.Module):
    def __init__(self, d=64, h=128):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(d, h, batch_first=True), nn.Linear(h, 2)

    def forward(self, x):
        _, (h, _) = self.lstm(x)
        return self.fc(h[-1])


def test_each_projection_is_planned_from_static_shapes_and_reported():
    x = torch.randn(2, 50, 64)
    book = BookkeepingSink()
    compiled = fxdp.compile_for_dp(Classifier(), example_inputs=x, sink=book)
    line = next(note for note in fxdp.report(compiled).notes if "'lstm'" in note)
    # T=50, d=64, p=512: ghost 50^2 (64 + 512) <= 50 * 64 * 512; recurrent d=128: 50^2 (128 + 512) <= 50 * 128 * 512
    assert line.startswith("book-keeping: 'lstm' (LSTM): ghost (projections over T=50 steps")
    assert "weight_ih_l0 ghost (d=64, p=512: ghost 1,440,000 vs per-sample 1,638,400)" in line
    assert "weight_hh_l0 ghost (d=128, p=512: ghost 1,600,000 vs per-sample 3,276,800)" in line
    F.cross_entropy(compiled(x), torch.tensor([0, 1])).backward()
    seen = {view.name: (type(view), plan.method) for view, plan in book.plans.items() if hasattr(view, "name")}
    assert seen == {"weight_ih_l0": (LSTMProjection, "ghost"), "weight_hh_l0": (LSTMProjection, "ghost")}
    # long sequences of narrow layers: materialising the per-sample gradient is cheaper, and the plan says so
    narrow = fxdp.compile_for_dp(Classifier(8, 8), example_inputs=torch.randn(2, 20, 8), sink=BookkeepingSink())
    line = next(n for n in fxdp.report(narrow).notes if "'lstm'" in n)
    assert "'lstm' (LSTM): per_sample" in line
    assert "weight_hh_l0 per_sample (d=8, p=32: ghost 16,000 vs per-sample 5,120)" in line


def test_a_recurrent_layer_called_twice_and_a_frozen_projection():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.fc = nn.GRU(D, H, batch_first=True), nn.Linear(H, 2)

        def forward(self, x):
            out, _ = self.gru(x)
            _, h = self.gru(x.flip(1))
            return self.fc(out[:, -1] + h[-1])

    torch.manual_seed(3)
    model = Twice()
    model.gru.weight_hh_l0.requires_grad_(False)
    x = torch.randn(N, T, D)
    expected, R = expected_grad_samples(model, (x,))
    book = BookkeepingSink()
    compiled = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction="sum", sink=book)
    (compiled(x) * R).sum().backward()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    norms = book.squared_norms(params.values())
    assert model.gru.weight_hh_l0 not in norms
    for name, p in params.items():
        torch.testing.assert_close(norms[p], expected[name].flatten(1).pow(2).sum(1), msg=lambda m: f"{name}: {m}")
    assert book.tied[model.gru.weight_ih_l0] == 2


def test_private_training_with_a_stock_lstm_keeps_the_users_module_and_checkpoint():
    torch.manual_seed(4)
    model = Classifier(d=D, h=H)  # a stock nn.LSTM, as users write it
    keys = {k: v.shape for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, T, D), torch.randint(0, 2, (8,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    engine = fxdp.PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0)
    with torch.no_grad():
        torch.testing.assert_close(private(x), reference(x))
    for xb, yb in loader:
        if len(xb):
            optimizer.zero_grad()
            F.cross_entropy(private(xb), yb).backward()
            optimizer.step()
    assert type(model.lstm) is nn.LSTM and {k: v.shape for k, v in model.state_dict().items()} == keys
    assert not torch.equal(model.lstm.weight_hh_l0, reference.lstm.weight_hh_l0)  # it trained
    reference.load_state_dict(model.state_dict())  # a stock module loads the checkpoint as it is
