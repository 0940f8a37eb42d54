"""The expected-error report: each mechanism's prefix-sum RMSE equals the one computed from the explicit matrices
(``sigma ||A C_normalised^-1||_F / sqrt(n)``, A the lower-triangular ones), and the table prints those numbers."""

from __future__ import annotations

import math

import pytest
import torch

from fxdp.optim.correlated import (BandedMatrixFactorization, BufferedLinearToeplitz, banded_toeplitz_matrix,
                                   blt_toeplitz_coefficients, error_report, min_separation_sensitivity,
                                   prefix_sum_rmse)

N = 24


def explicit_rmse(c_normalised, sigma):
    a = torch.tril(torch.ones(N, N, dtype=torch.float64))
    return sigma * float(torch.linalg.norm(a @ torch.linalg.inv(c_normalised))) / math.sqrt(N)


def test_rmse_equals_the_explicit_matrices():
    blt = BufferedLinearToeplitz([0.9, 0.4], [0.3, 0.2], steps=N, min_separation=6)
    coefficients = blt_toeplitz_coefficients(blt.theta, blt.omega, N)
    c = banded_toeplitz_matrix(coefficients.tolist(), N) / min_separation_sensitivity(coefficients, N, 6)
    assert prefix_sum_rmse(blt, 2.0, N) == pytest.approx(explicit_rmse(c, 2.0), rel=1e-9)
    banded = BandedMatrixFactorization(4)
    c = banded_toeplitz_matrix(list(banded.coefficients), N)
    assert prefix_sum_rmse(banded, 1.5, N) == pytest.approx(explicit_rmse(c, 1.5), rel=1e-9)
    assert prefix_sum_rmse(None, 0.7, N) == pytest.approx(explicit_rmse(torch.eye(N, dtype=torch.float64), 0.7))
    with pytest.raises(ValueError, match="planned for 24 steps, not 12"):
        prefix_sum_rmse(blt, 1.0, 12)


def test_the_report_prints_sigma_rmse_and_ratio():
    blt = BufferedLinearToeplitz([0.9], [0.4], steps=N)
    report = error_report([("gaussian", None, 1.0), ("blt", blt, 3.0)], N).splitlines()
    dp_sgd, correlated = prefix_sum_rmse(None, 1.0, N), prefix_sum_rmse(blt, 3.0, N)
    assert report[0] == f"expected error of the noise over {N} steps (prefix-sum RMSE, units of the clipping bound)"
    assert report[2].split() == ["gaussian", "1.000", f"{dp_sgd:.3f}", "1.00"]
    assert report[3].split() == ["blt", "3.000", f"{correlated:.3f}", f"{correlated / dp_sgd:.2f}"]
