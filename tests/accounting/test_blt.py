"""The BLT accountant under min-separation participation: its ε is dp-accounting's for one Gaussian event of the
normalised strategy's noise, whatever the sample rate and number of steps up to the planned ones; what it refuses,
with the error text; and its calibration."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from torch.utils.data import TensorDataset

from fxdp.accounting import MinSeparationBLTAccountant, PLDAccountant, blt_noise_multiplier
from fxdp.data import CyclicPoissonDataLoader, DPDataLoader

GRID = 1e-3


def gaussian_epsilon(sigma, delta):
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                                 value_discretization_interval=GRID)
    accountant.compose(dp_accounting.GaussianDpEvent(sigma))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("sigma, sensitivity, steps", [(4.0, 1.0, 1), (4.0, 1.0, 30), (3.0, 1.5, 12)])
def test_epsilon_is_one_gaussian_event_of_the_normalised_noise(sigma, sensitivity, steps):
    accountant = MinSeparationBLTAccountant(min_separation=10, steps=30, partitions=10, sensitivity=sensitivity,
                                            value_discretization_interval=GRID)
    assert accountant.get_epsilon(1e-5) == 0.0
    for t in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=0.3 if t % 2 else 1.0)  # the rate is not used
    assert accountant.get_epsilon(1e-5) == pytest.approx(gaussian_epsilon(sigma / sensitivity, 1e-5), rel=1e-9)


def test_steps_past_the_plan_and_a_changing_noise_multiplier_are_refused():
    accountant = MinSeparationBLTAccountant(min_separation=2, steps=3, partitions=2)
    for _ in range(4):
        accountant.step(noise_multiplier=2.0, sample_rate=1.0)
    with pytest.raises(ValueError, match="4 steps were recorded; the BLT noise was planned for 3"):
        accountant.get_epsilon(1e-5)
    accountant = MinSeparationBLTAccountant(min_separation=2, steps=3, partitions=2)
    accountant.step(noise_multiplier=2.0, sample_rate=1.0)
    accountant.step(noise_multiplier=3.0, sample_rate=1.0)
    with pytest.raises(ValueError, match="one noise multiplier for the whole run"):
        accountant.get_epsilon(1e-5)


def test_a_loader_whose_participation_is_not_covered_is_refused():
    data = TensorDataset(torch.arange(40.0))
    accountant = MinSeparationBLTAccountant(min_separation=4, steps=40, partitions=4)
    with pytest.raises(ValueError, match="participation at least 4 steps apart; this loader samples with "
                                         "PoissonBatchSampler.*CyclicPoissonDataLoader"):
        accountant.check_loader(DPDataLoader(data, sample_rate=0.25))
    with pytest.raises(ValueError, match="the loader has 5 partitions, this accountant analyses 4"):
        accountant.check_loader(CyclicPoissonDataLoader(data, sample_rate=1.0, partitions=5))
    accountant.check_loader(CyclicPoissonDataLoader(data, sample_rate=1.0, partitions=4))
    with pytest.raises(ValueError, match="at least 4 partitions, got partitions=3"):
        MinSeparationBLTAccountant(min_separation=4, steps=40, partitions=3)


def test_histories_load_only_into_the_same_plan():
    accountant = MinSeparationBLTAccountant(min_separation=4, steps=40, partitions=4)
    accountant.step(noise_multiplier=2.0, sample_rate=1.0)
    state = accountant.state_dict()
    same = MinSeparationBLTAccountant(min_separation=4, steps=40, partitions=4)
    same.load_state_dict(state)
    assert same.history == accountant.history
    with pytest.raises(ValueError, match="analyses BLT noise"):
        MinSeparationBLTAccountant(min_separation=4, steps=80, partitions=4).load_state_dict(state)
    with pytest.raises(ValueError, match="noise correlated across steps"):
        PLDAccountant().load_state_dict(state)
    independent = PLDAccountant()
    independent.step(noise_multiplier=2.0, sample_rate=1.0)
    with pytest.raises(ValueError, match="independent Gaussian noise"):
        same.load_state_dict(independent.state_dict())


@pytest.mark.parametrize("target, sensitivity", [(2.0, 1.0), (8.0, 1.0), (4.0, 1.3)])
def test_calibration_reaches_the_target_within_the_tolerance(target, sensitivity):
    sigma = blt_noise_multiplier(target_epsilon=target, target_delta=1e-5, sensitivity=sensitivity,
                                 value_discretization_interval=GRID)
    assert target - 0.01 <= gaussian_epsilon(sigma / sensitivity, 1e-5) <= target
