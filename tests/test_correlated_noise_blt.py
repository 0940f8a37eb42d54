"""make_private with BLT noise: the fixed-epoch cyclic loader (each sample in one fixed batch a pass), the BLT
accountant, calibration to a target ε, a checkpoint through the PrivacyEngine, and the settings refused, with the
error text."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fxdp.accounting import MinSeparationBLTAccountant
from fxdp.data import CyclicPoissonDataLoader, DPDataLoader
from fxdp.optim.correlated import BufferedLinearToeplitz
from fxdp.privacy_engine import PrivacyEngine
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError
from tests.support.private_steps import noise_of_zero_gradient_steps

DELTA = 1e-5
THETA, OMEGA = [0.95, 0.5], [0.2, 0.25]


def dataset(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def classifier(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def private(engine, mechanism=None, loader_seed=0, **kwargs):
    model = classifier()
    data = dataset()
    kwargs.setdefault("noise_multiplier", 1.0)
    loader = DataLoader(data, batch_size=10, generator=torch.Generator().manual_seed(loader_seed))
    mechanism = mechanism or BufferedLinearToeplitz(THETA, OMEGA, steps=18, min_separation=6)
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=loader, max_grad_norm=1.0, example_inputs=data.tensors[0][:4],
                               noise_mechanism=mechanism, **kwargs)


def train(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_make_private_uses_fixed_epoch_batches_and_accounts_blt():
    engine = PrivacyEngine()
    model, optimizer, loader = private(engine, noise_multiplier=3.0)
    assert isinstance(loader, CyclicPoissonDataLoader) and loader.partitions == 6 and len(loader) == 6
    assert loader.sample_rate == 1.0 and optimizer.expected_batch_size == 10
    assert isinstance(engine.accountant, MinSeparationBLTAccountant)
    seen = []
    for _ in range(3):
        for x, y in loader:
            seen.append(x)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    # each pass hands out the same fixed batches in the same order: a sample's steps are 6 apart
    assert all(torch.equal(a, b) for a, b in zip(seen[:6], seen[6:12]))
    assert optimizer.noise_mechanism.steps == 18 and len(engine.accountant) == 18
    reference = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    reference.compose(dp_accounting.GaussianDpEvent(3.0))
    assert engine.get_epsilon(DELTA) == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)
    assert optimizer.noise_mechanism.memory_bytes() == 2 * 4 * sum(p.numel() for p in model.parameters())
    with pytest.raises(StepRefusedError, match="planned .* for 18 steps and all have run"):
        train(model, optimizer, [next(iter(loader))])


def test_make_private_with_epsilon_calibrates_for_the_blt_accountant():
    engine = PrivacyEngine()
    model = classifier()
    data = dataset()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10), target_epsilon=3.0, target_delta=DELTA, epochs=2,
        max_grad_norm=1.0, example_inputs=data.tensors[0][:4], epsilon_tolerance=0.05,
        noise_mechanism=BufferedLinearToeplitz(THETA, OMEGA, steps=12, min_separation=6))
    for _ in range(2):
        train(model, optimizer, loader)
    assert 3.0 - 0.05 - 1e-6 <= engine.get_epsilon(DELTA) <= 3.0 + 1e-6
    with pytest.raises(ValueError, match="3 epochs of 6 batches are 18 steps; the BLT noise was planned for 12"):
        PrivacyEngine().make_private_with_epsilon(
            module=classifier(), optimizer=torch.optim.SGD(classifier().parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=10), target_epsilon=3.0, target_delta=DELTA, epochs=3,
            max_grad_norm=1.0, noise_mechanism=BufferedLinearToeplitz(THETA, OMEGA, steps=12, min_separation=6))


def test_a_loader_that_does_not_match_the_mechanisms_assumption_is_refused():
    with pytest.raises(ValueError, match="planned for a sample's steps 7 or more apart; with 6 batches a pass, "
                                         "make_private's fixed-epoch loader puts them 6 apart"):
        private(PrivacyEngine(), BufferedLinearToeplitz(THETA, OMEGA, steps=18, min_separation=7))
    with pytest.raises(ValueError, match="make_private with BLT noise refuses poisson_sampling=False"):
        private(PrivacyEngine(), poisson_sampling=False)
    mechanism = BufferedLinearToeplitz(THETA, OMEGA, steps=18, min_separation=6)
    plain = DPDataLoader(dataset(), sample_rate=0.1)
    with pytest.raises(PrivacySettingError, match="BLT noise is private .* one step of every 6 or more; a "
                                                  "DPDataLoader does not guarantee that"):
        mechanism.follow(plain)


def test_a_checkpoint_resumes_the_same_noise_and_privacy(tmp_path):
    def run(stop):
        engine = PrivacyEngine()
        model, optimizer, loader = private(engine, noise_generator=torch.Generator().manual_seed(7))
        train(model, optimizer, loader)
        if stop:
            engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
            engine = PrivacyEngine()
            model, optimizer, loader = private(engine, noise_generator=torch.Generator().manual_seed(99))
            engine.load_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
        return (noise_of_zero_gradient_steps(model, optimizer, loader), engine.get_epsilon(DELTA),
                optimizer.noise_mechanism.steps)

    straight, resumed = run(False), run(True)
    assert torch.equal(straight[0], resumed[0]) and straight[1:] == resumed[1:]
