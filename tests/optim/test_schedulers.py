"""Noise and clipping-bound schedulers (fxdp.optim.schedulers): the values they set, that the accountant records
the noise multiplier of every step as scheduled, and their state in the privacy engine's checkpoints."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fxdp
from fxdp.optim import (ExponentialGradClip, ExponentialNoise, LambdaGradClip, LambdaNoise, StepGradClip,
                        StepNoise)


def private(noise=1.0, clip=1.0, seed=0, accountant="rdp"):
    torch.manual_seed(seed)
    model = nn.Linear(5, 2)
    loader = DataLoader(TensorDataset(torch.randn(40, 5), torch.randn(40, 2)), batch_size=8)
    engine = fxdp.PrivacyEngine(accountant=accountant)
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=loader, noise_multiplier=noise, max_grad_norm=clip)
    return engine, model, opt, loader


def train_epoch(model, opt, loader):
    for x, y in loader:
        opt.zero_grad()
        ((model(x) - y) ** 2).sum().backward()
        opt.step()


@pytest.mark.parametrize("make, values", [
    (lambda o: ExponentialNoise(o, gamma=0.5), [2.0, 1.0, 0.5, 0.25]),
    (lambda o: StepNoise(o, step_size=2, gamma=0.5), [2.0, 2.0, 1.0, 1.0]),
    (lambda o: LambdaNoise(o, noise_lambda=lambda e: 1 + e), [2.0, 4.0, 6.0, 8.0]),
])
def test_noise_schedulers_set_the_scheduled_multiplier(make, values):
    _, _, opt, _ = private(noise=2.0)
    scheduler = make(opt)
    seen = [opt.noise_multiplier]
    for _ in range(3):
        scheduler.step()
        seen.append(opt.noise_multiplier)
    assert seen == pytest.approx(values)


@pytest.mark.parametrize("make, values", [
    (lambda o: ExponentialGradClip(o, gamma=0.5), [2.0, 1.0, 0.5]),
    (lambda o: StepGradClip(o, step_size=2, gamma=0.5), [2.0, 2.0, 1.0]),
    (lambda o: LambdaGradClip(o, scheduler_function=lambda e: 1 + e), [2.0, 4.0, 6.0]),
])
def test_clip_schedulers_set_the_scheduled_bound(make, values):
    _, _, opt, _ = private(clip=2.0)
    scheduler = make(opt)
    seen = [opt.max_grad_norm]
    for _ in range(2):
        scheduler.step()
        seen.append(opt.max_grad_norm)
    assert seen == pytest.approx(values)


def test_the_accountant_records_the_noise_of_every_step_as_scheduled():
    engine, model, opt, loader = private(noise=2.0)
    scheduler = StepNoise(opt, step_size=1, gamma=0.5)
    steps = []
    for _ in range(3):
        before = len(engine.accountant)
        train_epoch(model, opt, loader)
        steps.append(len(engine.accountant) - before)
        scheduler.step()
    assert [sigma for sigma, _, _ in engine.accountant.history] == [2.0, 1.0, 0.5]
    assert [n for _, _, n in engine.accountant.history] == steps == [5, 5, 5]
    # and the ε is that of the schedule, not of the first (or last) multiplier alone
    reference = fxdp.accounting.RDPAccountant()
    reference.history = [(2.0, 0.2, 5), (1.0, 0.2, 5), (0.5, 0.2, 5)]
    assert engine.get_epsilon(1e-5) == reference.get_epsilon(1e-5)


def test_a_scheduler_cannot_set_a_value_no_private_step_can_run_with():
    _, _, opt, _ = private(noise=1.0)
    scheduler = LambdaNoise(opt, noise_lambda=lambda e: 1 - e)  # negative from epoch 2
    scheduler.step()
    with pytest.raises(fxdp.diagnostics.PrivacySettingError, match="noise_multiplier must be a finite number >= 0"):
        scheduler.step()
    assert opt.noise_multiplier == 0.0


def test_per_layer_bounds_are_refused_by_the_clip_schedulers():
    model = nn.Linear(3, 2)
    opt = fxdp.optim.DPPerLayerOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                         max_grad_norm=[1.0, 1.0], expected_batch_size=4)
    with pytest.raises(TypeError, match="per-layer bounds"):
        StepGradClip(opt, step_size=1, gamma=0.5)


def test_checkpoints_keep_the_schedulers_states():
    engine, model, opt, loader = private(noise=2.0)
    noise, clip = StepNoise(opt, step_size=1, gamma=0.5), ExponentialGradClip(opt, gamma=0.9)
    train_epoch(model, opt, loader)
    noise.step()
    clip.step()
    buffer = io.BytesIO()
    engine.save_checkpoint(path=buffer, module=model, optimizer=opt, noise_scheduler=noise, grad_clip_scheduler=clip,
                           checkpoint_dict={"epoch": 1})
    engine2, model2, opt2, _ = private(noise=3.0, seed=1)
    noise2, clip2 = StepNoise(opt2, step_size=3, gamma=0.1), ExponentialGradClip(opt2, gamma=0.3)
    assert noise2.state_dict() != noise.state_dict()
    buffer.seek(0)
    with pytest.warns(UserWarning, match="keeps its own noise_multiplier=3.0"):  # the scheduler's state sets it
        extra = engine2.load_checkpoint(path=buffer, module=model2, optimizer=opt2, noise_scheduler=noise2,
                                        grad_clip_scheduler=clip2)
    assert extra == {"epoch": 1}
    assert noise2.state_dict() == noise.state_dict() and clip2.state_dict() == clip.state_dict()
    assert engine2.accountant.history == engine.accountant.history
    noise.step()
    noise2.step()
    assert opt2.noise_multiplier == opt.noise_multiplier == 0.5
    # a checkpoint without a scheduler's state cannot restore one
    buffer = io.BytesIO()
    engine.save_checkpoint(path=buffer, module=model, optimizer=opt)
    buffer.seek(0)
    with pytest.raises(ValueError, match="holds no noise_scheduler state"):
        engine2.load_checkpoint(path=buffer, module=model2, optimizer=opt2, noise_scheduler=noise2)
