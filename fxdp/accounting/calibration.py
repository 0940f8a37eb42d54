"""Calibrating the noise multiplier: the noise that spends a target ε over a training run."""

from __future__ import annotations

import math
from typing import Optional

from fxdp.accounting.accountant import check_delta, check_num_steps, check_sample_rate
from fxdp.accounting.registry import create_accountant

# Noise multipliers far outside anything DP-SGD uses: the search gives up beyond them.
_SIGMA_MIN = 2.0 ** -20
_SIGMA_MAX = 2.0 ** 20
_FIRST_TOP = 20.0  # the first top of the bracket, Opacus's, so that both searches visit the same points
_MAX_BISECTIONS = 200  # each halves the bracket: far more than a float64 bracket can be halved


def steps_in_epochs(epochs: float, sample_rate: float) -> int:
    """The number of steps in ``epochs`` epochs of ``1 / sample_rate`` steps each, rounded up (a partial
    step spends privacy too). A quotient within floating-point error of a whole number is that number:
    with 93 batches an epoch, ``1 / (1 / 93)`` is 92.99999999999999, and ``int`` of it would calibrate for
    one step fewer than the loader yields."""
    quotient = epochs / sample_rate
    nearest = round(quotient)
    if abs(quotient - nearest) <= 1e-9 * max(1.0, quotient):
        return int(nearest)
    return math.ceil(quotient)


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
) -> float:
    """The noise multiplier whose ``steps`` Poisson-subsampled Gaussian steps spend ε in
    ``[target_epsilon - epsilon_tolerance, target_epsilon]`` at ``target_delta``: ``epsilon_tolerance`` is
    an absolute tolerance on ε, as Opacus documents it (so for a target under 1 the default 0.01 is more than
    1%: pass a smaller one there).

    Give ``steps``, or ``epochs`` (then ``steps = steps_in_epochs(epochs, sample_rate)``, the
    ``epochs / sample_rate`` steps rounded up, so that the steps taken never outnumber those calibrated
    for). ε falls as the noise grows, so the noise multiplier is found by bisection: the top of the bracket
    ``[0, 20]`` is doubled until it spends at most the target, then the bracket is halved at its midpoint
    until its top spends within the tolerance. That is Opacus's search, so where the two accountants agree
    the same target gives the same noise multiplier as on Opacus (and the same training). The one returned
    never spends more than the target.
    """
    delta, q, steps = _checked_request(target_epsilon, target_delta, sample_rate, steps, epochs, epsilon_tolerance)
    create_accountant(accountant)  # an unknown name or a missing package fails here, once

    def epsilon(sigma: float) -> float:
        acc = create_accountant(accountant)
        acc.history = [(sigma, q, steps)]
        return acc.get_epsilon(delta)

    # The bracket [low, high]: epsilon(high) <= target, and epsilon(low) >= target (low = 0: no noise).
    low, high, eps_high = 0.0, _FIRST_TOP / 2, math.inf
    while eps_high > target_epsilon:
        high *= 2
        if high > _SIGMA_MAX:
            raise ValueError(
                f"target_epsilon={target_epsilon} is out of reach: even noise_multiplier={_SIGMA_MAX:g} "
                f"spends more over {steps} steps at sample_rate={q}, target_delta={delta}; "
                f"raise target_epsilon or target_delta, or train fewer steps"
            )
        eps_high = epsilon(high)
    for _ in range(_MAX_BISECTIONS):
        if target_epsilon - eps_high <= epsilon_tolerance:
            return high
        middle = (low + high) / 2
        if middle < _SIGMA_MIN:
            raise ValueError(
                f"target_epsilon={target_epsilon} is so large that even noise_multiplier={_SIGMA_MIN:g} "
                f"spends less than target_epsilon - epsilon_tolerance over {steps} steps at sample_rate={q}, "
                f"target_delta={delta}; no noise multiplier lands within {epsilon_tolerance:g} below it"
            )
        if not low < middle < high:
            break
        eps_middle = epsilon(middle)
        if eps_middle < target_epsilon:
            high, eps_high = middle, eps_middle
        else:
            low = middle
    raise ValueError(
        f"no noise multiplier spends epsilon within {epsilon_tolerance:g} below target_epsilon="
        f"{target_epsilon} (epsilon jumps from above the target to {eps_high:.6g} at noise_multiplier="
        f"{high:.6g}); use a larger epsilon_tolerance"
    )


def _checked_request(target_epsilon, target_delta, sample_rate, steps, epochs, epsilon_tolerance) -> tuple:
    """:func:`get_noise_multiplier`'s arguments checked: ``(delta, sample_rate, steps)``, the steps counted from
    ``epochs`` when those are given."""
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)):
        raise ValueError(f"target_epsilon must be a number > 0, got {target_epsilon!r}")
    if not (0 < target_epsilon < math.inf):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    delta = check_delta(target_delta)
    q = check_sample_rate(sample_rate)
    if q == 0:
        raise ValueError(
            "sample_rate is 0: no step ever uses an example, so any noise multiplier spends epsilon = 0; "
            "there is nothing to calibrate"
        )
    if isinstance(epsilon_tolerance, bool) or not isinstance(epsilon_tolerance, (int, float)) \
            or not 0 < epsilon_tolerance < math.inf:
        raise ValueError(f"epsilon_tolerance (an absolute tolerance on epsilon) must be a finite number > 0, "
                         f"got {epsilon_tolerance!r}")
    if (steps is None) == (epochs is None):
        raise ValueError(
            f"give exactly one of steps and epochs (got steps={steps!r}, epochs={epochs!r})"
        )
    if epochs is not None:
        if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
            raise ValueError(f"epochs must be a number > 0, got {epochs!r}")
        steps = steps_in_epochs(epochs, q)
        name = f"steps = ceil(epochs / sample_rate) = ceil({epochs} / {q})"
    else:
        name = "steps"
    steps = check_num_steps(steps, name)
    if steps == 0:
        raise ValueError(f"{name} is 0: there is no training step to calibrate the noise for")
    return delta, q, steps
