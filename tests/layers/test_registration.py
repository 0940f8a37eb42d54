"""``fxdp.register_layer``: a new layer is one call. A toy layer registered by it gets its per-sample rule, its
book-keeping and its batch rule (each registry finds them, ``fxdp layers`` lists it with all three), and each of
them is the one fxdp uses: per-sample gradients in the hooks and graph engines, and the book-keeping sink's norms
and private step, equal batches of one in float64. A call that names nothing valid registers nothing."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import fxdp
from fxdp.grad_sample.registry import GRAD_SAMPLERS, find_grad_sampler
from fxdp.passes.batch_rules import find_batch_rule, keeps_layout, restore_batch_rules, snapshot_batch_rules
from fxdp.passes.batch_rules.core import LAYER_RULES
from fxdp.sinks.bookkeeping import BookkeepingSink, LayerBookkeeping, LayerPlan, Summed, find_bookkeeping
from fxdp.sinks.bookkeeping.registry import BOOKKEEPING
from fxdp.supported import layers_table, supported_layers
from tests.support.per_sample_reference import assert_grad_samples_match, expected_grad_samples
from tests.support.private_steps import clipped_reference, noise_free_private_step

pytestmark = pytest.mark.usefixtures("float64")


class FeatureScale(nn.Module):
    """``x * weight + bias`` over the last dimension (``weight``, ``bias`` of shape ``(d,)``), any leading ones."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight + self.bias


CALLS = {"grad_sampler": 0, "uses": 0, "batch_rule": 0}


def feature_scale_grad_sample(module, activations, backprops):
    CALLS["grad_sampler"] += 1
    a, g = activations[0], backprops
    n, d = g.shape[0], g.shape[-1]
    out = {}
    if module.weight.requires_grad:
        out[module.weight] = (a * g).reshape(n, -1, d).sum(1)
    if module.bias.requires_grad:
        out[module.bias] = g.reshape(n, -1, d).sum(1)
    return out


class FeatureScaleBookkeeping(LayerBookkeeping):
    rule = feature_scale_grad_sample

    def plan(self, module, a, g, prefer):
        return LayerPlan(type(module).__name__, "summed", "feature scale: A * G and G summed over the positions")

    def uses(self, captured, sink):
        CALLS["uses"] += 1
        a, g, n, d = captured.a, captured.g, captured.g.shape[0], captured.g.shape[-1]
        sums = {captured.module.weight: (a.to(g.dtype) * g).reshape(n, -1, d).sum(1), captured.module.bias:
                g.reshape(n, -1, d).sum(1)}
        return {p: Summed(sums[p], captured.scale) for p in captured.params}


def feature_scale_batch_rule(call):
    CALLS["batch_rule"] += 1
    return keeps_layout(call)  # samples stay apart, the batch stays where the input has it


@pytest.fixture
def registered():
    """FeatureScale registered by the one call; every registry put back afterwards."""
    saved = GRAD_SAMPLERS.snapshot(), BOOKKEEPING.snapshot(), snapshot_batch_rules()
    fxdp.register_layer(FeatureScale, grad_sampler=feature_scale_grad_sample, bookkeeping=FeatureScaleBookkeeping,
                        batch_rule=feature_scale_batch_rule)
    CALLS.update(grad_sampler=0, uses=0, batch_rule=0)
    yield
    GRAD_SAMPLERS.restore(saved[0])
    BOOKKEEPING.restore(saved[1])
    restore_batch_rules(saved[2])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), FeatureScale(5), nn.Tanh(), nn.Linear(5, 3))


ROW = f"| `{FeatureScale.__module__}.{FeatureScale.__qualname__}` | yes | yes | yes |"


def test_one_call_gives_the_layer_all_three_and_a_row_in_fxdp_layers(registered):
    layer = FeatureScale(3)
    assert find_grad_sampler(layer) is feature_scale_grad_sample
    assert isinstance(find_bookkeeping(layer), FeatureScaleBookkeeping)
    assert find_batch_rule(layer) is feature_scale_batch_rule
    row = {s.layer: s for s in supported_layers()}[f"{FeatureScale.__module__}.{FeatureScale.__qualname__}"]
    assert row.per_sample_rule and row.bookkeeping_plan and row.batch_rule
    assert ROW in layers_table()


