"""One error hierarchy: ``except fxdp.errors.NotPrivateError`` catches every "this model cannot be trained
privately", whatever the engine and whether ``strict`` is on; everything fxdp raises on purpose is an
``fxdp.errors.FxdpError``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdp
from fxdp.validators import ModuleValidator


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


class Mixing(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0)


X = torch.randn(2, 3, 6, 6)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", ["fx", "hooks", "functorch"])
def test_batch_norm_is_a_not_private_error_whatever_the_engine_and_strict(mode, strict):
    with pytest.raises(fxdp.errors.NotPrivateError) as info:
        fxdp.compile_for_dp(WithBatchNorm(), X, strict=strict, grad_sample_mode=mode)
    assert isinstance(info.value, fxdp.errors.FxdpError)
    assert [(f.node, f.op) for f in info.value.findings if f.pass_name == "validate"] == [("bn", "nn.BatchNorm2d")]
    if strict:  # what strict validation raises, now inside the one hierarchy
        assert isinstance(info.value, fxdp.errors.UnsupportedModuleError)


def test_strict_module_validation_is_a_not_private_error():
    with pytest.raises(fxdp.errors.NotPrivateError) as info:
        ModuleValidator.validate(WithBatchNorm(), strict=True)
    assert isinstance(info.value, fxdp.errors.UnsupportedModuleError)
    assert [f.node for f in info.value.findings] == ["bn"]


def test_mixing_samples_is_a_not_private_error():
    with pytest.raises(fxdp.errors.NotPrivateError) as info:
        fxdp.compile_for_dp(Mixing(), torch.randn(3, 4))
    assert type(info.value) is fxdp.errors.BatchMixingError


def test_errors_are_public_as_fxdp_errors_not_top_level_names():
    for name in ("FxdpError", "NotPrivateError", "BatchMixingError", "UnsupportedModuleError", "PassError",
                 "BatchDimAnalysisError", "MissingBatchRuleError"):
        assert name in fxdp.errors.__all__ and issubclass(getattr(fxdp.errors, name), fxdp.errors.FxdpError)
        assert name not in fxdp.__all__
    from fxdp.errors import ModuleFixWarning, SelfCheckError  # noqa: F401  (both import forms work)
    from fxdp.passes.batch_dim import BatchDimAnalysisError

    assert BatchDimAnalysisError is fxdp.errors.BatchDimAnalysisError


def test_analysis_errors_are_batch_dim_analysis_errors():
    with pytest.raises(fxdp.errors.BatchDimAnalysisError, match="contain no tensor"):
        fxdp.compile_for_dp(nn.Linear(3, 2), example_inputs=(3,))


def test_per_sample_error_is_an_fxdp_error_and_a_runtime_error():
    assert issubclass(fxdp.errors.PerSampleError, fxdp.errors.FxdpError)
    assert issubclass(fxdp.errors.PerSampleError, RuntimeError)  # code catching RuntimeError keeps working
    assert fxdp.diagnostics.PerSampleError is fxdp.errors.PerSampleError
    assert "PerSampleError" in fxdp.errors.__all__ and "PerSampleError" in fxdp.diagnostics.__all__
