"""Banded MF strategies under a participation pattern (``fxdp.optim.correlated.banded_strategy``): the sensitivity
against the brute-force maximum over every pattern of the explicit matrix, the expected error against the explicit
matrices, the optimum for disjoint bands equal to the single-participation one with the sensitivity and error scaled
as the module docstring derives, the optimum where bands overlap, ``BandedMatrixFactorization.optimized``, the
cache, and what is refused, with the text."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fxdp.optim.correlated import (BandedMatrixFactorization, banded_toeplitz_matrix, expected_prefix_sum_error,
                                   optimize_banded_toeplitz, optimize_banded_toeplitz_cache_info, pattern_sensitivity,
                                   sqrt_toeplitz_coefficients)
from fxdp.optim.correlated.banded_strategy import covered
from fxdp.sinks.contract import PrivacySettingError

SKEWED = [2.0, -0.5, 0.25, 0.1]  # signs mixed: its sensitivity is known only where its bands do not overlap


def brute_force_sensitivity(coefficients, n, b, k):
    """max over every non-empty set of at most k steps, consecutive ones b or more apart, of ||sum of C's columns||."""
    C = banded_toeplitz_matrix(coefficients, n)
    best = 0.0
    for r in range(1, k + 1):
        for steps in itertools.combinations(range(n), r):
            if all(j - i >= b for i, j in zip(steps, steps[1:])):
                best = max(best, float(C[:, list(steps)].sum(1).norm()))
    return best


def explicit_error(coefficients, n, b, k):
    """||A C^-1||_F^2 times the brute-force sensitivity squared, from the explicit n x n matrices."""
    C = banded_toeplitz_matrix(coefficients, n)
    A = torch.tril(torch.ones(n, n, dtype=torch.float64))
    return float((A @ torch.linalg.inv(C)).pow(2).sum()) * brute_force_sensitivity(coefficients, n, b, k) ** 2


@pytest.mark.parametrize("n, b, k", [(12, 4, 3), (12, 4, 2), (13, 5, 3), (11, 2, 3), (12, 1, 2), (12, 3, None),
                                     (10, 10, None), (14, 2, 4)])
