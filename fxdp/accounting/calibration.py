"""Calibrating the noise multiplier: the noise that spends a target ε over a training run."""

from __future__ import annotations

import math
from typing import Optional

from fxdp.accounting.accountant import check_delta, check_num_steps, check_sample_rate
from fxdp.accounting.registry import create_accountant

# Noise multipliers tried while looking for a bracket: far outside anything DP-SGD uses.
_SIGMA_MIN = 2.0 ** -20
_SIGMA_MAX = 2.0 ** 20
_MAX_BISECTIONS = 300  # each shrinks the bracket by at least 10% (of log sigma)


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
    ``[(1 - epsilon_tolerance) * target_epsilon, target_epsilon]`` at ``target_delta``.

    Give ``steps``, or ``epochs`` (then ``steps = steps_in_epochs(epochs, sample_rate)``, the
    ``epochs / sample_rate`` steps rounded up, so that the steps taken never outnumber those calibrated
    for). ε falls as the noise grows, so the noise multiplier is found by bisection (split points
    interpolated); the one returned never spends more than the target.
    """
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
    if not 0 < epsilon_tolerance < 1:
        raise ValueError(f"epsilon_tolerance must lie in (0, 1), got {epsilon_tolerance!r}")
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
    create_accountant(accountant)  # an unknown name or a missing package fails here, once

    spent = {}  # sigma -> epsilon: each evaluation of the PLD accountant takes seconds

    def epsilon(sigma: float) -> float:
        if sigma not in spent:
            acc = create_accountant(accountant)
            acc.history = [(sigma, q, steps)]
            spent[sigma] = acc.get_epsilon(delta)
        return spent[sigma]

    # Bracket the answer: epsilon(low) > target >= epsilon(high).
    high = 1.0
    while epsilon(high) > target_epsilon:
        high *= 2
        if high > _SIGMA_MAX:
            raise ValueError(
                f"target_epsilon={target_epsilon} is out of reach: even noise_multiplier={_SIGMA_MAX:g} "
                f"spends more over {steps} steps at sample_rate={q}, target_delta={delta}; "
                f"raise target_epsilon or target_delta, or train fewer steps"
            )
    low = high / 2
    while epsilon(low) <= target_epsilon:
        high, low = low, low / 2
        if low < _SIGMA_MIN:
            raise ValueError(
                f"target_epsilon={target_epsilon} is so large that even noise_multiplier={_SIGMA_MIN:g} "
                f"spends less over {steps} steps at sample_rate={q}, target_delta={delta}; "
                f"no noise multiplier lands within {epsilon_tolerance * 100:g}% below it"
            )

    # Shrink the bracket until epsilon(high) lands in [floor, target]. Each split point interpolates
    # log(epsilon) linearly in log(sigma) towards the middle of that window (the curve is nearly a
    # line there, so a few evaluations suffice: each is slow with the PLD accountant), kept in the
    # inner 80% of the bracket so that the bracket always shrinks, as in plain bisection.
    floor = (1 - epsilon_tolerance) * target_epsilon
    aim = math.log((floor + target_epsilon) / 2)
    eps_low, eps_high = epsilon(low), epsilon(high)
    for _ in range(_MAX_BISECTIONS):
        if eps_high >= floor:
            return high
        log_low, log_high = math.log(low), math.log(high)
        if eps_low == math.inf or eps_high == 0:
            split = 0.5
        else:
            split = (math.log(eps_low) - aim) / (math.log(eps_low) - math.log(eps_high))
        middle = math.exp(log_low + min(max(split, 0.1), 0.9) * (log_high - log_low))
        if not low < middle < high:
            break
        eps_middle = epsilon(middle)
        if eps_middle > target_epsilon:
            low, eps_low = middle, eps_middle
        else:
            high, eps_high = middle, eps_middle
    raise ValueError(
        f"no noise multiplier spends epsilon within {epsilon_tolerance * 100:g}% below target_epsilon="
        f"{target_epsilon} (epsilon jumps from above the target to {eps_high:.6g} at noise_multiplier="
        f"{high:.6g}); use a larger epsilon_tolerance"
    )
