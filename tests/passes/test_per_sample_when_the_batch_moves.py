"""Where a layer receives its input with the batch moved (time-major, merged with
time, permuted, stacked or concatenated views), the compiled graph still gives each sample its own
gradient. Every batch-moving model of the catalogue is checked against batches of one."""

import pytest
import torch
from torch import nn

import fxdp
from tests.support.batch_models import by_category
from tests.support.per_sample_reference import assert_grad_samples_match

MOVES = by_category("moves")


def _as_tuple(inputs):
    return inputs if isinstance(inputs, tuple) else (inputs,)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("entry", MOVES, ids=lambda e: e.name)
def test_batch_moving_model_has_correct_per_sample_gradients(entry, reduction):
    model, inputs = entry.build()
    model = model.double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in _as_tuple(inputs))
    compiled = assert_grad_samples_match(model, inputs, loss_reduction=reduction, batch_dim=entry.batch_dim,
                                         atol=1e-9, rtol=1e-7)
    rep = fxdp.report(compiled)
    assert rep.mode == "fx", rep.fallback_reason
    assert any(f.kind is fxdp.Kind.MOVES_BATCH for f in rep.findings)


def test_the_catalogue_has_batch_moving_models_to_check():
    assert len(MOVES) >= 10


class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.w * 2


def test_a_registered_rule_is_used_by_the_compiled_graph(registered_rule):
    model = nn.Sequential(Doubler(), nn.Linear(3, 2))
    x = torch.randn(4, 3)
    compiled = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction="sum")
    assert fxdp.report(compiled).mode == "fx"
    sites = [v for v in vars(compiled).values() if isinstance(v, fxdp.runtime.PerSampleSite)]
    assert [site.rule for site in sites] == ["Doubler", "Linear"]
    compiled(x).sum().backward()
    assert registered_rule == ["called"]
    torch.testing.assert_close(model[0].w.grad_sample, registered_rule_expected(model, x))


def registered_rule_expected(model, x):
    out_grad = model[1].weight.sum(0)  # d(sum of outputs)/d(hidden), the same for every sample
    return x * 2 * out_grad


@pytest.fixture
def registered_rule():
    calls = []

    @fxdp.register_grad_sampler(Doubler)
    def doubler_rule(module, activations, backprops):
        calls.append("called")
        return {module.w: activations[0] * 2 * backprops}

    return calls
