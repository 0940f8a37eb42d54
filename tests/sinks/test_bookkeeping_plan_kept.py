"""The book-keeping sink keeps a layer's plan (and whether its registration covers every trainable parameter) for
the layer's next call (``BookkeepingSink._plan``) only while the registration, the shapes, the method and the
parameters are the same: rows after a parameter is replaced or a layer's registration stops covering one are each
sample's own (batches of one, float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdp
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.bookkeeping.linear import LinearBookkeeping
from fxdp.sinks.bookkeeping.uses import Materialised
from fxdp.sinks.contract import sink_of
from tests.support.per_sample_reference import batch_loss, expected_grad_samples


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 3)).double()


def _step_rows(model, dp, x):
    sink = sink_of(dp)
    expected, R = expected_grad_samples(model, x)
    batch_loss(dp(x), R, "mean").backward()
    params = [p for p in model.parameters() if p.requires_grad]
    got = sink.grad_samples(params)
    sink.clear(params)
    for p in model.parameters():
        p.grad = None
    return got, {p: expected[k] for k, p in model.named_parameters() if p.requires_grad}


def _assert_rows(got, expected):
    assert set(got) == set(expected)
    for p, g in expected.items():
        torch.testing.assert_close(got[p], g, rtol=1e-10, atol=1e-12)


def test_a_kept_plan_serves_the_next_calls_and_a_replaced_parameter_is_planned_afresh():
    model, x = _model(), torch.randn(6, 4, dtype=torch.float64)
    dp = fxdp.compile_for_dp(model, example_inputs=x, sink=BookkeepingSink())
    sink = sink_of(dp)
    _assert_rows(*_step_rows(model, dp, x))
    first = sink.plans[model[0]]
    _assert_rows(*_step_rows(model, dp, 2 * x))
    assert sink.plans[model[0]] is first  # kept, not made again
    with torch.no_grad():
        model[0].weight = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    with pytest.warns(UserWarning, match="was replaced"):  # (the model is compiled again: its sink stays)
        _assert_rows(*_step_rows(model, dp, x))
    assert sink_of(dp) is sink
    assert sink._plans_kept[model[0]][3][1][0] is model[0].weight  # made afresh, with the new parameter


def test_a_registration_that_stops_covering_the_bias_has_the_layer_materialised(monkeypatch):
    model, x = _model(), torch.randn(5, 4, dtype=torch.float64)
    dp = fxdp.compile_for_dp(model, example_inputs=x, sink=BookkeepingSink())
    _assert_rows(*_step_rows(model, dp, x))
    # the Linear registration now covers the weight alone: a capture with a trainable bias is materialised whole
    monkeypatch.setattr(LinearBookkeeping, "params", lambda self, module: (module.weight,))
    sink = sink_of(dp)
    seen = {}
    real = sink._uses

    def recorded(capture):
        out = real(capture)
        seen[capture.module] = out
        return out

    monkeypatch.setattr(sink, "_uses", recorded)
    _assert_rows(*_step_rows(model, dp, x))
    assert all(isinstance(use, Materialised) for use in seen[model[0]].values())
    assert all(isinstance(use, Materialised) for use in seen[model[3]].values())
