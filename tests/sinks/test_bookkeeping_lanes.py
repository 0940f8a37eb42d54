"""Lanes (fxdp/sinks/bookkeeping/lanes.py): small alike layers have their norms and clipped sums formed together.
The numbers must be each layer's own: per-sample norms and clipped sums equal those of batches of one in float64,
and equal the book-keeping sink's without lanes (every layer alone), for the cases where members leave a lane or
join it several times: per-layer factors, dropped samples, a layer used twice, two backward passes in one step, a
LayerNorm with a frozen weight among others, LayerNorm on sequences."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdp
from fxdp.sinks.bookkeeping import BookkeepingSink, lanes
from fxdp.sinks.bookkeeping.lanes import LaneMember
from tests.support.per_sample_reference import batch_loss, expected_grad_samples


class DeepNarrow(nn.Module):
    """Blocks of Linear + LayerNorm + GELU (the small layers lanes are for); ``twice``: block 0's Linear is used
    again after the last block; ``frozen_norm_weight``: block 1's LayerNorm weight is frozen (its bias is not)."""

    def __init__(self, width=5, blocks=3, twice=False, frozen_norm_weight=False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                    for _ in range(blocks))
        self.head = nn.Linear(width, 3)
        self.twice = twice
        if frozen_norm_weight:
            self.blocks[1][1].weight.requires_grad_(False)
        with torch.no_grad():  # LayerNorm weights and biases not 1 and 0: their per-sample gradients differ then
            for block in self.blocks:
                block[1].weight.uniform_(0.5, 1.5)
                block[1].bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if self.twice:
            x = self.blocks[0][0](x)
        return self.head(x)


def _record(model, x, reduction="mean", passes=1):
    """The compiled model's sink after ``passes`` backward passes of the reference loss on ``x``."""
    sink = BookkeepingSink()
    dp = fxdp.compile_for_dp(model, example_inputs=x, sink=sink, loss_reduction=reduction)
    _, R = expected_grad_samples(model, x)
    loss = batch_loss(dp(x), R, reduction)
    for _ in range(passes):  # one forward, backward passes that each add its per-sample gradients once more
        loss.backward(retain_graph=True)
    return sink


def _expected(model, x, passes=1):
    per_sample, _ = expected_grad_samples(model, x)
    return {p: passes * per_sample[name] for name, p in model.named_parameters() if p.requires_grad}


def _norms_and_sums(sink, params, factors):
    norms = sink.squared_norms(params)
    return norms, sink.clipped_sums(params, factors)


