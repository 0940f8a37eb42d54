"""The per-sample gradient checker: right engines pass, wrong rules and moved batch dimensions fail,
and the diagnostics say which parameter and which samples."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxdp.grad_sample  # noqa: F401  (registers the built-in rules)
from fxdp.checker import (
    ParameterCheck,
    check_per_sample_gradients_are_correct,
    per_sample_gradient_diagnostics,
)
from fxdp.diagnostics import BatchMixingError
from fxdp.grad_sample.registry import _GRAD_SAMPLERS, register_grad_sampler


def x_of(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=dtype)


def mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(dtype)


class Gain(nn.Module):
    """A custom layer: elementwise gain, so each sample's gradient is ``g_i * x_i``."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.w


def gain_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Gain(4)).double()


@pytest.fixture
def gain_rule():
    """Register a rule for Gain that perturbs the true gradient with the function the test sets."""
    state = {"perturb": lambda gs: gs}

    @register_grad_sampler(Gain)
    def gain_grad_sample(module, activations, backprops):
        return {module.w: state["perturb"](backprops * activations[0])}

    yield state
    del _GRAD_SAMPLERS[Gain]


@pytest.mark.parametrize("mode", ["fx", "hooks", "ew", "functorch"])
def test_correct_engines_pass(mode):
    assert check_per_sample_gradients_are_correct(x_of(5, 4), mlp(), grad_sample_mode=mode)


