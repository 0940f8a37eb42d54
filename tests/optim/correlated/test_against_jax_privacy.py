"""Banded MF and BLT against jax_privacy (optional: ``pip install "fxdp[test-jax-privacy]"``; skipped without it):
for the same banded Toeplitz (or BLT) strategy, the same sensitivity (single participation; min-separation for BLT)
and expected prefix-sum error to 1e-6 relative, and fxdp's optimised strategy's error within 1% of (or below)
jax_privacy's optimised one."""

from __future__ import annotations

import pytest

from fxdp.optim.correlated import (banded_toeplitz_matrix, expected_prefix_sum_error, max_column_norm,
                                   optimize_banded_toeplitz,
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


# -- BLT (buffered linear Toeplitz) against jax_privacy.matrix_factorization.buffered_toeplitz ----------------------

BLTS = [([0.99, 0.9, 0.5], [0.1, 0.2, 0.15]), ([0.95], [0.6]), ([0.999, 0.7, 0.3, 0.05], [0.05, 0.25, 0.2, 0.1])]


@pytest.mark.parametrize("theta, omega", BLTS)
@pytest.mark.parametrize("n, min_sep", [(100, 100), (100, 10), (200, 7), (50, 1), (64, 63)])
def test_blt_sensitivity_and_expected_error_equal_jax_privacys(theta, omega, n, min_sep):
    from fxdp.optim.correlated import blt_prefix_sum_error, blt_toeplitz_coefficients, min_separation_sensitivity
    bt = pytest.importorskip("jax_privacy.matrix_factorization.buffered_toeplitz")
    blt = bt.BufferedToeplitz.build(theta, omega)
    coef = blt.toeplitz_coefs(n)
    ours = blt_toeplitz_coefficients(theta, omega, n)
    assert ours.tolist() == pytest.approx([float(c) for c in coef], rel=1e-12)
    assert float(min_separation_sensitivity(ours, n, min_sep)) ** 2 == pytest.approx(
        float(toeplitz.minsep_sensitivity_squared(coef, min_sep=min_sep, n=n)), rel=1e-6)
    # jax_privacy's min-sep loss: the mean over the n prefix sums of their squared error times the sensitivity^2
    theirs = float(bt.LossFn.build_min_sep(n, error="mean", min_sep=min_sep).loss(blt))
    assert blt_prefix_sum_error(theta, omega, n, min_separation=min_sep) == pytest.approx(theirs * n, rel=1e-6)
    theirs_max = float(bt.LossFn.build_min_sep(n, error="max", min_sep=min_sep).loss(blt))
    assert blt_prefix_sum_error(theta, omega, n, min_separation=min_sep, error="max") == pytest.approx(theirs_max,
                                                                                                     rel=1e-6)


@pytest.mark.parametrize("buffers, n, min_sep", [(3, 256, None), (4, 512, 64)])
def test_the_optimised_blt_is_within_one_percent_of_jax_privacys(buffers, n, min_sep):
    from fxdp.optim.correlated import blt_prefix_sum_error, optimize_blt
    bt = pytest.importorskip("jax_privacy.matrix_factorization.buffered_toeplitz")
    theirs = bt.optimize(n=n, min_sep=min_sep or n, max_participations=None, error="mean", min_buffers=buffers,
                         max_buffers=buffers)
    theta, omega = optimize_blt(buffers, n, min_separation=min_sep)
    mine = blt_prefix_sum_error(theta, omega, n, min_separation=min_sep)
    reference = blt_prefix_sum_error([float(t) for t in theirs.buf_decay], [float(w) for w in theirs.output_scale], n,
                                     min_separation=min_sep)
    assert mine <= 1.01 * reference


# -- banded MF without amplification (min-separation) and tree aggregation against jax_privacy's sensitivities -----


@pytest.mark.parametrize("n, min_sep", [(100, 4), (100, 16), (1000, 64), (250, 7), (64, 64), (64, 2)])
def test_banded_min_separation_sensitivity_equals_jax_privacys(n, min_sep):
    from fxdp.optim.correlated import BandedMatrixFactorization
    sensitivity = pytest.importorskip("jax_privacy.matrix_factorization.sensitivity")
    for coefficients in (sqrt_toeplitz_coefficients(4), sqrt_toeplitz_coefficients(16)):
        if min_sep < len(coefficients):  # overlapping bands: non-increasing coefficients, their Theorem 2 form
            ours = BandedMatrixFactorization(coefficients=coefficients, steps=n, min_separation=min_sep)
            theirs = float(toeplitz.minsep_sensitivity_squared(jnp.asarray(ours.coefficients), min_sep, n=n))
            assert ours.sensitivity ** 2 == pytest.approx(theirs, rel=1e-6)
    # any signs, bands that do not overlap: their sensitivity of the explicit matrix C
    skewed = [c * (1 + 0.3 * (-1) ** k) for k, c in enumerate(sqrt_toeplitz_coefficients(4))]
    if min_sep >= len(skewed):
        ours = BandedMatrixFactorization(coefficients=skewed, steps=n, min_separation=min_sep)
        C = jnp.asarray(banded_toeplitz_matrix(ours.coefficients, n).numpy())
        assert ours.sensitivity == pytest.approx(float(sensitivity.get_sensitivity_banded(C, min_sep)), rel=1e-6)


@pytest.mark.parametrize("n", [1, 7, 64, 100, 1000])
def test_tree_single_participation_sensitivity_equals_jax_privacys(n):
    from fxdp.optim.correlated import tree_matrices, tree_sensitivity
    sensitivity = pytest.importorskip("jax_privacy.matrix_factorization.sensitivity")
    C = jnp.asarray(tree_matrices(n)[0].numpy())
    assert tree_sensitivity(n) == pytest.approx(float(sensitivity.single_participation_sensitivity(C)), rel=1e-6)


@pytest.mark.parametrize("n, min_sep", [(64, 8), (96, 32), (120, 10), (128, 1)])
def test_tree_min_separation_bound_is_jax_privacys_and_covers_its_fixed_epoch_sensitivity(n, min_sep):
    """fxdp's bound is jax_privacy's min-separation upper bound (Algorithm 4 of Choquette-Choo et al. 2023) on the
    explicit tree matrix, or below it (the closed form). Fixed-epoch participation (steps j, j + b, ..) is one
    min-separation pattern per j: jax_privacy's exact sensitivity under it is a lower bound of the min-separation
    maximum, which fxdp's bound must cover."""
    from fxdp.optim.correlated import tree_matrices, tree_sensitivity
    sensitivity = pytest.importorskip("jax_privacy.matrix_factorization.sensitivity")
    C = jnp.asarray(tree_matrices(n)[0].numpy())
    lower = float(sensitivity.fixed_epoch_sensitivity(C, n // min_sep))
    ours = tree_sensitivity(n, min_sep)
    assert ours >= lower * (1 - 1e-9)
    assert ours == pytest.approx(float(sensitivity.get_min_sep_sensitivity_upper_bound(C, min_sep)), rel=1e-6)


# -- banded MF strategies under k participations b apart (fxdp.optim.correlated.banded_strategy) ------------------


def their_pattern_loss(coefficients, n, b, k):
    """jax_privacy's expected total squared error under (k, b) participation: the mean over the n prefix sums of
    their squared error (``toeplitz.per_query_error``) times n, times ``toeplitz.minsep_sensitivity_squared``
    (which checks the coefficients are non-negative and non-increasing, where it holds for overlapping bands; for
    bands <= b, the columns' supports are disjoint and its sum of the columns 0, b, .. holds for any signs, as its
    ``sensitivity.get_sensitivity_banded`` of the explicit matrix says: the check is skipped there)."""
    coef = jnp.asarray(coefficients, dtype=jnp.float64)
    error = jnp.mean(toeplitz.per_query_error(strategy_coef=coef, n=n)) * n
    disjoint = len(coefficients) <= b
    return float(error * toeplitz.minsep_sensitivity_squared(coef, b, k, n=n, skip_checks=disjoint))


@pytest.mark.parametrize("n, b, k", [(100, 4, None), (100, 4, 7), (1000, 64, 5), (250, 7, None), (64, 2, 3),
                                     (300, 30, 2), (90, 30, None)])
def test_sensitivity_and_error_under_k_participations_equal_jax_privacys(n, b, k):
    from fxdp.optim.correlated import pattern_sensitivity
    sensitivity = pytest.importorskip("jax_privacy.matrix_factorization.sensitivity")
    for coefficients in (sqrt_toeplitz_coefficients(4), sqrt_toeplitz_coefficients(16)):  # overlapping or not
        coef = jnp.asarray(coefficients, dtype=jnp.float64)
        theirs = float(toeplitz.minsep_sensitivity_squared(coef, b, k, n=n))
        assert pattern_sensitivity(coefficients, n, b, k) ** 2 == pytest.approx(theirs, rel=1e-6)
        assert expected_prefix_sum_error(coefficients, n, min_separation=b, max_participations=k) == pytest.approx(
            their_pattern_loss(coefficients, n, b, k), rel=1e-6)
    # any signs where the bands do not overlap: their exact sensitivity of the explicit (min_sep-banded) matrix
    skewed = [c * (1 + 0.3 * (-1) ** j) for j, c in enumerate(sqrt_toeplitz_coefficients(4))]
    if b >= len(skewed):
        C = jnp.asarray(banded_toeplitz_matrix(skewed, n).numpy())
        assert pattern_sensitivity(skewed, n, b, k) == pytest.approx(
            float(sensitivity.get_sensitivity_banded(C, b, k)), rel=1e-6)


@pytest.mark.parametrize("bands, n, b, k", [(4, 256, 64, None), (16, 1000, 100, 3), (16, 100, 30, None),
                                            (16, 1000, 8, None), (32, 1000, 10, None), (16, 1000, 8, 5)])
def test_the_strategy_optimised_for_a_pattern_is_within_one_percent_of_jax_privacys(bands, n, b, k):
    """jax_privacy optimises banded Toeplitz strategies for one participation (``toeplitz.optimize_banded_toeplitz``),
    to be used under several (post hoc, its docstring says) or with bands <= min_sep (its recommendation): the
    reference is the better of the two under the pattern, by jax_privacy's own loss."""
    ours = optimize_banded_toeplitz(bands, n, min_separation=b, max_participations=k)
    candidates = [toeplitz.optimize_banded_toeplitz(n, bands)]
    if b < bands:
        candidates.append(jnp.concatenate([toeplitz.optimize_banded_toeplitz(n, b), jnp.zeros(bands - b)]))
    reference = min(their_pattern_loss(c, n, b, k) for c in candidates)
    assert their_pattern_loss(ours, n, b, k) <= 1.01 * reference
