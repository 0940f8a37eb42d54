"""make_private with banded MF noise: the cyclic Poisson loader, the banded MF accountant, calibration to a target
ε, checkpoints through the PrivacyEngine, and the settings refused."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fxdp.accounting import CyclicPoissonBandedMFAccountant
from fxdp.data import CyclicPoissonDataLoader
from fxdp.optim.correlated import BandedMatrixFactorization
from fxdp.privacy_engine import PrivacyEngine
from fxdp.sinks.contract import StepRefusedError
from tests.support.private_steps import noise_of_zero_gradient_steps

DELTA = 1e-5


def dataset(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def classifier(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def private(engine, bands=3, model=None, loader_seed=0, **kwargs):
    model = model or classifier()
    data = dataset()
    kwargs.setdefault("noise_multiplier", 1.0)
    loader = DataLoader(data, batch_size=10, generator=torch.Generator().manual_seed(loader_seed))
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=loader, max_grad_norm=1.0, example_inputs=data.tensors[0][:4],
                               noise_mechanism=BandedMatrixFactorization(bands), **kwargs)


def train(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_make_private_samples_cyclically_and_accounts_banded_mf():
    engine = PrivacyEngine()
    model, optimizer, loader = private(engine, bands=3, noise_multiplier=1.2)
    assert isinstance(loader, CyclicPoissonDataLoader) and loader.partitions == 3
    assert len(loader) == 6 and loader.sample_rate == pytest.approx(0.5)  # 6 batches of 10 rounded up to 3s
    assert optimizer.expected_batch_size == 10
    assert isinstance(engine.accountant, CyclicPoissonBandedMFAccountant)
    for _ in range(2):
        train(model, optimizer, loader)
    assert optimizer.noise_mechanism.steps == 12 and len(engine.accountant) == 12
    reference = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    reference.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.2)), 4)
    assert engine.get_epsilon(DELTA) == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)


def test_a_pass_left_mid_cycle_is_refused_at_the_next_step():
    engine = PrivacyEngine()
    model, optimizer, loader = private(engine, bands=3)
    train(model, optimizer, [next(iter(loader))])  # one batch, then a new pass: part 0 again
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StepRefusedError, match="cycle"):
        train(model, optimizer, [next(iter(loader))])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and len(engine.accountant) == 1


def test_make_private_with_epsilon_calibrates_for_the_banded_accountant():
    engine = PrivacyEngine()
    model = classifier()
    data = dataset()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10),
        target_epsilon=3.0, target_delta=DELTA, epochs=2, max_grad_norm=1.0, example_inputs=data.tensors[0][:4],
        noise_mechanism=BandedMatrixFactorization(2), epsilon_tolerance=0.05)
    for _ in range(2):
        train(model, optimizer, loader)
    assert 3.0 - 0.05 - 1e-6 <= engine.get_epsilon(DELTA) <= 3.0 + 1e-6


def test_a_checkpoint_resumes_the_same_noise_and_privacy(tmp_path):
    """Stop after a pass, resume in a fresh engine (same loader seed, so the same split of the samples): the next
    pass's noise and the accountant continue as if the run had never stopped."""
    def run(stop):
        engine = PrivacyEngine()
        model, optimizer, loader = private(engine, noise_generator=torch.Generator().manual_seed(7))
        train(model, optimizer, loader)
        if stop:
            engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
            engine = PrivacyEngine()
            model, optimizer, loader = private(engine, noise_generator=torch.Generator().manual_seed(99))
            engine.load_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
        torch.manual_seed(3)  # (the batches of the second pass are not what is compared: the noise is)
        optimizer.zero_grad()
        return (noise_of_zero_gradient_steps(model, optimizer, loader), engine.get_epsilon(DELTA),
                optimizer.noise_mechanism.steps)

    straight, resumed = run(False), run(True)
    assert torch.equal(straight[0], resumed[0]) and straight[1:] == resumed[1:]


@pytest.mark.parametrize("engine_kwargs, kwargs, match", [
    ({"accountant": "rdp"}, {}, "accountant='rdp'"),
    ({}, {"poisson_sampling": False}, "poisson_sampling=False"),
])
def test_settings_no_analysis_covers_are_refused(engine_kwargs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        private(PrivacyEngine(**engine_kwargs), **kwargs)


def test_an_accountant_with_steps_of_independent_noise_is_refused():
    engine = PrivacyEngine()
    engine.accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="already recorded 1 steps"):
        private(engine)
    assert math.isfinite(engine.get_epsilon(DELTA))


def test_the_memory_manager_keeps_the_cycle():
    """Physical batches of at most 3 rows: the logical batches' parts are still told to the noise mechanism, and the
    run spends what it spends without the memory manager."""
    from fxdp.data import BatchMemoryManager

    engine = PrivacyEngine()
    model, optimizer, loader = private(engine, bands=3)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as physical:
        for _ in range(2):
            train(model, optimizer, physical)
    assert optimizer.noise_mechanism.steps == 12 and len(engine.accountant) == 12