@pytest.mark.parametrize("mode", ["hooks", "fx"])
@pytest.mark.parametrize("shape", [(8, 6), (8, 4, 6)], ids=["vectors", "sequences"])
def test_per_sample_gradients_equal_batches_of_one(registered, mode, shape):
    x = torch.randn(*shape)
    assert_grad_samples_match(_model(), x, mode=mode, atol=1e-10, rtol=1e-9)
    assert CALLS["grad_sampler"] >= 1  # the registered rule, not the generic one
    if mode == "fx":
        assert CALLS["batch_rule"] >= 1  # the graph engine asked the registered batch rule where the batch goes


CLIP = 0.05  # below every sample's norm: each one is clipped


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_the_book_keeping_norms_and_private_step_equal_batches_of_one(registered, loss_reduction):
    model, x = _model(), torch.randn(8, 4, 6)
    expected, R = expected_grad_samples(model, x)
    sink = BookkeepingSink()
    got = noise_free_private_step(copy.deepcopy(model), x, R, sink, loss_reduction, CLIP)

    assert CALLS["uses"] >= 1 and CALLS["grad_sampler"] == 0  # the registration's sums, not the rule's tensors
    assert any(plan.method == "summed" and "feature scale" in plan.reason for plan in sink.plans.values())
    want = clipped_reference(expected, loss_reduction, len(x), CLIP)
    for k in expected:
        torch.testing.assert_close(got["norms"][k], expected[k].flatten(1).pow(2).sum(1), msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(got["grads"][k], want[k], msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("kwargs, says", [
    (dict(layers=FeatureScale), "none of grad_sampler=, bookkeeping=, batch_rule= given"),
    (dict(layers=int, grad_sampler=feature_scale_grad_sample), "<class 'int'> is not an nn.Module subclass"),
    (dict(grad_sampler=feature_scale_grad_sample), "no layer class given"),
    (dict(layers=FeatureScale, grad_sampler=feature_scale_grad_sample, bookkeeping=object()),
     "is neither a LayerBookkeeping subclass nor an instance of one"),
    (dict(layers=FeatureScale, batch_rule=3), "batch_rule=3 is not callable"),
    (dict(by_path="FeatureScale", grad_sampler=feature_scale_grad_sample), "is not a dotted class path"),
])
def test_a_call_with_a_wrong_argument_says_which_and_registers_nothing(kwargs, says):
    with pytest.raises(TypeError, match="fxdp.register_layer: .*Nothing was registered") as caught:
        fxdp.register_layer(**kwargs)
    assert says in str(caught.value)
    assert find_grad_sampler(FeatureScale) is None and BOOKKEEPING.find(FeatureScale) is None
    assert LAYER_RULES.find(FeatureScale) is None and "FeatureScale" not in str(GRAD_SAMPLERS.by_path)


def test_a_class_by_path_gets_its_registrations_once_its_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "fxdp_toy_library.py").write_text(
        "from torch import nn\n\nclass Toy(nn.Module):\n    def forward(self, x):\n        return x\n")
    saved = GRAD_SAMPLERS.snapshot(), BOOKKEEPING.snapshot(), snapshot_batch_rules()
    fxdp.register_layer(by_path="fxdp_toy_library.Toy", grad_sampler=feature_scale_grad_sample,
                        bookkeeping=FeatureScaleBookkeeping, batch_rule=feature_scale_batch_rule)
    try:
        assert "`fxdp_toy_library.Toy` | yes | yes | yes |" in layers_table()  # listed before it is imported
        monkeypatch.syspath_prepend(str(tmp_path))
        import fxdp_toy_library

        toy = fxdp_toy_library.Toy()
        assert find_grad_sampler(toy) is feature_scale_grad_sample and find_batch_rule(toy) is feature_scale_batch_rule
        assert isinstance(BOOKKEEPING.find(toy), FeatureScaleBookkeeping)
    finally:
        sys.modules.pop("fxdp_toy_library", None)
        for registry in (GRAD_SAMPLERS, BOOKKEEPING, LAYER_RULES):
            registry.by_path.pop("fxdp_toy_library.Toy", None)
        GRAD_SAMPLERS.restore(saved[0])
        BOOKKEEPING.restore(saved[1])
        restore_batch_rules(saved[2])
