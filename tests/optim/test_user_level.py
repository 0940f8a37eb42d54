"""User-level clipping (fxdp.optim.user_level) against a reference computed one record at a time in float64.

Record i's loss is ``(out_i * R).sum()``; user u's gradient is the average of their records' gradients, each
computed alone (a batch of one); its clipped contribution is ``min(1, C / (||g_u|| + 1e-6)) g_u``. For every
engine and sink, the step's clipped sum (no noise, "sum" reduction, so ``p.grad`` is the clipped sum) must equal
the sum of those contributions, and each user's part of it (the factors the optimizer gives their records, times
the records' reference gradients) must equal their contribution and have norm <= C."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdp.grad_sample  # noqa: F401  (registers the built-in rules)
from fxdp.compiler import _wrap, compile_for_dp, wrap_model
from fxdp.optim.user_level import UserLevelDPOptimizer
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import NonFiniteSampleWarning, PerSampleError, StepRefusedError, sink_of

COUNTS = [1, 3, 2, 4, 1]  # records per user, in batch order
EPS = 1e-6


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Sequence(nn.Module):
    """Embedding (materialised per group), LayerNorm (a lane), Linear on (N, T, d) (ghost / per_sample)."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(20, 8), nn.LayerNorm(8)
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, tokens):
        h = torch.tanh(self.proj(self.norm(self.emb(tokens))))
        return self.head(h.mean(1))


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv1d(2, 4, 3), nn.Linear(4 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class Tied(nn.Module):
    """One weight in two uses (the embedding table and the output layer): the tied path, materialised per user."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)).mean(1))


class Wide(nn.Module):
    """A Linear wide enough that a user's Gram products cost less than their gradient (the ghost form)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 64), nn.Linear(64, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Recurrent(nn.Module):
    """An LSTM (its two projections share one time-major G) on an Embedding."""

    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.fc = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, tokens):
        _, (h, _) = self.lstm(self.emb(tokens))
        return self.fc(h[-1])


def _inputs(kind: str, n: int):
    g = torch.Generator().manual_seed(3)
    if kind in ("mlp", "wide"):
        return torch.randn(n, 6, generator=g, dtype=torch.float64)
    if kind in ("sequence", "tied", "recurrent"):
        return torch.randint(0, 20, (n, 5), generator=g)
    return torch.randn(n, 2, 8, generator=g, dtype=torch.float64)


MODELS = {"mlp": MLP, "sequence": Sequence, "conv": Conv, "tied": Tied, "wide": Wide, "recurrent": Recurrent}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]().double()


def _private(model, engine: str, x):
    """The model with ``engine``: (wrapped model, its sink)."""
    if engine.startswith("fx"):
        sink = {"fx": BookkeepingSink(), "fx-ghost": BookkeepingSink(method="ghost"),
                "fx-per_sample": BookkeepingSink(method="per_sample"), "fx-materialise": None}[engine]
        wrapped = compile_for_dp(model, x[:2], loss_reduction="sum", sink=sink)
    elif engine == "hooks-bookkeeping":
        wrapped = _wrap(model, "hooks", batch_first=True, loss_reduction="sum", sink=BookkeepingSink())
    else:
        wrapped = wrap_model(model, engine, loss_reduction="sum")
    return wrapped, sink_of(wrapped)


def _reference(model, x, R):
    """Each record's gradient, alone, flattened over the trainable parameters: (N, P)."""
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad()
        (model(x[i:i + 1]) * R).sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    model.zero_grad()
    return torch.stack(rows)


def _users(counts=COUNTS):
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))


CASES = [(kind, engine) for kind in MODELS
         for engine in ("fx", "fx-ghost", "fx-per_sample", "fx-materialise", "hooks", "hooks-bookkeeping",
                        "functorch", "ew")
         if not (engine == "ew" and kind not in ("mlp", "wide"))  # (ExpandedWeights: no Embedding or LayerNorm)
         and not (kind == "recurrent" and engine in ("functorch", "ew"))]


@pytest.mark.parametrize("kind, engine", CASES)
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_each_user_adds_their_clipped_average(kind, engine, clipping):
    _check_users(kind, engine, clipping, COUNTS)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("engine", ["fx", "fx-ghost"])
def test_users_of_one_size(kind, engine):
    """Users of one size, their records together: book-keeping reads each user's concatenation as a view."""
    _check_users(kind, engine, "flat", [3, 3, 3, 3])


