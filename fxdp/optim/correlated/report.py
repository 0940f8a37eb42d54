"""The expected error of a noise mechanism before training: the root-mean-square error of the prefix sums of the
noise, the quantity the strategies minimise, to compare mechanisms at their calibrated noise multipliers.

For ``n`` steps at noise multiplier sigma (noise of the sums of clipped gradients in units of the clipping bound),
the noise's prefix sums ``sum_(s<=t) w_s`` have expected squared norm, per coordinate and summed over ``t``,
``sigma^2 x error``: ``error`` is DP-SGD's ``n (n + 1) / 2`` for independent noise, and the strategy's
``||A C^-1||_F^2 sens^2`` for a normalised correlated one. :func:`prefix_sum_rmse` is ``sigma sqrt(error / n)``,
:func:`error_report` a table of it for several mechanisms. At the same epsilon the mechanisms' sigmas differ (DP-SGD
is amplified by sampling, BLT here is not), so compare the RMSEs, not the errors at equal sigma.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

from fxdp.optim.correlated.banded import BandedMatrixFactorization, expected_prefix_sum_error
from fxdp.optim.correlated.blt import BufferedLinearToeplitz
from fxdp.optim.correlated.mechanism import NoiseMechanism


def prefix_sum_error(mechanism: Optional[NoiseMechanism], steps: int) -> float:
    """The expected total squared error of the ``steps`` prefix sums per unit of noise multiplier (``None``:
    DP-SGD's independent noise). A BLT's is over its planned steps and pattern, which must be ``steps``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"fxdp: steps must be an int >= 1, got {steps!r}")
    if mechanism is None:
        return steps * (steps + 1) / 2
    if isinstance(mechanism, BufferedLinearToeplitz):
        if mechanism.planned_steps != steps:
            raise ValueError(f"fxdp: this BLT was planned for {mechanism.planned_steps} steps, not {steps}: its "
                             "error is defined over its planned steps")
        return mechanism.expected_prefix_sum_error()
    if isinstance(mechanism, BandedMatrixFactorization):
        return expected_prefix_sum_error(mechanism.coefficients, steps)
    raise TypeError(f"fxdp: no expected error for {type(mechanism).__name__}")


def prefix_sum_rmse(mechanism: Optional[NoiseMechanism], noise_multiplier: float, steps: int) -> float:
    """``noise_multiplier * sqrt(prefix_sum_error / steps)``: the RMSE of a prefix sum of the noise, averaged over
    the ``steps`` prefix sums, in units of the clipping bound."""
    return float(noise_multiplier) * math.sqrt(prefix_sum_error(mechanism, steps) / steps)


def error_report(rows: Sequence[Tuple[str, Optional[NoiseMechanism], float]], steps: int) -> str:
    """A table of ``(name, mechanism, noise multiplier)`` rows: sigma and :func:`prefix_sum_rmse` side by side,
    with each RMSE's ratio to the first row's."""
    rmses = [prefix_sum_rmse(mechanism, sigma, steps) for _, mechanism, sigma in rows]
    lines = [f"expected error of the noise over {steps} steps (prefix-sum RMSE, units of the clipping bound)",
             f"{'mechanism':<12s}{'sigma':>10s}{'RMSE':>12s}{'ratio':>8s}"]
    for (name, _, sigma), rmse in zip(rows, rmses):
        lines.append(f"{name:<12s}{sigma:10.3f}{rmse:12.3f}{rmse / rmses[0]:8.2f}")
    return "\n".join(lines)
