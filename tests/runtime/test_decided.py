"""A DP-aware layer call keeps what it decided for the site's next calls (fxdp/runtime/decided.py) only while all it
was decided from holds: the per-sample gradients of later calls are still each sample's own (batches of one, float64),
and a rule registered, a parameter frozen or a class's forward replaced after a call is taken up at the next one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdp
from fxdp import registry
from fxdp.grad_sample.linear import linear_grad_sample
from fxdp.grad_sample.registry import GRAD_SAMPLERS
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import GradSampleSink, sink_of
from tests.support.per_sample_reference import batch_loss, expected_grad_samples


class Lin(nn.Linear):
    """A Linear subclass that keeps its forward: the Linear rule serves it until one is registered for it."""


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Lin(4, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 3)).double()


def _sites(dp):
    return [site for site in dp.fxdp_batch_guard.sites]


def _step_rows(model, dp, x):
    """``{p: (N, *p.shape)}`` of one forward and backward of the reference loss, and what batches of one give."""
    sink = sink_of(dp)
    expected, R = expected_grad_samples(model, x)
    batch_loss(dp(x), R, "mean").backward()
    params = [p for p in model.parameters() if p.requires_grad]
    got = sink.grad_samples(params) if isinstance(sink, BookkeepingSink) else {
        p: p.grad_sample for p in params if getattr(p, "grad_sample", None) is not None}
    sink.clear(params)
    for p in model.parameters():
        p.grad, p.grad_sample = None, None
    return got, {p: expected[k] for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("make_sink", [BookkeepingSink, GradSampleSink])
def test_later_calls_through_kept_decisions_give_each_samples_gradient(make_sink):
    model, x = _model(), torch.randn(6, 4, dtype=torch.float64)
    dp = fxdp.compile_for_dp(model, example_inputs=x, sink=make_sink())
    for step in range(3):
        got, expected = _step_rows(model, dp, x * (step + 1))
        assert set(got) == set(expected)
        for p, g in expected.items():
            torch.testing.assert_close(got[p], g, rtol=1e-10, atol=1e-12)
        if step == 0:  # the layers' calls kept their decisions for the next ones
            assert sum(site.decided is not None for site in _sites(dp)) == 3


@pytest.mark.parametrize("make_sink", [BookkeepingSink, GradSampleSink])
def test_a_rule_registered_after_a_call_is_used_at_the_next(make_sink):
    model, x = _model(), torch.randn(5, 4, dtype=torch.float64)
    dp = fxdp.compile_for_dp(model, example_inputs=x, sink=make_sink())
    _step_rows(model, dp, x)
    calls = []

    def counted(module, activations, backprops):
        calls.append(module)
        return linear_grad_sample(module, activations, backprops)

    saved = GRAD_SAMPLERS.snapshot()
    try:
        fxdp.register_grad_sampler(Lin)(counted)
        got, expected = _step_rows(model, dp, x)
    finally:
        GRAD_SAMPLERS.restore(saved)
    assert calls == [model[0]]  # the new rule, not the one the first call decided on
    for p, g in expected.items():
        torch.testing.assert_close(got[p], g, rtol=1e-10, atol=1e-12)
    calls.clear()
    _step_rows(model, dp, x)  # the registration undone: the Linear rule (book-keeping's own form) again
    assert calls == []


def test_a_parameter_frozen_between_calls_has_no_rows_and_the_others_theirs():
    model, x = _model(), torch.randn(5, 4, dtype=torch.float64)
    dp = fxdp.compile_for_dp(model, example_inputs=x, sink=BookkeepingSink())
    _step_rows(model, dp, x)
    model[1].weight.requires_grad_(False)
    got, expected = _step_rows(model, dp, x)
    assert model[1].weight not in got and model[1].bias in got
    for p, g in expected.items():
        torch.testing.assert_close(got[p], g, rtol=1e-10, atol=1e-12)


def test_the_lookup_stamp_moves_with_registrations_and_forward():
    layer = Lin(2, 2)
    before = registry.lookup_stamp(layer)
    assert registry.lookup_stamp(layer) == before
    saved = GRAD_SAMPLERS.snapshot()
    try:
        fxdp.register_grad_sampler(Lin)(linear_grad_sample)
        assert registry.lookup_stamp(layer) != before
    finally:
        GRAD_SAMPLERS.restore(saved)
    after = registry.lookup_stamp(layer)
    GRAD_SAMPLERS.register_by_path("not_imported_anywhere.Layer")(linear_grad_sample)
    try:
        assert registry.lookup_stamp(layer) != after
    finally:
        GRAD_SAMPLERS.by_path.pop("not_imported_anywhere.Layer")
    layer.forward = lambda x: x  # the instance's own forward: nothing about it is remembered
    assert registry.lookup_stamp(layer) is None
    assert registry.lookup_stamp(nn.Linear(2, 2)) != registry.lookup_stamp(Lin(2, 2))