def _check(model, x, factors_of, reduction="mean", passes=1, drops=()):
    params = [p for p in model.parameters() if p.requires_grad]
    expected = _expected(model, x, passes)
    laned = _record(model, x, reduction, passes)
    assert any(isinstance(u, LaneMember) and u.lane is not None and len(u.lane.members) > 1
               for s in laned._segments.values() for u in s.uses), "no lane of several members was formed"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lanes, "SMALL", -1)  # no use is small: every layer alone
        alone = _record(model, x, reduction, passes)
    factors = factors_of(params, x.shape[0])
    for k, drop in enumerate(drops):  # one tensor for every parameter, as the optimizer drops rows
        for sink in (laned, alone):
            sink.drop_samples(params, drop)
        expected = {p: g.masked_fill(drop.view(-1, *[1] * p.dim()), 0) for p, g in expected.items()}
        in_lanes = [u for s in laned._segments.values() for u in s.uses if isinstance(u, LaneMember) and u.lane]
        # the first mask: the lanes drop the rows from their stacks (members stay); another: each member alone
        assert bool(in_lanes) == (k == 0) and all(u._pending is drop for u in in_lanes)
    results = [_norms_and_sums(sink, params, factors) for sink in (laned, alone)]
    for p in params:
        g = expected[p]
        want_norm = g.flatten(1).pow(2).sum(1)
        want_sum = torch.einsum("n,n...->...", factors[p], g)
        for norms, sums in results:
            if not drops:
                torch.testing.assert_close(norms[p], want_norm, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(sums[p], want_sum, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(results[0][1][p], results[1][1][p], rtol=1e-12, atol=1e-14)


def _flat(params, n):
    c = torch.linspace(0.2, 1.0, n, dtype=torch.float64)
    return {p: c for p in params}  # one tensor for all: the lanes form the sums together


def _per_layer(params, n):
    return {p: torch.linspace(0.1, 1.0, n, dtype=torch.float64) * (k + 1) / len(params) for k, p in enumerate(params)}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lanes_give_each_layer_its_own_norms_and_sums(reduction):
    torch.manual_seed(0)
    model = DeepNarrow().double()
    _check(model, torch.randn(6, 5, dtype=torch.float64), _flat, reduction)


def test_per_layer_factors_are_formed_alone_and_right():
    torch.manual_seed(1)
    _check(DeepNarrow().double(), torch.randn(4, 5, dtype=torch.float64), _per_layer)


def test_dropped_samples_are_dropped_by_the_lane_then_by_each_member():
    """A padded batch's padding rows (one mask for all parameters) are dropped from the lanes' stacks; rows dropped
    after that (non-finite norms) make each member drop both from its own tensors and be formed alone."""
    torch.manual_seed(2)
    model, x = DeepNarrow().double(), torch.randn(5, 5, dtype=torch.float64)
    first, second = torch.tensor([False, False, False, True, True]), torch.tensor([False, True, False, True, True])
    _check(model, x, _flat, drops=[first])
    _check(model, x, _flat, drops=[first, second])


def test_dropped_rows_holding_inf_and_nan_add_nothing():
    """The dropped rows are selected out of the stacks: an inf or NaN in them (a padding row's log of 0) does not
    reach the sums, where a factor of 0 would keep it (0 * inf is NaN)."""
    torch.manual_seed(3)
    model = DeepNarrow().double()
    x = torch.randn(4, 5, dtype=torch.float64)
    x[3] = float("inf")
    params = [p for p in model.parameters() if p.requires_grad]
    sink = _record(model, x)
    drop = torch.tensor([False, False, False, True])
    sink.drop_samples(params, drop)
    c = torch.tensor([0.5, 1.0, 0.25, 0.0], dtype=torch.float64)
    sums = sink.clipped_sums(params, {p: c for p in params})
    expected = _expected(model, x[:3])
    for p in params:
        torch.testing.assert_close(sums[p], torch.einsum("n,n...->...", c[:3], expected[p]), rtol=1e-10, atol=1e-12)


def test_a_layer_used_twice_and_two_backward_passes():
    torch.manual_seed(3)
    _check(DeepNarrow(twice=True).double(), torch.randn(4, 5, dtype=torch.float64), _flat)
    _check(DeepNarrow().double(), torch.randn(4, 5, dtype=torch.float64), _flat, passes=2)


def test_a_frozen_layer_norm_weight_among_trainable_ones():
    torch.manual_seed(4)
    _check(DeepNarrow(blocks=4, frozen_norm_weight=True).double(), torch.randn(4, 5, dtype=torch.float64), _flat)


def test_layer_norms_on_sequences():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Flatten(),
                          nn.Linear(12, 3)).double()
    with torch.no_grad():
        for norm in (model[1], model[3]):
            norm.weight.uniform_(0.5, 1.5)
    _check(model, torch.randn(5, 3, 4, dtype=torch.float64), _flat)


def test_a_dp_step_with_lanes_equals_the_step_without():
    """The whole step (make_private's optimizer, flat clipping that clips some samples and not others)."""
    torch.manual_seed(6)
    model = DeepNarrow(blocks=4).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))

    def step(m):
        sink = BookkeepingSink()
        dp = fxdp.compile_for_dp(m, example_inputs=x, sink=sink)
        opt = fxdp.optim.DPOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), noise_multiplier=0.0,
                                     max_grad_norm=1.85, expected_batch_size=8, sink=sink)
        torch.nn.functional.cross_entropy(dp(x), y).backward()
        norms = torch.stack(list(sink.squared_norms(list(m.parameters())).values())).sum(0).sqrt()
        opt.step()
        return norms

    laned, alone = copy.deepcopy(model), copy.deepcopy(model)
    norms = step(laned)
    assert (norms > 1.85).any() and (norms < 1.85).any()  # some samples clipped, some not
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lanes, "SMALL", -1)
        step(alone)
    for a, b in zip(laned.parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_full_lanes_make_way_for_new_ones(monkeypatch):
    """A lane takes members until their tensors hold LANE_VALUES elements (bounding its stacks' memory): here two
    layers' worth, so the model's Linear weights spread over several lanes, each right."""
    torch.manual_seed(7)
    model, x = DeepNarrow(blocks=5).double(), torch.randn(4, 5, dtype=torch.float64)
    monkeypatch.setattr(lanes, "LANE_VALUES", 2 * 2 * 4 * 5)  # two Linear(5, 5) layers' A and G at batch 4
    sink = _record(model, x)
    outer = {id(u.lane) for s in sink._segments.values() for u in s.uses if type(u).__name__ == "LaneLinearWeight"}
    assert len(outer) == 4  # the 5 blocks 2 per lane (3 lanes), the head, of another shape, in a 4th
    _check(model, x, _flat)
