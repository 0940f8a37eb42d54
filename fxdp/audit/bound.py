"""The statistics of one-run privacy auditing (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1)
Training Run", NeurIPS 2023), written with ``math`` alone.

The experiment: ``m`` canaries, each included in training independently with probability 1/2. After
training the auditor guesses "in" for some canaries and "out" for others, abstaining on the rest:
``r`` guesses, ``v`` of them right. If training is (eps, delta)-DP, the paper's Section 5 bounds how
likely ``v`` or more right guesses are; :func:`p_value` is that bound, in the computable form of the
paper's Appendix D:

    q     = e^eps / (1 + e^eps)                      (the accuracy of eps-DP randomised response)
    beta  = P[Binomial(r, q) >= v]
    alpha = max over i in 1..v of  P[v - i <= Binomial(r, q) < v] / i
    p     = min(1, beta + 2 m delta alpha)

An eps whose p-value falls below ``1 - confidence`` is rejected; :func:`epsilon_lower_bound` returns
the largest rejected eps (by bisection, rounding down), so ``P[bound > true eps] <= 1 - confidence``.

Choosing how many guesses to make after seeing the scores is itself a test per choice;
:func:`best_guesses` tries a fixed grid of (positive, negative) guess counts and splits the
confidence over the grid (Bonferroni), so the bound it returns keeps the stated confidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

# --------------------------------------------------------------------------- binomial tails in log space


def _log_q(eps: float) -> Tuple[float, float]:
    """log q and log(1 - q) for q = e^eps / (1 + e^eps), stable for any eps >= 0."""
    log1p_exp_neg = math.log1p(math.exp(-eps))
    return -log1p_exp_neg, -(eps + log1p_exp_neg)


def binomial_log_pmf(k: int, n: int, log_p: float, log_1mp: float) -> float:
    """log P[Binomial(n, p) = k], with p given as its logarithms (so p close to 1 keeps its precision)."""
    if k < 0 or k > n:
        return -math.inf
    log_choose = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    # 0 * log(0) is 0: P[Bin(n, 1) = n] = 1
    return log_choose + (k * log_p if k else 0.0) + ((n - k) * log_1mp if n - k else 0.0)


def _log_sum_exp(values: Sequence[float]) -> float:
    top = max(values, default=-math.inf)
    if top == -math.inf:
        return -math.inf
    return top + math.log(math.fsum(math.exp(x - top) for x in values))


def binomial_tail(v: int, n: int, p: float) -> float:
    """P[Binomial(n, p) >= v], summed in log space."""
    if v <= 0:
        return 1.0
    if v > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_1mp = math.log(p), math.log1p(-p)
    return min(1.0, math.exp(_log_sum_exp([binomial_log_pmf(k, n, log_p, log_1mp) for k in range(v, n + 1)])))


# --------------------------------------------------------------------------- the paper's p-value and bound


def _check_counts(m: int, r: int, v: int, delta: float) -> None:
    if not (isinstance(m, int) and isinstance(r, int) and isinstance(v, int)):
        raise TypeError(f"fxdp.audit: m, r, v must be integers, got m={m!r}, r={r!r}, v={v!r}")
    if not 0 <= v <= r <= m:
        raise ValueError(f"fxdp.audit: need 0 <= correct guesses v <= guesses r <= canaries m, "
                         f"got v={v}, r={r}, m={m}")
    if not 0.0 <= delta <= 1.0:
        raise ValueError(f"fxdp.audit: delta must lie in [0, 1], got {delta}")


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The probability bound, under (epsilon, delta)-DP, of ``v`` or more right guesses out of ``r``
    with ``m`` canaries (Steinke et al. 2023, Section 5, in the form of their Appendix D)."""
    _check_counts(m, r, v, delta)
    if epsilon < 0:
        raise ValueError(f"fxdp.audit: epsilon must be >= 0, got {epsilon}")
    log_q, log_1mq = _log_q(epsilon)
    log_pmf = [binomial_log_pmf(k, r, log_q, log_1mq) for k in range(r + 1)]
    beta = math.exp(_log_sum_exp(log_pmf[v:])) if v > 0 else 1.0
    if delta == 0.0:
        return min(1.0, beta)
    # alpha: the largest average, over the i values just below v, of the mass P[v-i <= Bin < v].
    alpha, below = 0.0, 0.0
    for i in range(1, v + 1):
        below += math.exp(log_pmf[v - i])
        alpha = max(alpha, below / i)
    return min(1.0, beta + alpha * delta * 2 * m)


