"""Opacus's GradSampleModule methods on every model fxdp returns, whatever the engine: ``_module``,
``to_standard_module``, ``state_dict``, ``enable_hooks``/``disable_hooks``, ``del_grad_sample``, ``zero_grad``,
``forbid_grad_accumulation``/``allow_grad_accumulation``; GradSampleHooks; get_gsm_class."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdp
from fxdp.diagnostics import PerSampleError
from fxdp.engines import (
    ExpandedWeightsGradSampleModule,
    FunctorchGradSampleModule,
    GradSampleHooks,
    GradSampleModule,
    GradSampleModuleFastGradientClipping,
    NoOpGradSampleModule,
    get_gsm_class,
)
from fxdp.optim import DPOptimizer
from fxdp.sinks.contract import sink_of

MODES = ["fx", "hooks", "functorch", "ew", "no_op"]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.mark.parametrize("mode", MODES)
def test_the_wrapped_model_and_its_state_dict(mode):
    model = mlp()
    dp = fxdp.compile_for_dp(model, grad_sample_mode=mode)
    assert dp._module is model
    fresh = mlp()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    state = dp._module.state_dict() if mode != "fx" else dp.state_dict()  # the graph keeps the model's keys
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    if mode != "fx":  # a wrapper's own state_dict has Opacus's "_module." prefix, and loads into a wrapper
        assert set(dp.state_dict()) == {f"_module.{k}" for k in model.state_dict()}


@pytest.mark.parametrize("mode", ["fx", "hooks", "functorch"])
def test_disabled_hooks_give_the_ordinary_gradient_and_the_optimizer_refuses_it(mode):
    model = mlp()
    dp = fxdp.compile_for_dp(model, grad_sample_mode=mode)
    dp.disable_hooks()
    assert not dp.hooks_enabled
    x = torch.randn(5, 4)
    dp(x).sum().backward()
    plain = mlp()
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert getattr(p, "grad_sample", None) is None
        torch.testing.assert_close(p.grad, q.grad)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                            expected_batch_size=5, sink=sink_of(dp))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PerSampleError, match="switched off .model.disable_hooks"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved

    dp.enable_hooks()
    dp.zero_grad()
    dp(x).sum().backward()
    assert all(p.grad_sample.shape == (5, *p.shape) for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_zero_grad_and_del_grad_sample(mode):
    model = mlp()
    dp = fxdp.compile_for_dp(model, grad_sample_mode=mode)
    dp(torch.randn(3, 4)).sum().backward()
    for p in model.parameters():
        p.grad_sample = torch.ones(3, *p.shape)
    dp.del_grad_sample()
    assert all(p.grad_sample is None for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters()) or mode == "ew"
    dp(torch.randn(3, 4)).sum().backward()
    dp.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert getattr(p, "grad_sample", None) is None
        assert p.grad is None or not p.grad.any()
    dp.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_to_standard_module_detaches_the_engine(mode):
    model = mlp()
    dp = fxdp.compile_for_dp(model, grad_sample_mode=mode)
    standard = dp.to_standard_module()
    assert standard is model and type(standard) is nn.Sequential
    standard(torch.randn(3, 4)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


def test_accumulation_flags_keep_fxdps_refusal_of_two_batches_in_one_step():
    model = mlp()
    dp = fxdp.compile_for_dp(model, grad_sample_mode="hooks")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                            expected_batch_size=3, sink=sink_of(dp))
    for flag in (dp.allow_grad_accumulation, dp.forbid_grad_accumulation):
        flag()
        optimizer.zero_grad()
        dp(torch.randn(3, 4)).sum().backward()
        dp(torch.randn(3, 4)).sum().backward()  # another batch, no step between
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(PerSampleError, match="another batch"):
            optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert dp.grad_accumulation_allowed is False


def test_grad_sample_hooks_run_on_the_model_itself_and_clean_up():
    model = mlp()
    hooks = GradSampleHooks(model)
    x = torch.randn(4, 4)
    model(x).sum().backward()
    for i, p in enumerate(model.parameters()):
        assert p.grad_sample.shape == (4, *p.shape)
    one = mlp()
    one(x[:1]).sum().backward()
    torch.testing.assert_close(model[0].weight.grad_sample[0], one[0].weight.grad)
    assert set(model.state_dict()) == set(mlp().state_dict())
    hooks.cleanup()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


def test_get_gsm_class():
    assert get_gsm_class("hooks") is GradSampleModule
    assert get_gsm_class("functorch") is FunctorchGradSampleModule
    assert get_gsm_class("ew") is ExpandedWeightsGradSampleModule
    assert get_gsm_class("no_op") is NoOpGradSampleModule
    assert get_gsm_class("ghost") is GradSampleModuleFastGradientClipping
    with pytest.raises(ValueError, match="ghost_fsdp.*no wrapper class.*fully_shard.*make_private"):
        get_gsm_class("ghost_fsdp")
    with pytest.raises(ValueError, match="'fx' is fxdp.compile_for_dp"):
        get_gsm_class("fx")


def _make_private(model, **kwargs):
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 2
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    engine = fxdp.PrivacyEngine()
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
                              noise_multiplier=0.0, max_grad_norm=0.3, poisson_sampling=False, **kwargs)
    return engine, out, (x, y)


@pytest.mark.parametrize("materialise", [False, True])
def test_make_private_without_wrapping_trains_the_model_itself_as_the_wrapped_one(materialise):
    ends = []
    for wrap in (True, False):
        model = mlp()
        engine, (returned, optimizer, _), (x, y) = _make_private(model, wrap_model=wrap,
                                                                 materialise_grad_sample=materialise)
        if not wrap:
            assert isinstance(returned, GradSampleHooks) and returned._module is model
            del returned  # the optimizer keeps the hooks alive
        run = model if not wrap else returned
        optimizer.zero_grad()
        nn.functional.cross_entropy(run(x), y).backward()
        optimizer.step()
        ends.append([p.detach().clone() for p in model.parameters()])
        assert len(engine.accountant) == 1
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*ends))
    assert not all(torch.equal(a, b) for a, b in zip(ends[0], mlp().parameters()))


def test_make_private_without_wrapping_refuses_engines_that_need_their_wrapper():
    model = mlp()
    with pytest.raises(ValueError, match="wrap_model=False.*'functorch' needs its wrapper"):
        _make_private(model, wrap_model=False, grad_sample_mode="functorch")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
