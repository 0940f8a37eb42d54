"""Real-model pieces in the graph engine (issue #11): subclasses of layers that override ``forward``,
parametrized layers (weight_norm, spectral_norm, a user's parametrization), torchvision's blocks.

Every check compares ``p.grad_sample`` with batches of one, in the graph engine (``fx``, not the
whole-model fallback) and in the hooks engine.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import fxdp
from fxdp.grad_sample.conv import conv_grad_sample
from fxdp.grad_sample.embedding import embedding_grad_sample
from fxdp.grad_sample.linear import linear_grad_sample
from fxdp.grad_sample.registry import PARAMETRIZED, find_grad_sampler, register_grad_sampler, rule_name
from fxdp.passes.batch_rules import find_batch_rule
from fxdp.tracing import is_leaf_layer
from tests.per_sample_reference import assert_grad_samples_match, batch_loss, expected_grad_samples

N = 4


@pytest.fixture(autouse=True)
def float64():
    """Tight comparisons: every model here is built and run in float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def engine_of(compiled) -> str:
    return fxdp.report(compiled).engine


# --------------------------------------------------------------------------------------------
# Subclasses that override forward
# --------------------------------------------------------------------------------------------


class CosineLinear(nn.Linear):
    """A Linear whose rows are normalised in forward: the Linear rule would be wrong for it."""

    def forward(self, x):
        return F.linear(x, F.normalize(self.weight, dim=1), self.bias)


class ScaledConv(nn.Conv2d):
    def forward(self, x):
        return self._conv_forward(x, self.weight * 2.0, self.bias).tanh()


class PositionsFromMask(nn.Embedding):
    """Like OPT's learned positional embedding: fed the attention mask, positions by cumsum."""

    def __init__(self, num_positions: int, dim: int, offset: int = 2):
        super().__init__(num_positions + offset, dim)
        self.offset = offset

    def forward(self, attention_mask):
        positions = (torch.cumsum(attention_mask, dim=1) * attention_mask).long() - 1
        return super().forward(positions + self.offset)


class PlainLinear(nn.Linear):
    pass


class Head(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.layer(x)))


class MaskModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = PositionsFromMask(6, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, mask):
        return self.out(self.pos(mask)).sum(1)


def padded_mask(n=N, t=5):
    mask = torch.ones(n, t)
    for i in range(n):
        mask[i, : i % t] = 0  # left padding of different lengths
    return mask


def test_a_rule_serves_a_subclass_only_if_it_keeps_the_forward():
    assert find_grad_sampler(CosineLinear(3, 3)) is None and rule_name(CosineLinear) is None
    assert find_grad_sampler(ScaledConv(1, 1, 1)) is None
    assert find_grad_sampler(PositionsFromMask(3, 2)) is None
    assert find_grad_sampler(PlainLinear(3, 3)) is linear_grad_sample and rule_name(PlainLinear) == "Linear"
    assert find_grad_sampler(nn.Conv2d(1, 1, 1)) is conv_grad_sample
    assert find_grad_sampler(nn.Embedding(2, 2)) is embedding_grad_sample
    # the batch rules of layers follow the same lookup, and so does the tracer
    assert find_batch_rule(CosineLinear(3, 3)) is None
    assert find_batch_rule(PlainLinear(3, 3)) is find_batch_rule(nn.Linear(3, 3)) is not None
    assert not is_leaf_layer(CosineLinear(3, 3)) and is_leaf_layer(PlainLinear(3, 3))
    # torch's own families keep their rules (LSTM overrides RNNBase's forward)
    assert find_batch_rule(nn.LSTM(2, 2)) is find_batch_rule(nn.GRU(2, 2)) is not None
    assert find_batch_rule(nn.CrossEntropyLoss()) is not None and find_batch_rule(nn.BatchNorm2d(2)) is not None


def test_an_instance_that_replaces_forward_has_no_rule():
    layer = nn.Linear(3, 3)
    layer.forward = lambda x: F.linear(x, layer.weight.exp())
    assert find_grad_sampler(layer) is None


def test_a_rule_registered_for_subclasses_serves_those_that_override_forward():
    class Base(nn.Linear):
        pass

    class Override(Base):
        def forward(self, x):
            return super().forward(x) * 2

    @register_grad_sampler(Base, subclasses=True)
    def rule(module, activations, backprops):
        return {}

    assert find_grad_sampler(Override(2, 2)) is rule
    register_grad_sampler(Base)(rule)  # registered again without: the override is no longer served
    assert find_grad_sampler(Override(2, 2)) is None and find_grad_sampler(Base(2, 2)) is rule


def test_validators_still_see_subclasses_that_override_forward():
    class MyBatchNorm(nn.BatchNorm1d):
        def forward(self, x):
            return super().forward(x) * 2

    errors = fxdp.validators.ModuleValidator.validate(nn.Sequential(MyBatchNorm(3)), strict=False)
    assert errors, "a BatchNorm subclass keeps running statistics, whatever its forward"


