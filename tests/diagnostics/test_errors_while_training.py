"""Errors raised while a model trains (a wrong per-sample rule, a hooked layer's second output, a failing
generic rule, a non-finite per-sample gradient, a step without zero_grad) are fxdp errors, so ``except
fxdp.errors.FxdpError`` catches them, and each names the layer, node or parameter at fault. What each error class
is: test_error_hierarchy.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.optim import DPOptimizer
from fxdp.sinks.contract import sink_of


class WrongShapeScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.s


@fxdp.register_grad_sampler(WrongShapeScale)
def _wrong_shape_rule(module, activations, backprops):
    return {module.s: (activations[0] * backprops).sum(1)}  # (N,): the parameter's dimension summed away


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_a_rule_returning_the_wrong_shape_names_the_layer(mode):
    model = nn.Sequential(nn.Linear(3, 4), WrongShapeScale())
    x = torch.randn(5, 3)
    dp = fxdp.compile_for_dp(model, example_inputs=x, grad_sample_mode=mode)
    with pytest.raises(fxdp.errors.FxdpError) as info:
        dp(x).sum().backward()
    assert isinstance(info.value, fxdp.errors.PerSampleError)
    message = str(info.value)
    assert "a per-sample rule returned shape (5,) for a parameter of WrongShapeScale of shape (4,)" in message
    assert "Check the per-sample rule for WrongShapeScale." in message


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.w, x + self.w


def test_a_hooked_layer_whose_second_output_reaches_the_loss_is_named():
    dp = fxdp.GradSampleModule(nn.Sequential(TwoOutputs()), loss_reduction="sum", verify=False)
    first, second = dp(torch.randn(3, 4))
    with pytest.raises(fxdp.errors.FxdpError) as info:
        (first.sum() + second.sum()).backward()
    assert "the loss depends on output #1 of module '0' (TwoOutputs)" in str(info.value)


class NoisyScale(nn.Module):
    """No registered rule, and random inside: the generic rule cannot re-run a sample alone."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return F.dropout(x * self.w, 0.5, training=True)


def test_the_generic_rule_failing_on_a_random_op_names_the_module():
    dp = fxdp.GradSampleModule(nn.Sequential(NoisyScale()), loss_reduction="sum", verify=False)
    with pytest.raises(fxdp.errors.FxdpError) as info:
        dp(torch.randn(3, 4)).sum().backward()
    assert isinstance(info.value, fxdp.errors.PerSampleError)
    message = str(info.value)
    assert message.startswith("fxdp: the generic per-sample rule (torch.func) failed on NoisyScale (")
    assert "random ops (dropout)" in message and "fxdp.register_grad_sampler" in message
    assert info.value.__cause__ is not None


def test_the_dp_optimizer_names_a_parameter_with_a_non_finite_per_sample_gradient_and_drops_the_sample():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(6, 3)
    x[2, 1] = float("inf")
    dp = fxdp.compile_for_dp(model, example_inputs=torch.randn(6, 3))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=6, sink=sink_of(dp),
                      param_names={p: n for n, p in model.named_parameters()})
    opt.zero_grad()
    dp(x).sum().backward()
    with pytest.warns(fxdp.errors.NonFiniteSampleWarning) as info:
        opt.step()
    assert "the per-sample gradient of parameter '0.weight' is not finite" in str(info[0].message)
    assert "(first: sample 2)" in str(info[0].message)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_stepping_twice_without_zero_grad_is_an_fxdp_error():
    model = nn.Linear(3, 2)
    dp = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 3))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=4, sink=sink_of(dp))
    opt.zero_grad()
    dp(torch.randn(4, 3)).sum().backward()
    opt.step()
    dp(torch.randn(4, 3)).sum().backward()
    with pytest.raises(fxdp.errors.PerSampleError, match=r"DPOptimizer.step\(\) was called again without optimizer.zero_grad"):
        opt.step()


def test_the_hooks_engine_refuses_tensor_keyword_arguments_with_an_fxdp_error():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x, *, shift):
            return x * self.scale + shift

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Scaled()

        def forward(self, x):
            return self.layer(x, shift=torch.zeros(3))

    wrapped = fxdp.GradSampleModule(Net())
    with pytest.raises(fxdp.errors.UnsupportedInputError, match="'layer'.*tensor keyword") as info:
        wrapped(torch.randn(4, 3))
    assert isinstance(info.value, TypeError) and isinstance(info.value, fxdp.errors.FxdpError)
