"""Banded MF without amplification: ``BandedMatrixFactorization(bands, steps=n, min_separation=b)``. Its
sensitivity under min-separation participation equals the brute-force maximum over every participation pattern of
the explicit matrix; a step past the plan is refused; checkpoints keep the plan; and what is refused, with the text.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fxdp.optim.correlated import (BandedMatrixFactorization, banded_toeplitz_matrix,
                                   min_separation_sensitivity_of_banded, sqrt_toeplitz_coefficients)
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError

SKEWED = [2.0, -0.5, 0.25, 0.1]  # signs mixed: its bands must not overlap (min_separation >= bands)


def brute_force(coefficients, n, b):
    """max over every non-empty set of steps, consecutive ones b or more apart, of ||sum of C's columns||."""
    C = banded_toeplitz_matrix(coefficients, n)
    best = 0.0
    for r in range(1, -(-n // b) + 1):
        for steps in itertools.combinations(range(n), r):
            if all(j - i >= b for i, j in zip(steps, steps[1:])):
                best = max(best, float(C[:, list(steps)].sum(1).norm()))
    return best


@pytest.mark.parametrize("n, b", [(12, 4), (12, 5), (13, 6), (10, 10), (11, 4)])
@pytest.mark.parametrize("coefficients", [sqrt_toeplitz_coefficients(4), SKEWED])
def test_sensitivity_equals_the_brute_force_maximum_when_the_bands_do_not_overlap(coefficients, n, b):
    mechanism = BandedMatrixFactorization(coefficients=coefficients, steps=n, min_separation=b)
    assert mechanism.sensitivity == pytest.approx(brute_force(mechanism.coefficients, n, b), rel=1e-12)
    assert not mechanism.amplified and mechanism.max_participations == -(-n // b)


@pytest.mark.parametrize("n, b", [(12, 1), (12, 2), (12, 3), (13, 2)])
def test_overlapping_bands_of_a_non_increasing_strategy_equal_the_brute_force_maximum(n, b):
    coefficients = sqrt_toeplitz_coefficients(4)
    assert min_separation_sensitivity_of_banded(coefficients, n, b) == pytest.approx(
        brute_force(coefficients, n, b), rel=1e-12)


def test_with_amplification_nothing_changes():
    mechanism = BandedMatrixFactorization(4)
    assert mechanism.amplified and mechanism.sensitivity == pytest.approx(1.0, rel=1e-13)
    assert mechanism.planned_steps is None and "steps" not in repr(mechanism)
    assert "planned_steps" not in mechanism.state_dict()


def test_what_is_refused():
    with pytest.raises(PrivacySettingError, match="bands of C overlap, and fxdp's sensitivity holds then only for "
                                                  "non-negative, non-increasing coefficients"):
        BandedMatrixFactorization(coefficients=SKEWED, steps=12, min_separation=3)
    with pytest.raises(PrivacySettingError, match="min_separation=...\\) accounts without amplification and needs "
                                                  "steps="):
        BandedMatrixFactorization(4, min_separation=4)
    with pytest.raises(PrivacySettingError, match="steps must be an int >= 1, got 0"):
        BandedMatrixFactorization(4, steps=0)


def test_a_step_past_the_plan_is_refused_and_checkpoints_keep_the_plan():
    mechanism = BandedMatrixFactorization(3, steps=4, min_separation=4)
    mechanism.follow_cycle(lambda: mechanism.steps % 4, 4)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        mechanism.add_noise_([torch.zeros(3)], 1.0, generator=generator)
    with pytest.raises(StepRefusedError, match="planned \\(its sensitivity computed\\) for 4 steps and all have run"):
        mechanism.add_noise_([torch.zeros(3)], 1.0, generator=generator)
    state = mechanism.state_dict()
    same = BandedMatrixFactorization(3, steps=4, min_separation=4)
    same.load_state_dict(state)
    assert same.steps == 4 and all(torch.equal(a[0], b[0]) for a, b in zip(same._history, mechanism._history))
    with pytest.raises(ValueError, match=r"planned for \(steps, min_separation\) \(4, 4\), this mechanism for "
                                         r"\(None, None\)"):
        BandedMatrixFactorization(3).load_state_dict(state)
    with pytest.raises(PrivacySettingError, match="at least 4 partitions"):
        BandedMatrixFactorization(3, steps=8, min_separation=4).follow_cycle(lambda: 0, 3)
