"""Gaussian-DP accounting by the central limit theorem (Bu, Dong, Long, Su 2020, "Deep learning with
Gaussian differential privacy"), pure ``math``: accepted for code written for Opacus's ``"gdp"``.

What it computes. ``T`` Poisson-subsampled Gaussian steps (rate ``q``, noise multiplier ``sigma``) are,
as ``T`` grows with ``q * sqrt(T)`` fixed, asymptotically ``mu``-GDP with

    mu = q * sqrt(T * (exp(1 / sigma^2) - 1)),

and entries of a history compose as ``mu^2 = sum_k mu_k^2``. ``mu``-GDP is (ε, δ)-DP for every ε with
``delta(eps) = Phi(-eps / mu + mu / 2) - exp(eps) * Phi(-eps / mu - mu / 2)`` (their Corollary 2.13),
solved for ε by bisection (``delta`` falls as ε grows).

An approximation, not a bound: for few steps or a large sample rate it can report less than the ε
actually spent, which is why fxdp never uses it unless asked, and says so once when it reports.
"""

from __future__ import annotations

import math
import warnings

from fxdp.accounting.accountant import Accountant, check_delta


def _phi(x: float) -> float:
    """The standard normal CDF."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def mu_of_history(history) -> float:
    """The CLT's ``mu`` of a history of ``(sigma, q, steps)`` (``inf`` when a spending step had no noise)."""
    total = 0.0
    for sigma, q, steps in history:
        if q == 0 or steps == 0:
            continue
        if sigma == 0:
            return math.inf
        exponent = 1.0 / (sigma * sigma)
        if exponent > 700:  # exp overflows: so little noise that nothing is hidden
            return math.inf
        total += q * q * steps * math.expm1(exponent)
    return math.sqrt(total)


def delta_of_gdp(mu: float, epsilon: float) -> float:
    """The δ at which ``mu``-GDP is (``epsilon``, δ)-DP."""
    return _phi(-epsilon / mu + mu / 2) - math.exp(epsilon) * _phi(-epsilon / mu - mu / 2)


def epsilon_of_gdp(mu: float, delta: float) -> float:
    """The smallest ε with ``delta_of_gdp(mu, ε) <= delta``."""
    if mu == 0:
        return 0.0
    if mu == math.inf:
        return math.inf
    if delta_of_gdp(mu, 0.0) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while delta_of_gdp(mu, high) > delta:
        low, high = high, 2 * high
        if high > 1e6:
            return math.inf
    for _ in range(200):  # bisection to the float's precision
        middle = (low + high) / 2
        if not low < middle < high:
            break
        if delta_of_gdp(mu, middle) > delta:
            low = middle
        else:
            high = middle
    return high


class GDPAccountant(Accountant):
    """The central-limit Gaussian-DP approximation (``"gdp"``); warns once that it is not a bound."""

    mechanism = "gdp"
    is_bound = False

    def __init__(self) -> None:
        super().__init__()
        self._warned = False

    def get_epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        if not self._warned:
            self._warned = True
            warnings.warn(
                "fxdp: the 'gdp' accountant is a central-limit approximation, not a bound: with few steps or a "
                "large sample rate it can report less than the privacy spent. The default accountant ('pld') "
                "reports a bound", stacklevel=2)
        return epsilon_of_gdp(mu_of_history(self.history), delta)
