"""Banded MF against jax_privacy (optional: ``pip install "fxdp[test-jax-privacy]"``; skipped without it): for the
same banded Toeplitz strategy, the same single-participation sensitivity and expected prefix-sum error to 1e-6
relative, and fxdp's optimised strategy's error within 1% of (or below) jax_privacy's optimised one."""

from __future__ import annotations

import pytest

from fxdp.optim.correlated import (expected_prefix_sum_error, max_column_norm, optimize_banded_toeplitz,
                                   sqrt_toeplitz_coefficients)

toeplitz = pytest.importorskip("jax_privacy.matrix_factorization.toeplitz")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


@pytest.fixture(autouse=True, scope="module")
def float64():
    jax.config.update("jax_enable_x64", True)


@pytest.mark.parametrize("bands, n", [(1, 50), (4, 100), (4, 3), (16, 1000), (64, 2000)])
@pytest.mark.parametrize("strategy", ["sqrt", "skewed"])
def test_sensitivity_and_expected_error_equal_jax_privacys(bands, n, strategy):
    coefficients = sqrt_toeplitz_coefficients(bands)
    if strategy == "skewed":  # any other banded Toeplitz strategy
        coefficients = [c * (1 + 0.3 * (-1) ** k) for k, c in enumerate(coefficients)]
    coef = jnp.asarray(coefficients, dtype=jnp.float64)
    assert max_column_norm(coefficients, n) ** 2 == pytest.approx(float(toeplitz.sensitivity_squared(coef, n)),
                                                                  rel=1e-6)
    # jax_privacy's loss is the mean over the n prefix sums of their squared error, times the sensitivity squared
    assert expected_prefix_sum_error(coefficients, n) == pytest.approx(float(toeplitz.loss(coef, n)) * n, rel=1e-6)


@pytest.mark.parametrize("bands, n", [(4, 256), (16, 1000)])
def test_the_optimised_strategy_is_within_one_percent_of_jax_privacys(bands, n):
    theirs = [float(c) for c in toeplitz.optimize_banded_toeplitz(n, bands)]
    ours = optimize_banded_toeplitz(bands, n)
    assert expected_prefix_sum_error(ours, n) <= 1.01 * expected_prefix_sum_error(theirs, n)
