"""Group privacy: the ε one example-level guarantee gives a group of ``k`` records (a user's records, when the
unit trained for was the record), for contrast with user-level accounting (docs/user_level.md).

An (ε, δ)-DP mechanism for one record is ``(k ε, k e^{(k-1) ε} δ)``-DP for a group of ``k`` records (the standard
group-privacy property, applied to add/remove neighbours k times). :func:`group_privacy_epsilon` asks the
accountant for ε at several smaller ``δ'`` and returns the smallest ``k ε(δ')`` with
``k e^{(k-1) ε(δ')} δ' <= δ``: a valid bound, and a loose one — which is the point of the comparison: it grows faster than linearly in k."""

from __future__ import annotations

import math

from fxdp.accounting.accountant import Accountant, check_delta

#: the smaller deltas tried, as fractions of delta / k: 10^0, 10^-0.25, ..., 10^-16
_DELTA_STEPS = [10.0 ** (-j / 4) for j in range(65)]


def group_privacy_epsilon(accountant: Accountant, *, delta: float, group_size: int) -> float:
    """The ε at ``delta`` that ``accountant``'s example-level history gives a group of ``group_size`` records, by
    group privacy; ``math.inf`` where no ``δ'`` tried meets ``delta``. ``group_size=1``: the accountant's ε."""
    delta = check_delta(delta)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    k = group_size
    if k == 1:
        return accountant.get_epsilon(delta)
    best = math.inf
    for step in _DELTA_STEPS:
        small = delta / k * step
        eps = accountant.get_epsilon(small)
        if not math.isfinite(eps):
            continue
        exponent = (k - 1) * eps
        if exponent > 700:  # e^{(k-1) ε} overflows: a smaller δ' only makes ε larger
            continue
        if k * math.exp(exponent) * small <= delta:
            best = min(best, k * eps)
    return best