def _check_users(kind, engine, clipping, counts):
    model = _model(kind)
    n = sum(counts)
    x = _inputs(kind, n)
    with torch.no_grad():
        R = torch.randn(model(x[:1]).shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = _reference(copy.deepcopy(model), x, R)  # (N, P) float64
    groups = _users(counts)
    averages = torch.stack([reference[groups == u].mean(0) for u in range(len(counts))])  # (U, P)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    if clipping == "flat":
        norms = averages.norm(dim=1)
        C = float(norms.median())  # some users clipped, some not
        expected_users = averages * (C / (norms + EPS)).clamp(max=1.0)[:, None]
        bound = C
    else:
        blocks = averages.split(sizes, dim=1)
        C = [float(b.norm(dim=1).median()) for b in blocks]
        expected_users = torch.cat([b * (c / (b.norm(dim=1) + EPS)).clamp(max=1.0)[:, None]
                                    for b, c in zip(blocks, C)], dim=1)
        bound = sum(c * c for c in C) ** 0.5
    wrapped, sink = _private(model, engine, x)
    optimizer = UserLevelDPOptimizer(torch.optim.SGD(params, lr=1.0), noise_multiplier=0.0, max_grad_norm=C,
                                     expected_batch_size=None, loss_reduction="sum", clipping=clipping, sink=sink)
    optimizer.expect_observed_batches()
    optimizer.observe_batch(empty=False, users=torch.tensor(counts))
    (wrapped(x) * R).sum().backward()
    factors = optimizer._factors(params)
    for u in range(len(counts)):
        rows = groups == u
        part = torch.cat([(factors[p][rows].to(torch.float64)[:, None] * reference[rows].split(sizes, 1)[k]).sum(0)
                          for k, p in enumerate(params)])
        torch.testing.assert_close(part, expected_users[u], atol=1e-9, rtol=1e-7)
        assert float(part.norm()) <= bound * (1 + 1e-9)
    optimizer.step()
    summed = torch.cat([p.grad.reshape(-1) for p in params])
    torch.testing.assert_close(summed, expected_users.sum(0), atol=1e-9, rtol=1e-7)


def test_a_user_with_a_non_finite_record_is_dropped_whole():
    model = _model("mlp")
    n = sum(COUNTS)
    x = _inputs("mlp", n)
    x[2, 0] = float("inf")  # record 2: user 1's second record (users of 1, 3, ... records)
    wrapped, sink = _private(model, "fx", x)
    optimizer = UserLevelDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                                     max_grad_norm=1.0, expected_batch_size=None, loss_reduction="sum", sink=sink)
    optimizer.observe_batch(empty=False, users=torch.tensor(COUNTS))
    wrapped(x).sum().backward()
    with pytest.warns(Warning, match="not finite"):
        factors = optimizer._factors(list(model.parameters()))
    f = next(iter(factors.values()))
    groups = _users()
    assert bool((f[groups == 1] == 0).all()) and bool((f[groups != 1] > 0).all())


def test_a_batch_without_users_is_refused():
    """A user-level optimizer never steps on a batch whose records it cannot group by user."""
    model = _model("mlp")
    x = _inputs("mlp", 4)
    wrapped, sink = _private(model, "fx", x)
    optimizer = UserLevelDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0,
                                     max_grad_norm=1.0, expected_batch_size=None, loss_reduction="sum", sink=sink)
    before = [p.detach().clone() for p in model.parameters()]
    wrapped(x).sum().backward()
    with pytest.raises(StepRefusedError, match="came without its users: it was not handed out by a user-level"):
        optimizer.step()
    optimizer.observe_batch(empty=False)  # an example-level loader's report: no users
    with pytest.raises(StepRefusedError, match="came without its users"):
        optimizer.step()
    optimizer.observe_batch(empty=False, new_epoch=True, users=torch.tensor([1, 2]))  # 3 records told, 4 rows
    with pytest.raises(StepRefusedError, match="holds 3 records of 2 users, but the per-sample gradients since the "
                                               "last step have 4 rows"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_skip_steps_are_refused():
    model = _model("mlp")
    optimizer = UserLevelDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0,
                                     max_grad_norm=1.0, expected_batch_size=None, loss_reduction="sum")
    with pytest.raises(StepRefusedError, match="all of a user's records must be in one physical batch"):
        optimizer.signal_skip_step(True)


def test_an_empty_batch_steps_with_noise_only():
    model = _model("mlp")
    wrapped, sink = _private(model, "fx", _inputs("mlp", 4))
    optimizer = UserLevelDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0,
                                     max_grad_norm=1.0, expected_batch_size=2, sink=sink,
                                     generator=torch.Generator().manual_seed(0))
    optimizer.expect_observed_batches()
    optimizer.observe_batch(empty=True, users=torch.zeros(0, dtype=torch.long))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert optimizer.steps == 1
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("kind", ["mlp", "sequence", "conv", "recurrent"])
def test_a_non_finite_record_drops_its_user_and_the_others_are_exact(kind):
    """Record 2 (user 1's second) gets an inf output gradient: user 1 adds nothing, every other user their clipped
    average. The sink was told by the optimizer to form no per-record norm: asking it for them is refused."""
    model = _model(kind)
    n = sum(COUNTS)
    x = _inputs(kind, n)
    with torch.no_grad():
        R = torch.randn(model(x[:1]).shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = _reference(copy.deepcopy(model), x, R)
    groups = _users()
    averages = torch.stack([reference[groups == u].mean(0) for u in range(len(COUNTS))])
    C = float(averages.norm(dim=1).median())
    clipped = averages * (C / (averages.norm(dim=1) + EPS)).clamp(max=1.0)[:, None]
    weights = torch.ones(n, 1, dtype=torch.float64)
    weights[2] = float("inf")
    params = list(model.parameters())
    wrapped, sink = _private(model, "fx", x)
    optimizer = UserLevelDPOptimizer(torch.optim.SGD(params, lr=1.0), noise_multiplier=0.0, max_grad_norm=C,
                                     expected_batch_size=None, loss_reduction="sum", sink=sink)
    optimizer.observe_batch(empty=False, users=torch.tensor(COUNTS))
    (wrapped(x) * R * weights).sum().backward()
    with pytest.raises(PerSampleError, match="holds no per-sample norms"):
        sink.squared_norms(params)
    with pytest.warns(NonFiniteSampleWarning, match=r"not finite .* for 1 of 5 users \(first: user 1 of the batch, "
                                                    r"records \[1, 2, 3\]\)"):
        optimizer.step()
    summed = torch.cat([p.grad.reshape(-1) for p in params])
    torch.testing.assert_close(summed, clipped[groups.unique() != 1].sum(0), atol=1e-9, rtol=1e-7)
