"""make_private with banded MF without amplification (``BandedMatrixFactorization(bands, steps=, min_separation=)``)
and with tree aggregation: the fixed-epoch cyclic loader, their min-separation accountants (one Gaussian event of
``sigma / sensitivity``, dp-accounting's ε), calibration to a target ε, a checkpoint through the PrivacyEngine
continuing the same noise, and the loaders refused, with the error text."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from fxdp.accounting import MinSeparationBandedMFAccountant, MinSeparationTreeAccountant
from fxdp.data import CyclicPoissonDataLoader, DPDataLoader
from fxdp.optim.correlated import BandedMatrixFactorization, TreeAggregation
from fxdp.privacy_engine import PrivacyEngine
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError
from tests.support.private_steps import noise_of_zero_gradient_steps
from tests.test_correlated_noise_blt import classifier, dataset, train

DELTA = 1e-5
MECHANISMS = {"banded": lambda steps, b: BandedMatrixFactorization(3, steps=steps, min_separation=b),
              "tree": lambda steps, b: TreeAggregation(steps=steps, min_separation=b)}
ACCOUNTANTS = {"banded": MinSeparationBandedMFAccountant, "tree": MinSeparationTreeAccountant}


def private(engine, mechanism, **kwargs):
    model, data = classifier(), dataset()
    kwargs.setdefault("noise_multiplier", 1.0)
    loader = DataLoader(data, batch_size=10, generator=torch.Generator().manual_seed(0))
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                               max_grad_norm=1.0, example_inputs=data.tensors[0][:4], noise_mechanism=mechanism,
                               **kwargs)


def gaussian_epsilon(noise_multiplier):
    reference = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    reference.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    return reference.get_epsilon(DELTA)


@pytest.mark.parametrize("kind", ["banded", "tree"])
def test_make_private_uses_fixed_epoch_batches_and_accounts_without_amplification(kind):
    engine = PrivacyEngine()
    mechanism = MECHANISMS[kind](18, 6)
    model, optimizer, loader = private(engine, mechanism, noise_multiplier=3.0)
    assert isinstance(loader, CyclicPoissonDataLoader) and loader.partitions == 6 and loader.sample_rate == 1.0
    assert type(engine.accountant) is ACCOUNTANTS[kind]
    for _ in range(3):
        train(model, optimizer, loader)
    assert optimizer.noise_mechanism.steps == 18 and len(engine.accountant) == 18
    assert mechanism.sensitivity > 1.0  # three participations, 6 steps apart
    assert engine.get_epsilon(DELTA) == pytest.approx(gaussian_epsilon(3.0 / mechanism.sensitivity), rel=1e-9)
    with pytest.raises(StepRefusedError, match="planned .* for 18 steps and all have run"):
        train(model, optimizer, [next(iter(loader))])


@pytest.mark.parametrize("kind", ["banded", "tree"])
def test_make_private_with_epsilon_calibrates_for_the_min_separation_accountant(kind):
    engine, data = PrivacyEngine(), dataset()
    model = classifier()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10), target_epsilon=3.0, target_delta=DELTA, epochs=2,
        max_grad_norm=1.0, example_inputs=data.tensors[0][:4], epsilon_tolerance=0.05,
        noise_mechanism=MECHANISMS[kind](12, 6))
    for _ in range(2):
        train(model, optimizer, loader)
    assert 3.0 - 0.05 - 1e-6 <= engine.get_epsilon(DELTA) <= 3.0 + 1e-6
    label = {"banded": "banded MF", "tree": "tree aggregation"}[kind]
    with pytest.raises(ValueError, match=f"3 epochs of 6 batches are 18 steps; the {label} noise was planned for 12"):
        PrivacyEngine().make_private_with_epsilon(
            module=classifier(), optimizer=torch.optim.SGD(classifier().parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=10), target_epsilon=3.0, target_delta=DELTA, epochs=3,
            max_grad_norm=1.0, noise_mechanism=MECHANISMS[kind](12, 6))


@pytest.mark.parametrize("kind", ["banded", "tree"])
def test_a_loader_that_does_not_match_the_plan_is_refused(kind):
    label = {"banded": "banded MF", "tree": "tree aggregation"}[kind]
    with pytest.raises(ValueError, match=f"the {label} noise was planned for a sample's steps 7 or more apart; with "
                                         "6 batches a pass, make_private's fixed-epoch loader puts them 6 apart"):
        private(PrivacyEngine(), MECHANISMS[kind](18, 7))
    with pytest.raises(ValueError, match=f"make_private with {label} noise refuses poisson_sampling=False"):
        private(PrivacyEngine(), MECHANISMS[kind](18, 6), poisson_sampling=False)
    with pytest.raises(PrivacySettingError, match="one step of every 6 or more; a DPDataLoader does not guarantee"):
        MECHANISMS[kind](18, 6).follow(DPDataLoader(dataset(), sample_rate=0.1))
    accountant = ACCOUNTANTS[kind](min_separation=6, steps=18, partitions=6)
    with pytest.raises(ValueError, match=f"{label} noise is accounted for participation at least 6 steps apart; "
                                         "this loader samples with PoissonBatchSampler"):
        accountant.check_loader(DPDataLoader(dataset(), sample_rate=0.1))


def test_banded_mf_with_amplification_is_unchanged_by_the_option():
    from fxdp.accounting import CyclicPoissonBandedMFAccountant
    engine = PrivacyEngine()
    _, _, loader = private(engine, BandedMatrixFactorization(3))
    assert type(engine.accountant) is CyclicPoissonBandedMFAccountant and loader.partitions == 3


@pytest.mark.parametrize("kind", ["banded", "tree"])
def test_a_checkpoint_resumes_the_same_noise_and_privacy(kind, tmp_path):
    def run(stop):
        engine = PrivacyEngine()
        model, optimizer, loader = private(engine, MECHANISMS[kind](18, 6),
                                           noise_generator=torch.Generator().manual_seed(7))
        train(model, optimizer, loader)
        if stop:
            engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
            engine = PrivacyEngine()
            model, optimizer, loader = private(engine, MECHANISMS[kind](18, 6),
                                               noise_generator=torch.Generator().manual_seed(99))
            engine.load_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
        return (noise_of_zero_gradient_steps(model, optimizer, loader), engine.get_epsilon(DELTA),
                optimizer.noise_mechanism.steps)

    straight, resumed = run(False), run(True)
    assert torch.equal(straight[0], resumed[0]) and straight[1:] == resumed[1:]