@pytest.mark.parametrize("mode", ["fx", "hooks"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cosine_linear_gets_its_own_per_sample_gradients(mode, reduction):
    torch.manual_seed(0)
    model = Head(CosineLinear(5, 3))
    x = torch.randn(N, 5)
    compiled = assert_grad_samples_match(model, x, loss_reduction=reduction, mode=mode, atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == mode


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_conv_subclass_that_overrides_forward(mode):
    torch.manual_seed(1)
    model = nn.Sequential(ScaledConv(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 5 * 5, 2))
    compiled = assert_grad_samples_match(model, torch.randn(N, 2, 5, 5), mode=mode, atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == mode


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_embedding_fed_the_attention_mask(mode):
    torch.manual_seed(2)
    model = MaskModel()
    compiled = assert_grad_samples_match(model, padded_mask(), mode=mode, atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == mode


def test_a_plain_subclass_keeps_the_parent_rule_in_the_graph():
    torch.manual_seed(3)
    compiled = assert_grad_samples_match(Head(PlainLinear(5, 3)), torch.randn(N, 5), atol=1e-9, rtol=1e-7)
    text = str(fxdp.report(compiled))
    assert engine_of(compiled) == "fx" and "Linear rule" in text


def test_the_report_says_the_cosine_linear_was_traced_into():
    compiled = fxdp.compile_for_dp(Head(CosineLinear(5, 3)), example_inputs=torch.randn(N, 5))
    report = fxdp.report(compiled)
    assert report.engine == "fx"
    rewrites = [f for f in report.changes if f.pass_name == "per_sample" and f.node == "linear"]
    assert rewrites and "layer.weight" in rewrites[0].message and "generic rule" in rewrites[0].message


# --------------------------------------------------------------------------------------------
# Parametrized layers
# --------------------------------------------------------------------------------------------


class Unit(nn.Module):
    """A user parametrization: rows of unit norm."""

    def forward(self, w):
        return w / w.norm(dim=1, keepdim=True)


def weight_normed():
    return parametrizations.weight_norm(nn.Linear(5, 3))


def user_parametrized():
    layer = nn.Linear(5, 3)
    parametrize.register_parametrization(layer, "weight", Unit())
    return layer


def weight_normed_conv():
    return parametrizations.weight_norm(nn.Conv1d(5, 3, 1))


class Squeeze(nn.Module):
    def forward(self, x):
        return x.squeeze(-1)


@pytest.mark.parametrize("mode", ["fx", "hooks"])
@pytest.mark.parametrize("make", [weight_normed, user_parametrized])
def test_parametrized_linear_real_parameters_get_per_sample_gradients(mode, make):
    torch.manual_seed(4)
    model = Head(make())
    compiled = assert_grad_samples_match(model, torch.randn(N, 5), mode=mode, atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == mode


def test_parametrized_conv():
    torch.manual_seed(5)
    model = nn.Sequential(weight_normed_conv(), Squeeze(), nn.Linear(3, 2))
    compiled = assert_grad_samples_match(model, torch.randn(N, 5, 1), atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == "fx"


def test_the_report_does_not_call_a_weight_normed_layer_linear():
    compiled = fxdp.compile_for_dp(Head(weight_normed()), example_inputs=torch.randn(N, 5))
    rewrites = [f for f in fxdp.report(compiled).changes if f.pass_name == "per_sample" and f.node == "layer"]
    assert rewrites and PARAMETRIZED in rewrites[0].message and "Linear rule" not in rewrites[0].message


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_spectral_norm_in_training_uses_this_forwards_power_iteration(mode):
    """The per-sample gradient of the forward that ran: u and v updated once by it, then constants."""
    torch.manual_seed(6)
    model = Head(parametrizations.spectral_norm(nn.Linear(5, 3)))
    plain = copy.deepcopy(model)
    x = torch.randn(N, 5)
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,), grad_sample_mode=mode)
    out = compiled(x)
    plain(x)  # the same forward without fxdp: one step of power iteration
    buffers = dict(model.named_buffers())
    for name, b in plain.named_buffers():
        torch.testing.assert_close(buffers[name], b, atol=0, rtol=0)  # no extra update by fxdp
    # reference: that forward's u, v as constants (eval mode uses the buffers as they are), batches of one
    reference = copy.deepcopy(model)
    reference.layer.parametrizations.eval()
    expected, R = expected_grad_samples(reference, (x,))
    batch_loss(out, R, "mean").backward()
    for name, b in plain.named_buffers():
        torch.testing.assert_close(buffers[name], b, atol=0, rtol=0)  # the backward changed nothing
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-9, rtol=1e-7, msg=lambda m: f"{name}: {m}")
    assert engine_of(compiled) == mode
    assert {"layer.parametrizations.weight.original", "layer.bias"} <= {n for n, _ in model.named_parameters()}