def epsilon_lower_bound(m: int, r: int, v: int, *, delta: float, confidence: float = 0.95,
                        tolerance: float = 1e-6) -> float:
    """The largest eps that ``v`` right guesses out of ``r`` (``m`` canaries) reject at ``confidence``:
    if the run is (eps', delta)-DP, the bound exceeds eps' with probability at most ``1 - confidence``.
    Bisection keeps ``p_value(eps) < 1 - confidence`` at the returned value (it rounds down); 0 when
    nothing is rejected."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"fxdp.audit: confidence must lie strictly between 0 and 1, got {confidence}")
    level = 1.0 - confidence
    _check_counts(m, r, v, delta)
    if p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < level:  # v right out of r is likely for eps large enough
        low, high = high, 2.0 * high
    while high - low > tolerance:
        mid = 0.5 * (low + high)
        if p_value(m, r, v, mid, delta) < level:
            low = mid
        else:
            high = mid
    return low


# --------------------------------------------------------------------------- guesses from scores


def guess_grid(m: int) -> List[Tuple[int, int]]:
    """The (positive, negative) guess counts :func:`best_guesses` tries: ``k`` in for the highest
    scores, with ``k`` one of 5%, 10%, 20%, 40% of ``m``, and either no "out" guesses or ``k`` of them
    for the lowest scores. Eight pairs, fixed before the scores are seen; each costs a share of the
    confidence, so the grid is small: on simulated DP-SGD gradient canaries it keeps 85-90% of the
    bound that the best pair, picked in hindsight without paying for the choice, would claim."""
    sides = sorted({max(1, round(f * m)) for f in (0.05, 0.1, 0.2, 0.4)})
    return [(k, 0) for k in sides] + [(k, k) for k in sides if 2 * k <= m]


@dataclass(frozen=True)
class Guesses:
    """The auditor's best choice: ``positives`` guessed in (highest scores), ``negatives`` guessed out
    (lowest scores), ``correct`` of them right, and the bound that choice gives."""

    positives: int
    negatives: int
    correct: int
    epsilon_lower: float

    @property
    def guesses(self) -> int:
        return self.positives + self.negatives


def best_guesses(scores: Sequence[float], members: Sequence[bool], *, delta: float, confidence: float = 0.95,
                 grid: Optional[List[Tuple[int, int]]] = None) -> Guesses:
    """Guess "in" for the highest scores and "out" for the lowest, for every count pair in ``grid``
    (default :func:`guess_grid`), and keep the pair with the highest lower bound (the first pair when
    none rejects any eps). Each pair is tested at
    level ``(1 - confidence) / len(grid)``, so the maximum holds at ``confidence`` (union bound).

    Ties are broken by canary index, which is independent of membership, so the guesses stay a
    function of the training output alone."""
    scores, members = list(map(float, scores)), list(map(bool, members))
    m = len(scores)
    if m != len(members):
        raise ValueError(f"fxdp.audit: {m} scores but {len(members)} membership bits")
    if m == 0:
        raise ValueError("fxdp.audit: no canaries to score")
    if any(math.isnan(s) for s in scores):
        raise ValueError("fxdp.audit: a canary's score is NaN (did training diverge?)")
    grid = guess_grid(m) if grid is None else list(grid)
    order = sorted(range(m), key=lambda j: (-scores[j], j))  # most confidently "in" first
    # correct_top[k]: members among the k highest; correct_bottom[k]: non-members among the k lowest
    correct_top, correct_bottom = [0], [0]
    for j in order:
        correct_top.append(correct_top[-1] + members[j])
    for j in reversed(order):
        correct_bottom.append(correct_bottom[-1] + (not members[j]))
    per_test = 1.0 - (1.0 - confidence) / len(grid)
    best = None
    for kp, kn in grid:
        if kp + kn > m:
            raise ValueError(f"fxdp.audit: {kp} + {kn} guesses for {m} canaries")
        v = correct_top[kp] + correct_bottom[kn]
        eps = epsilon_lower_bound(m, kp + kn, v, delta=delta, confidence=per_test)
        if best is None or eps > best.epsilon_lower:  # ties: the earlier pair of the grid
            best = Guesses(kp, kn, v, eps)
    if best is None:
        raise ValueError("fxdp.audit: an empty grid of guess counts")
    return best


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class AuditResult:
    """One audit: the empirical lower bound on eps next to the accountant's claim for the same run."""

    epsilon_lower: float
    epsilon_claimed: float
    guesses: int
    correct: int
    canaries: int
    delta: float
    confidence: float
    positives: int = 0  # of the guesses, how many said "in"
    canary: str = "gradient"

    @property
    def consistent(self) -> bool:
        """False when the audit proves more leakage than the accountant allows: a bug somewhere."""
        return self.epsilon_lower <= self.epsilon_claimed

    def __str__(self) -> str:
        verdict = ("consistent: the lower bound does not exceed the claim" if self.consistent else
                   "VIOLATION: the run leaks more than the accountant claims (clipping, noise or sampling bug?)")
        return (
            f"privacy audit ({self.canary} canaries, one run)\n"
            f"  epsilon lower bound  {self.epsilon_lower:.3f}   "
            f"(confidence {self.confidence:.0%}, delta {self.delta:g})\n"
            f"  epsilon claimed      {self.epsilon_claimed:.3f}   (the accountant, same delta)\n"
            f"  guesses              {self.correct} of {self.guesses} right "
            f"({self.positives} in, {self.guesses - self.positives} out) among {self.canaries} canaries\n"
            f"  {verdict}"
        )


__all__ = ["AuditResult", "Guesses", "best_guesses", "binomial_tail", "epsilon_lower_bound", "guess_grid",
           "p_value"]
