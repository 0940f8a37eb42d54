"""BookkeepingSink told that only grouped norms are read (set_grouped_norms_only, what a user-level optimizer tells
it): no per-sample norm formed, each group's summed gradient kept for the clipped sum where it is formed for the
norm. Against per-sample gradients of batches of one in float64: the grouped norms, and clipped sums under factors
equal within each group; per-sample reads refused, never answered with something stale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdp.grad_sample  # noqa: F401  (registers the built-in rules)
from fxdp.compiler import compile_for_dp
from fxdp.diagnostics.errors import PerSampleError
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import GradientSink, GradSampleSink

GROUPS = torch.tensor([2, 0, 0, 1, 2, 2, 0, 3])  # four groups of 3, 1, 3 and 1 samples, not in order
IN_ORDER = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # four of 2, together: read as a view


class Sequence(nn.Module):
    """A Linear on (N, T, d) whose group gradients are formed and kept, a Linear on (N, d) read by Gram products."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)).mean(1))


class Conv(nn.Module):
    """A Conv2d with groups=1 (its kept group gradients put back in the weight's order) and its bias."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, (2, 3), padding=1), nn.Linear(4 * 5 * 5, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class Wide(nn.Module):
    """A Linear whose group gradients would hold more than its A and G: norms by Gram products, nothing kept."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x).sum(1)


INPUTS = {"sequence": (Sequence, (6, 5)), "conv": (Conv, (3, 4, 5)), "wide": (Wide, (2, 64))}


def _setup(kind):
    torch.manual_seed(0)
    cls, shape = INPUTS[kind]
    model = cls().double()
    x = torch.randn(len(GROUPS), *shape, dtype=torch.float64)
    with torch.no_grad():
        r = torch.randn(model(x[:1]).shape, dtype=torch.float64)
    reference = []  # each sample's gradient, alone
    for i in range(len(x)):
        model.zero_grad()
        (model(x[i:i + 1]) * r).sum().backward()
        reference.append({p: p.grad.clone() for p in model.parameters()})
    model.zero_grad()
    sink = BookkeepingSink()
    wrapped = compile_for_dp(model, x[:2], loss_reduction="sum", sink=sink)
    return model, wrapped, sink, x, r, reference


def _per_group(reference, p, groups):
    return torch.stack([sum(reference[i][p] for i in range(len(groups)) if groups[i] == u)
                        for u in range(int(groups.max()) + 1)])


@pytest.mark.parametrize("kind", list(INPUTS))
@pytest.mark.parametrize("groups", [GROUPS, IN_ORDER], ids=["uneven", "in_order"])
def test_grouped_norms_and_clipped_sums_are_those_of_the_groups(kind, groups):
    model, wrapped, sink, x, r, reference = _setup(kind)
    assert sink.set_grouped_norms_only(True) is True
    (wrapped(x) * r).sum().backward()
    params = list(model.parameters())
    num = int(groups.max()) + 1
    assert sink.sample_rows(params) == {p: len(x) for p in params}
    norms = sink.grouped_squared_norms(params, groups, num)
    factors = torch.rand(num, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sums = sink.clipped_sums(params, {p: factors[groups] for p in params})
    for p in params:
        summed = _per_group(reference, p, groups)
        torch.testing.assert_close(norms[p], summed.flatten(1).pow(2).sum(1), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(sums[p], torch.tensordot(factors, summed, dims=1), rtol=1e-10, atol=1e-12)
    # asked again (the optimizer's checks read them once more at the step): the same norms
    again = sink.grouped_squared_norms(params, groups, num)
    assert all(torch.equal(again[p], norms[p]) for p in params)
    # the weights whose group gradients were kept hold no per-sample row any more; the wide one kept its A and G
    for p in (p for p in params if p.dim() > 1):
        if kind == "wide":
            torch.testing.assert_close(sink.grad_samples([p])[p], torch.stack([ref[p] for ref in reference]))
        else:
            with pytest.raises(PerSampleError, match="holds no per-sample gradients"):
                sink.grad_samples([p])


def test_per_sample_reads_are_refused_not_stale():
    model, wrapped, sink, x, r, _ = _setup("sequence")
    sink.set_grouped_norms_only(True)
    (wrapped(x) * r).sum().backward()
    params = list(model.parameters())
    with pytest.raises(PerSampleError, match="holds no per-sample norms.*set_grouped_norms_only"):
        sink.squared_norms(params)
    sink.grouped_squared_norms(params, GROUPS, 4)
    with pytest.raises(PerSampleError, match="holds no per-sample gradients"):
        sink.grad_samples([model.proj.weight])  # its group gradients were kept: no per-sample row left
    with pytest.raises(PerSampleError, match="other users than those the records were summed for"):
        sink.grouped_squared_norms([model.proj.weight], IN_ORDER, 4)
    unequal = torch.ones(len(x), dtype=torch.float64)
    unequal[1] = 0.5  # group 0's first sample
    with pytest.raises(PerSampleError, match="clip factors of one user's records differ"):
        sink.clipped_sums([model.proj.weight], {model.proj.weight: unequal})
    part = torch.zeros(len(x), dtype=torch.bool)
    part[1] = True  # one of group 0's three samples
    with pytest.raises(PerSampleError, match="only whole users can be dropped"):
        sink.drop_samples([model.proj.weight], part)


def test_dropping_whole_groups_zeroes_them():
    model, wrapped, sink, x, r, reference = _setup("conv")
    sink.set_grouped_norms_only(True)
    x = x.clone()
    x[3, 0, 0, 0] = float("nan")  # group 1's only sample
    (wrapped(x) * r).sum().backward()
    params = list(model.parameters())
    norms = sink.grouped_squared_norms(params, GROUPS, 4)
    assert not bool(torch.isfinite(norms[model.conv.weight][1])) and bool(torch.isfinite(norms[model.conv.weight][0]))
    sink.drop_samples(params, GROUPS == 1)
    sums = sink.clipped_sums(params, {p: torch.ones(len(x), dtype=torch.float64) for p in params})
    kept = GROUPS != 1
    for p in params:  # the other groups' samples (their reference gradients are those of the clean inputs)
        expected = sum(reference[i][p] for i in range(len(x)) if kept[i])
        torch.testing.assert_close(sums[p], expected, rtol=1e-10, atol=1e-12)


def test_sinks_without_the_form_take_nothing_and_answer_as_before():
    """The contract's default takes nothing (False) and answers every read; its sample rows are the norms' rows."""
    w = nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    w.grad_sample = torch.randn(5, 3, 2, dtype=torch.float64)
    sink = GradSampleSink()
    assert sink.set_grouped_norms_only(True) is False
    assert sink.sample_rows([w]) == {w: 5} == GradientSink.sample_rows(sink, [w])
    assert sink.squared_norms([w])[w].shape == (5,)
