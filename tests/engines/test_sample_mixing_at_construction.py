"""Every per-sample engine refuses, when it is built, a model with a module that mixes samples in the mode it is in
(BatchNorm in training, or in eval mode without running statistics): the error is an fxdp NotPrivateError and a
NotImplementedError (what Opacus's GradSampleModule raises), names each such module and says what to do. BatchNorm
frozen in eval mode with running statistics, and the model ModuleValidator.fix returns, are accepted, with per-sample
gradients equal to batches of one."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxdp
from fxdp.engines import (
    ExpandedWeightsGradSampleModule,
    FunctorchGradSampleModule,
    GradSampleHooks,
    GradSampleHooksFastGradientClipping,
    GradSampleModule,
    GradSampleModuleFastGradientClipping,
    NoOpGradSampleModule,
)
from fxdp.engines.base import engine_hooks
from fxdp.errors import SampleMixingModuleError

ENGINES = [GradSampleModule, GradSampleHooks, GradSampleModuleFastGradientClipping,
           GradSampleHooksFastGradientClipping, ExpandedWeightsGradSampleModule, FunctorchGradSampleModule,
           NoOpGradSampleModule]


class SmallBatchNormNet(nn.Module):
    """A stand-in for torchvision's mobilenet_v3_small in Opacus's test: convolutions with BatchNorm, and a
    BatchNorm1d nested in the head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.head = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x):
        return self.head(self.features(x))


def x_of(n):
    return torch.randn(n, 3, 6, 6, dtype=torch.float64)


@pytest.mark.parametrize("cls", ENGINES)
def test_a_model_with_batch_norm_in_training_is_refused_when_the_engine_is_built(cls):
    model = SmallBatchNormNet().double()
    with pytest.raises(NotImplementedError) as info:  # Opacus's test_custom_module_validation, with only imports switched
        cls(model)
    error = info.value
    assert isinstance(error, SampleMixingModuleError) and isinstance(error, fxdp.errors.NotPrivateError)
    assert isinstance(error, fxdp.errors.FxdpError)
    assert [(e.module_name, e.module_type) for e in error.errors] == [("features.1", nn.BatchNorm2d),
                                                                       ("head.1", nn.BatchNorm1d)]
    assert [f.node for f in error.findings] == ["features.1", "head.1"]
    text = str(error)
    assert f"fxdp: {cls.__name__} cannot compute per-sample gradients of SmallBatchNormNet" in text
    assert "`features.1` (nn.BatchNorm2d)" in text and "`head.1` (nn.BatchNorm1d)" in text
    assert "ModuleValidator.fix(model)" in text and "eval mode" in text
    assert engine_hooks(model) == []  # refused before any hook went on the model


def test_frozen_batch_norm_in_training_still_mixes_samples_and_is_refused():
    model = SmallBatchNormNet().double()
    for bn in (model.features[1], model.head[1]):
        bn.requires_grad_(False)
    with pytest.raises(SampleMixingModuleError, match=r"`features\.1`"):
        GradSampleModule(model)


def test_batch_norm_in_eval_mode_without_running_statistics_is_refused():
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, track_running_stats=False), nn.Linear(5, 2))
    model[1].eval()  # no running statistics: it still normalises with the batch's
    with pytest.raises(SampleMixingModuleError, match=r"`1` \(nn.BatchNorm1d\)"):
        GradSampleModule(model)


def test_a_batch_norm_model_as_root_is_named_as_the_model():
    with pytest.raises(SampleMixingModuleError, match="`<model>` \\(nn.BatchNorm1d\\)"):
        GradSampleModule(nn.BatchNorm1d(3))


def assert_per_sample_gradients_equal_batches_of_one(model, engine, x):
    """p.grad_sample[i] of a summed loss equals the gradient of sample i run alone."""
    reference = copy.deepcopy(model)
    engine(x).pow(2).sum().backward()
    for i in range(x.shape[0]):
        reference.zero_grad()
        reference(x[i:i + 1]).pow(2).sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad_sample[i], q.grad, msg=f"{name}, sample {i}")


@pytest.mark.parametrize("cls", [GradSampleModule, FunctorchGradSampleModule])
def test_batch_norm_frozen_in_eval_mode_is_accepted_and_right(cls):
    torch.manual_seed(0)
    model = SmallBatchNormNet().double()
    with torch.no_grad():
        model(x_of(8))  # running statistics
    for bn in (model.features[1], model.head[1]):
        bn.eval().requires_grad_(False)
    engine = cls(model, loss_reduction="sum")
    assert_per_sample_gradients_equal_batches_of_one(model, engine, x_of(4))


def test_the_model_module_validator_fix_returns_is_accepted_and_right():
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxdp.errors.ModuleFixWarning)
        model = fxdp.validators.ModuleValidator.fix(SmallBatchNormNet().double())
    engine = GradSampleModule(model, loss_reduction="sum")
    assert_per_sample_gradients_equal_batches_of_one(model, engine, x_of(4))
    assert engine.verification.startswith("verified on a batch of 4")


def test_batch_norm_put_in_training_after_the_engine_was_built_is_caught_by_the_self_check():
    model = SmallBatchNormNet().double()
    model.features[1].eval()
    model.head[1].eval()
    engine = GradSampleModule(model)
    model.train()
    with pytest.raises(fxdp.errors.SampleMixingError):
        engine(x_of(4))


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > -1e9:  # data-dependent control flow: torch.fx cannot trace it, the hooks engine runs it
            x = x * 2
        return self.out(self.bn(self.fc(x)))


def test_the_compilers_hooks_fallback_refuses_it_when_compiling():
    with pytest.raises(fxdp.errors.NotPrivateError, match=r"`bn` \(nn.BatchNorm1d\)") as info:
        fxdp.compile_for_dp(Untraceable(), torch.randn(5, 4))
    assert isinstance(info.value, NotImplementedError)


def test_inspect_reports_it_without_raising_and_strict_raises():
    report = fxdp.inspect(Untraceable(), torch.randn(5, 4))
    assert report.engine == "hooks"
    assert [(f.node, f.op) for f in report.errors] == [("bn", "nn.BatchNorm1d")]
    with pytest.raises(SampleMixingModuleError):
        fxdp.inspect(Untraceable(), torch.randn(5, 4), strict=True)


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_make_private_refuses_it_with_the_batch_norm_named(mode):
    model = Untraceable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2)),
                                       batch_size=4)
    with pytest.raises(fxdp.errors.NotPrivateError, match="bn"):
        fxdp.PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=data, noise_multiplier=1.0,
                                          max_grad_norm=1.0, grad_sample_mode=mode)