def test_the_default_mode_is_the_compiler():
    # a parameter used by a parent module: the compiler handles it, the hooks engine does not
    torch.manual_seed(0)
    model, x = WeightUsedByParent().double(), x_of(3, 4)
    assert check_per_sample_gradients_are_correct(x, model)
    assert not check_per_sample_gradients_are_correct(x, model, grad_sample_mode="hooks")


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_float32_cnn_passes_with_the_default_tolerances(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    x = torch.randn(4, 2, 6, 6)
    assert check_per_sample_gradients_are_correct(x, model, grad_sample_mode=mode)


def test_a_correct_custom_rule_passes(gain_rule):
    assert check_per_sample_gradients_are_correct(x_of(5, 4), gain_model(), grad_sample_mode="hooks")


def test_a_wrong_rule_fails_and_the_diagnostics_name_the_samples(gain_rule):
    mode = "hooks"
    def wrong_for_samples_1_and_3(gs):
        gs = gs.clone()
        gs[1] += 1.0
        gs[3] *= -1.0
        return gs

    gain_rule["perturb"] = wrong_for_samples_1_and_3
    model, x = gain_model(), x_of(5, 4)
    assert not check_per_sample_gradients_are_correct(x, model, grad_sample_mode=mode)
    records = per_sample_gradient_diagnostics(x, model, grad_sample_mode=mode)
    assert [(r.name, r.reduction) for r in records] == [
        (name, red) for red in ("mean", "sum") for name in ("0.weight", "0.bias", "1.w")
    ]
    failures = records.failures
    assert [(r.name, r.reduction) for r in failures] == [("1.w", "mean"), ("1.w", "sum")]
    for r in failures:
        assert r.mismatched_samples == [1, 3]
        assert r.grad_sample_shape == r.expected_shape == (5, 4)
        assert not r.missing_grad_sample
        assert r.max_abs_diff >= 1.0
        assert r.problem == "samples 1, 3 differ from their batch-of-one gradient"
    assert all(r.ok and r.max_abs_diff < 1e-12 for r in records if r.name != "1.w")
    table = str(records)
    assert "samples that differ" in table and "FAIL" in table
    assert "1.w" in table and "1, 3" in table
    assert str(failures[0]).startswith("1.w [mean]: samples 1, 3 differ from their batch-of-one gradient")


@pytest.mark.parametrize("atol, expected", [(1.001e-3, True), (0.999e-3, False)])
def test_atol_is_an_absolute_bound_per_element(gain_rule, atol, expected):
    gain_rule["perturb"] = lambda gs: gs + 1e-3
    assert check_per_sample_gradients_are_correct(
        x_of(3, 4), gain_model(), atol=atol, rtol=0.0, grad_sample_mode="hooks"
    ) is expected


@pytest.mark.parametrize("rtol, expected", [(1.001e-3, True), (0.999e-3, False)])
def test_rtol_is_relative_to_the_batch_of_one_gradient(gain_rule, rtol, expected):
    gain_rule["perturb"] = lambda gs: gs * (1 + 1e-3)
    records = per_sample_gradient_diagnostics(
        x_of(3, 4), gain_model(), atol=0.0, rtol=rtol, grad_sample_mode="hooks"
    )
    assert records.ok is expected
    w_records = [r for r in records if r.name == "1.w"]
    assert all(math.isclose(r.max_rel_diff, 1e-3, rel_tol=1e-6) for r in w_records)


class MovesTheBatch(nn.Module):
    """Runs its Linear time-major although the model is batch first: hooks cannot see it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # (N, T, 4)
        return self.fc(x.transpose(0, 1)).transpose(0, 1)


def test_a_moved_batch_dimension_is_caught_with_hooks_and_handled_by_the_compiler():
    torch.manual_seed(0)
    records = per_sample_gradient_diagnostics(x_of(5, 2, 4), MovesTheBatch().double(), grad_sample_mode="hooks")
    assert not records.ok
    # the hooks engine checks each layer's input and refuses before handing out a gradient
    assert "layer 'fc' (Linear) does not see the batch where the hooks engine assumes it" in records.engine_error
    assert records.engine_findings[0].node == "fc"
    assert records.engine_findings[0].message == ("input #0 has shape (2, 5, 4), but the batch of 5 samples is "
                                                  "assumed in dimension 0")
    # the compiled graph knows where the batch went
    assert check_per_sample_gradients_are_correct(x_of(5, 2, 4), MovesTheBatch().double(), grad_sample_mode="fx")


class WeightUsedByParent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return x @ self.fc.weight.t() + self.fc.bias  # both used: fx now keeps it in the graph


def test_a_parameter_no_hook_sees_is_reported_missing():
    torch.manual_seed(0)
    records = per_sample_gradient_diagnostics(x_of(3, 4), WeightUsedByParent().double(), grad_sample_mode="hooks")
    weight = [r for r in records if r.name == "fc.weight"]
    assert len(weight) == 2 and all(r.missing_grad_sample and not r.ok for r in weight)
    assert weight[0].problem == "no grad_sample was set"
    assert "missing" in str(records)


@pytest.mark.parametrize("mode", ["fx", "functorch"])
def test_the_compiler_and_the_functorch_engine_handle_it(mode):
    torch.manual_seed(0)
    assert check_per_sample_gradients_are_correct(x_of(3, 4), WeightUsedByParent().double(), grad_sample_mode=mode)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, x, y):
        return torch.tanh(self.a(x)) * self.b(y)


@pytest.mark.parametrize("mode", ["fx", "hooks", "functorch"])
def test_several_inputs(mode):
    torch.manual_seed(0)
    assert check_per_sample_gradients_are_correct((x_of(4, 4), x_of(4, 2)), TwoInputs().double(), grad_sample_mode=mode)


class TimeMajor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):  # (T, N, 4)
        h = torch.tanh(self.fc1(x))
        return self.fc2(torch.tanh(h + h.mean(0, keepdim=True)))  # mixes time steps, not samples


@pytest.mark.parametrize("mode", ["fx", "hooks", "functorch"])
def test_batch_second(mode):
    torch.manual_seed(0)
    x = x_of(2, 5, 4)
    assert check_per_sample_gradients_are_correct(x, TimeMajor().double(), batch_first=False, grad_sample_mode=mode)
    # read batch first, the T = 2 time steps would be the "samples", and the model mixes them
    if mode == "fx":  # the compiler sees the mixing before running anything
        with pytest.raises(BatchMixingError, match="The model mixes samples across the batch dimension"):
            check_per_sample_gradients_are_correct(x, TimeMajor().double(), batch_first=True, grad_sample_mode=mode)
    else:
        assert not check_per_sample_gradients_are_correct(x, TimeMajor().double(), batch_first=True, grad_sample_mode=mode)


def test_the_checked_module_is_left_untouched():
    model = mlp()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert check_per_sample_gradients_are_correct(x_of(3, 4), model, grad_sample_mode="hooks")
    for name, p in model.named_parameters():
        assert p.grad is None and getattr(p, "grad_sample", None) is None
        assert torch.equal(p, before[name])
    assert not model[0]._forward_hooks


def test_empty_batch_is_an_error():
    with pytest.raises(ValueError) as info:
        check_per_sample_gradients_are_correct(torch.zeros(0, 4, dtype=torch.float64), mlp(), grad_sample_mode="hooks")
    assert str(info.value) == (
        "fxdp: the batch is empty (size 0 in dimension 0); per-sample gradients need at least one sample to check."
    )


def test_no_trainable_parameters_is_an_error():
    model = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match=r"Sequential has no trainable parameters \(none with requires_grad=True\)"):
        check_per_sample_gradients_are_correct(x_of(3, 4), model, grad_sample_mode="hooks")


def test_no_op_mode_cannot_be_checked():
    with pytest.raises(ValueError, match="grad_sample_mode='no_op' computes no per-sample gradients"):
        check_per_sample_gradients_are_correct(x_of(3, 4), mlp(), grad_sample_mode="no_op")


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown grad_sample_mode 'magic'; valid modes are 'fx', 'hooks'"):
        check_per_sample_gradients_are_correct(x_of(3, 4), mlp(), grad_sample_mode="magic")


def test_records_are_plain_data():
    record = ParameterCheck("w", "sum", None, (3, 2))
    assert record.missing_grad_sample and not record.ok
    assert str(record).startswith("w [sum]: no grad_sample was set")


class CentersTheBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.tanh(h - h.mean(0)))  # every sample's output reads the others


def test_mixing_samples_is_caught_even_when_each_row_is_right_for_its_sample_alone():
    torch.manual_seed(0)
    model, x = CentersTheBatch().double(), x_of(4, 4)
    # functorch re-runs each sample alone, so its rows match the batches of one by construction
    records = per_sample_gradient_diagnostics(x, model, grad_sample_mode="functorch")
    assert not records.ok
    fc1_weight = [r for r in records if r.name == "fc1.weight"]
    assert all(r.mismatched_samples == [] and r.sums_to_batch_grad is False for r in fc1_weight)
    assert fc1_weight[0].problem.startswith("the per-sample gradients do not add up to the batch gradient p.grad")
    assert fc1_weight[0].problem.endswith("the model mixes samples across the batch dimension")
    assert "NO" in str(records)
    # the hooks engine's rows are the batch's, so they differ from the batches of one
    assert not check_per_sample_gradients_are_correct(x, model, grad_sample_mode="hooks")
    # and the compiler refuses the model outright
    with pytest.raises(BatchMixingError, match="The model mixes samples across the batch dimension"):
        check_per_sample_gradients_are_correct(x, model, grad_sample_mode="fx")


def test_engines_without_p_grad_skip_the_sum_check():
    records = per_sample_gradient_diagnostics(x_of(3, 4), mlp(), grad_sample_mode="ew")
    assert records.ok and all(r.sums_to_batch_grad is None for r in records)
    hooks_records = per_sample_gradient_diagnostics(x_of(3, 4), mlp(), grad_sample_mode="hooks")
    assert all(r.sums_to_batch_grad is True for r in hooks_records)
