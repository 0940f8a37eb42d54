"""The banded MF accountant under cyclic Poisson sampling: its ε is dp-accounting's for the composition the
reduction names (built here event by event), DP-SGD's for one band and one part, and what it refuses."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from torch.utils.data import TensorDataset

from fxdp.accounting import CyclicPoissonBandedMFAccountant, PLDAccountant
from fxdp.data import CyclicPoissonDataLoader, DPDataLoader


GRID = 1e-3  # the PLD's discretisation, coarser than the default for speed (the same for both sides)


def dp_accounting_epsilon(sigma, q, participations, delta):
    """One Poisson-subsampled Gaussian event per participation a sample can have, composed one at a time."""
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                                 value_discretization_interval=GRID)
    for _ in range(participations):
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("bands, partitions, steps, sensitivity", [(4, 4, 40, 1.0), (2, 5, 23, 1.0),
                                                                   (3, 3, 10, 1.25)])
def test_epsilon_is_dp_accountings_for_ceil_steps_over_partitions_poisson_gaussians(bands, partitions, steps,
                                                                                   sensitivity):
    sigma, q, delta = 1.1, 0.2, 1e-5
    accountant = CyclicPoissonBandedMFAccountant(bands=bands, partitions=partitions, sensitivity=sensitivity,
                                                 value_discretization_interval=GRID)
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    expected = dp_accounting_epsilon(sigma / sensitivity, q, math.ceil(steps / partitions), delta)
    assert accountant.get_epsilon(delta) == pytest.approx(expected, rel=1e-9)


def test_one_band_one_part_is_dp_sgd():
    banded = CyclicPoissonBandedMFAccountant(bands=1, partitions=1, value_discretization_interval=GRID)
    plain = PLDAccountant(value_discretization_interval=GRID)
    for accountant in (banded, plain):
        for _ in range(20):
            accountant.step(noise_multiplier=0.9, sample_rate=0.05)
    assert banded.get_epsilon(1e-5) == pytest.approx(plain.get_epsilon(1e-5), rel=1e-9)


def test_no_step_costs_nothing_and_a_step_without_noise_costs_everything():
    accountant = CyclicPoissonBandedMFAccountant(bands=2, partitions=2)
    assert accountant.get_epsilon(1e-5) == 0.0
    accountant.step(noise_multiplier=0.0, sample_rate=0.1)
    assert accountant.get_epsilon(1e-5) == math.inf


def test_a_loader_the_analysis_does_not_cover_is_refused():
    data = TensorDataset(torch.zeros(40, 1))
    accountant = CyclicPoissonBandedMFAccountant(bands=2, partitions=2)
    with pytest.raises(ValueError, match="cyclic Poisson sampling only.*PoissonBatchSampler"):
        accountant.check_loader(DPDataLoader(data, sample_rate=0.1))
    with pytest.raises(ValueError, match="3 partitions"):
        accountant.check_loader(CyclicPoissonDataLoader(data, sample_rate=0.5, partitions=3))
    accountant.check_loader(CyclicPoissonDataLoader(data, sample_rate=0.5, partitions=2))


def test_what_the_reduction_does_not_cover_is_refused():
    with pytest.raises(ValueError, match="at least 3 partitions"):
        CyclicPoissonBandedMFAccountant(bands=3, partitions=2)
    accountant = CyclicPoissonBandedMFAccountant(bands=2, partitions=2)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    accountant.step(noise_multiplier=2.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="one noise multiplier and one sample rate"):
        accountant.get_epsilon(1e-5)


def test_histories_do_not_cross_between_independent_and_correlated_noise():
    banded, plain = CyclicPoissonBandedMFAccountant(bands=2, partitions=2), PLDAccountant()
    banded.step(noise_multiplier=1.0, sample_rate=0.1)
    plain.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="correlated"):
        PLDAccountant().load_state_dict(banded.state_dict())
    with pytest.raises(ValueError, match="independent Gaussian noise"):
        CyclicPoissonBandedMFAccountant(bands=2, partitions=2).load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="'partitions': 3"):
        CyclicPoissonBandedMFAccountant(bands=2, partitions=3).load_state_dict(banded.state_dict())
    restored = CyclicPoissonBandedMFAccountant(bands=2, partitions=2)
    restored.load_state_dict(banded.state_dict())
    assert restored.history == banded.history
