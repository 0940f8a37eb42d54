"""make_private with a banded MF strategy optimised for the run's participation pattern
(``BandedMatrixFactorization.optimized(bands, steps=epochs * batches, min_separation=batches)``): the fixed-epoch
loader and the min-separation accountant take the strategy's sensitivity under that pattern, sigma is calibrated to
the target epsilon, the expected error at that sigma is below the other strategies' at theirs, and a plan the loader
does not give is refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from fxdp.accounting import MinSeparationBandedMFAccountant
from fxdp.correlated_noise import correlated_noise_multiplier
from fxdp.optim.correlated import (BandedMatrixFactorization, optimize_banded_toeplitz, pattern_sensitivity,
                                   prefix_sum_rmse)
from fxdp.privacy_engine import PrivacyEngine
from tests.test_correlated_noise_blt import classifier, dataset, train

DELTA, EPOCHS, BATCHES = 1e-5, 4, 6  # dataset(): 60 samples, batches of 10


def make_private_with_epsilon(mechanism, epochs=EPOCHS):
    engine, data, model = PrivacyEngine(), dataset(), classifier()
    private = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10, generator=torch.Generator().manual_seed(0)), target_epsilon=3.0,
        target_delta=DELTA, epochs=epochs, max_grad_norm=1.0, example_inputs=data.tensors[0][:4],
        epsilon_tolerance=0.05, noise_mechanism=mechanism)
    return engine, private


def calibrated_rmse(mechanism, steps):
    sigma = correlated_noise_multiplier(mechanism, DataLoader(dataset(), batch_size=10), target_epsilon=3.0,
                                        target_delta=DELTA, epochs=EPOCHS, epsilon_tolerance=0.05)
    return prefix_sum_rmse(mechanism, sigma, steps)


def test_the_strategy_for_several_epochs_is_accounted_for_that_pattern_and_has_the_smallest_error():
    steps = EPOCHS * BATCHES
    mechanism = BandedMatrixFactorization.optimized(8, steps=steps, min_separation=BATCHES)
    engine, (model, optimizer, loader) = make_private_with_epsilon(mechanism)
    assert loader.partitions == BATCHES and type(engine.accountant) is MinSeparationBandedMFAccountant
    assert engine.accountant.sensitivity == mechanism.sensitivity == pytest.approx(
        pattern_sensitivity(mechanism.coefficients, steps, BATCHES), rel=1e-12)
    for _ in range(EPOCHS):
        train(model, optimizer, loader)
    assert len(engine.accountant) == steps and 3.0 - 0.05 - 1e-6 <= engine.get_epsilon(DELTA) <= 3.0 + 1e-6
    # at the same epsilon (each sigma calibrated for its own sensitivity), the smallest expected error of the three
    mine = prefix_sum_rmse(optimizer.noise_mechanism, optimizer.noise_multiplier, steps)
    assert mine == pytest.approx(calibrated_rmse(mechanism, steps), rel=1e-12)
    square_root = BandedMatrixFactorization(8, steps=steps, min_separation=BATCHES)
    single = BandedMatrixFactorization(coefficients=optimize_banded_toeplitz(8, steps), steps=steps,
                                       min_separation=BATCHES)
    assert mine < calibrated_rmse(square_root, steps) and mine < calibrated_rmse(single, steps)


def test_a_plan_the_fixed_epoch_loader_does_not_give_is_refused():
    mechanism = BandedMatrixFactorization.optimized(4, steps=EPOCHS * 12, min_separation=12)
    with pytest.raises(ValueError, match="the banded MF noise was planned for a sample's steps 12 or more apart; with "
                                         "6 batches a pass, make_private's fixed-epoch loader puts them 6 apart"):
        make_private_with_epsilon(mechanism)
    with pytest.raises(ValueError, match="5 epochs of 6 batches are 30 steps; the banded MF noise was planned for 24"):
        make_private_with_epsilon(BandedMatrixFactorization.optimized(4, steps=24, min_separation=6), epochs=5)