@pytest.mark.parametrize("coefficients", [sqrt_toeplitz_coefficients(4), SKEWED, [0.6, 0.6, 0.3, 0.3, 0.3]])
def test_sensitivity_under_a_pattern_equals_the_brute_force_maximum(coefficients, n, b, k):
    most = -(-n // b) if k is None else min(k, -(-n // b))
    if b < len(coefficients) and most >= 2 and not covered(coefficients):
        with pytest.raises(PrivacySettingError, match=f"banded MF with 4 bands and min_separation={b}: a sample's "
                                                      "bands of C overlap, and fxdp's sensitivity holds then only for "
                                                      "non-negative, non-increasing coefficients"):
            pattern_sensitivity(coefficients, n, b, k)
        return
    assert pattern_sensitivity(coefficients, n, b, k) == pytest.approx(
        brute_force_sensitivity(coefficients, n, b, most), rel=1e-12)


@pytest.mark.parametrize("n, b, k", [(12, 3, None), (12, 5, 2), (13, 2, 3)])
def test_expected_error_under_a_pattern_equals_the_explicit_matrices(n, b, k):
    coefficients = sqrt_toeplitz_coefficients(5)
    most = -(-n // b) if k is None else min(k, -(-n // b))
    assert expected_prefix_sum_error(coefficients, n, min_separation=b, max_participations=k) == pytest.approx(
        explicit_error(coefficients, n, b, most), rel=1e-10)


@pytest.mark.parametrize("bands, n, b, k", [(4, 256, 64, None), (16, 1000, 100, None), (16, 1000, 100, 3),
                                            (8, 100, 30, None), (6, 510, 6, None)])
def test_where_bands_do_not_overlap_the_optimum_is_the_single_participation_one(bands, n, b, k):
    """(k - 1) b + bands <= n here: no participation's column is cut, sens^2 = k ||c||^2, the objective k times the
    single-participation one (module docstring, case 1)."""
    k_true = -(-n // b) if k is None else k
    assert (k_true - 1) * b + bands <= n
    single = optimize_banded_toeplitz(bands, n)
    mine = optimize_banded_toeplitz(bands, n, min_separation=b, max_participations=k)
    assert mine == pytest.approx(single, rel=1e-9, abs=1e-12)
    assert pattern_sensitivity(mine, n, b, k) == pytest.approx(math.sqrt(k_true), rel=1e-12)  # ||c|| = 1
    assert expected_prefix_sum_error(mine, n, min_separation=b, max_participations=k) == pytest.approx(
        k_true * expected_prefix_sum_error(single, n), rel=1e-12)
    mechanism = BandedMatrixFactorization.optimized(bands, steps=n, min_separation=b) if k is None else None
    if mechanism is not None:
        assert mechanism.coefficients == pytest.approx(single, rel=1e-9, abs=1e-12)
        assert mechanism.sensitivity == pytest.approx(math.sqrt(k_true), rel=1e-12)
        assert mechanism.max_participations == k_true and not mechanism.amplified


def test_a_cut_last_participation_is_optimised_for():
    """(k - 1) b + bands > n: the last participation's column is cut at row n, sens^2 < k ||c||^2, and the optimum
    for the pattern beats the single-participation one under it."""
    bands, n, b = 16, 100, 30
    single = optimize_banded_toeplitz(bands, n)
    mine = optimize_banded_toeplitz(bands, n, min_separation=b)
    assert pattern_sensitivity(single, n, b) ** 2 < 4 * (1 - 1e-6)
    assert expected_prefix_sum_error(mine, n, min_separation=b) < expected_prefix_sum_error(
        single, n, min_separation=b) * (1 - 1e-3)


@pytest.mark.parametrize("bands, n, b, k", [(6, 20, 3, 3), (5, 18, 2, 4), (8, 22, 4, None)])
def test_where_bands_overlap_the_optimum_is_in_the_cone_and_no_worse_than_the_alternatives(bands, n, b, k):
    mine = optimize_banded_toeplitz(bands, n, min_separation=b, max_participations=k)
    assert len(mine) == bands and covered(mine) and math.fsum(c * c for c in mine) == pytest.approx(1.0)
    most = -(-n // b) if k is None else min(k, -(-n // b))
    error = expected_prefix_sum_error(mine, n, min_separation=b, max_participations=k)
    assert error == pytest.approx(explicit_error(mine, n, b, most), rel=1e-9)  # the objective is the matrices'
    alternatives = [sqrt_toeplitz_coefficients(bands), optimize_banded_toeplitz(b, n) + [0.0] * (bands - b)]
    single = optimize_banded_toeplitz(bands, n)
    if covered(single):  # the single-participation optimum, where its sensitivity under the pattern is known
        alternatives.append(single)
    for other in alternatives:
        assert error <= expected_prefix_sum_error(other, n, min_separation=b, max_participations=k) * (1 + 1e-9)


def test_an_overlap_whose_optimum_is_the_min_separation_bands_keeps_only_those():
    """With every participation (k = ceil(n / b)) the cone's optimum was the b-band one in every case tried: the
    mechanism then keeps b bands (b - 1 noise vectors of state), and its sensitivity is that of disjoint bands."""
    n, b = 400, 8
    mine = optimize_banded_toeplitz(16, n, min_separation=b)
    assert mine[b:] == [0.0] * 8
    mechanism = BandedMatrixFactorization.optimized(16, steps=n, min_separation=b)
    assert mechanism.bands == b and list(mechanism.coefficients) == pytest.approx(mine[:b], rel=1e-12)
    assert mechanism.sensitivity == pytest.approx(math.sqrt(n // b), rel=1e-12)


def test_with_amplification_the_strategy_is_the_single_participation_optimum():
    mechanism = BandedMatrixFactorization.optimized(8, steps=300, amplified=True)
    assert mechanism.amplified and mechanism.planned_steps is None and mechanism.sensitivity == pytest.approx(1.0)
    assert list(mechanism.coefficients) == pytest.approx(optimize_banded_toeplitz(8, 300), rel=1e-12)
    with pytest.raises(PrivacySettingError, match="amplified=True\\) is accounted by cyclic Poisson sampling, whose "
                                                  "partitions \\(at least bands\\) separate a sample's steps"):
        BandedMatrixFactorization.optimized(8, steps=300, min_separation=10, amplified=True)


def test_the_same_arguments_are_not_optimised_twice():
    first = optimize_banded_toeplitz(5, 77, min_separation=7)
    hits = optimize_banded_toeplitz_cache_info().hits
    assert optimize_banded_toeplitz(5, 77, min_separation=7) == first
    assert optimize_banded_toeplitz_cache_info().hits == hits + 1
    # one participation is one participation, whatever min_separation (>= n) says
    optimize_banded_toeplitz(5, 77)
    hits = optimize_banded_toeplitz_cache_info().hits
    optimize_banded_toeplitz(5, 77, min_separation=100)
    assert optimize_banded_toeplitz_cache_info().hits == hits + 1


def test_what_is_refused():
    with pytest.raises(PrivacySettingError, match="max_participations must be an int >= 1, got 0"):
        optimize_banded_toeplitz(4, 100, min_separation=10, max_participations=0)
    with pytest.raises(PrivacySettingError, match="min_separation must be an int >= 1, got 2.5"):
        pattern_sensitivity([1.0], 10, 2.5)
    with pytest.raises(PrivacySettingError, match="bands must be an int >= 1, got 0"):
        BandedMatrixFactorization.optimized(0, steps=10)
    # trailing zeros reach no row: a mixed-sign strategy padded with them is judged by its real bands
    assert pattern_sensitivity(SKEWED + [0.0] * 4, 40, 4) == pytest.approx(pattern_sensitivity(SKEWED, 40, 4))
