"""Noise mechanisms for the DP optimizer beyond independent Gaussian noise (issue 35).

``DPOptimizer(..., noise_mechanism=...)``: ``"gaussian"`` (the default: DP-SGD's independent noise, drawn as
before) or a :class:`NoiseMechanism`; :class:`BandedMatrixFactorization` adds noise correlated over the last
``bands`` steps, :class:`BufferedLinearToeplitz` (BLT) over all past steps with a few buffers of state,
:class:`TreeAggregation` (DP-FTRL's binary tree) with ``log2(steps) + 1`` node noises of state
(docs/correlated_noise.md).
"""

from fxdp.optim.correlated.banded import BandedMatrixFactorization, min_separation_sensitivity_of_banded
from fxdp.optim.correlated.banded_strategy import (banded_toeplitz_matrix, expected_prefix_sum_error, max_column_norm,
                                                   optimize_banded_toeplitz, optimize_banded_toeplitz_cache_info,
                                                   pattern_sensitivity, sqrt_toeplitz_coefficients)
from fxdp.optim.correlated.blt import (BufferedLinearToeplitz, blt_prefix_sum_error, blt_toeplitz_coefficients,
                                       min_separation_sensitivity, optimize_blt)
from fxdp.optim.correlated.mechanism import GAUSSIAN, NoiseMechanism, noise_mechanism_from
from fxdp.optim.correlated.tree import TreeAggregation, tree_matrices, tree_sensitivity
from fxdp.optim.correlated.report import error_report, prefix_sum_error, prefix_sum_rmse

__all__ = ["BandedMatrixFactorization", "BufferedLinearToeplitz", "blt_prefix_sum_error", "blt_toeplitz_coefficients",
           "min_separation_sensitivity", "optimize_blt", "error_report", "prefix_sum_error", "prefix_sum_rmse",
           "GAUSSIAN", "NoiseMechanism", "banded_toeplitz_matrix",
           "expected_prefix_sum_error", "max_column_norm", "noise_mechanism_from", "optimize_banded_toeplitz",
           "sqrt_toeplitz_coefficients", "TreeAggregation", "tree_matrices", "tree_sensitivity",
           "min_separation_sensitivity_of_banded", "optimize_banded_toeplitz_cache_info", "pattern_sensitivity"]
