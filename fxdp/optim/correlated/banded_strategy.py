"""Banded Toeplitz strategies for banded MF (:mod:`.banded`): their sensitivity under a participation pattern, their
expected error, and the strategy optimised for a number of steps, bands and participation pattern.

A strategy is ``C``, ``n x n`` lower-triangular Toeplitz with ``m`` bands: ``C[t, s] = c_(t-s)`` for ``0 <= t - s <
m``. Training on ``X + C^-1 Z`` releases ``C X + Z``; the model sees the prefix sums ``A (X + C^-1 Z)`` (``A`` the
lower-triangular ones), whose noise has expected total squared error ``sigma^2 ||A C^-1||_F^2`` per coordinate.

**Participation patterns.** A sample takes part in at most ``k`` of the ``n`` steps, any two of them ``b`` or more
apart (``(k, b)`` min-separation participation; ``k <= ceil(n / b)``, the default being that bound). Its sensitivity
is the largest norm of a sum of ``C``'s columns over such a set of steps ``S``: ``sens^2 = max_S ||sum_(s in S)
C e_s||^2``. Column ``s`` holds ``c_0 .. c_(m-1)`` in rows ``s .. s + m - 1``, cut at row ``n``. Fixed-epoch
participation (steps ``j, j + b, j + 2 b, ..``, what make_private's fixed-epoch loader does) is one such set per
``j``; in both cases below its ``j = 0`` set is the maximiser, so the two patterns have the same sensitivity.

1. ``m <= b`` (or ``k = 1``): two steps ``b`` apart reach disjoint rows, so ``||sum||^2`` is the sum of the
   columns' squared norms, for any coefficients. A column's norm does not grow with ``s`` (only its cut grows), so
   the earliest, densest set ``0, b, .., (k-1) b`` is a maximiser::

       sens^2 = sum_(i < k) sum_(j < min(m, n - i b)) c_j^2     = k ||c||^2   when (k-1) b + m <= n (no column cut)

   Without a cut the objective below is ``k`` times the single-participation one: **the optimum is the
   single-participation strategy**, the normalised strategy's (``||c|| = 1``) sensitivity is ``sqrt(k)``, and its
   expected error per unit of sensitivity is ``k`` times the single one. With a cut (the last participation within
   ``m`` steps of the end) ``sens^2`` is a little smaller, and the optimum can differ a little: it is optimised here.
2. ``m > b`` and ``k >= 2``: the columns of two participations overlap, and the cross terms ``2 c_j c_(j+d)`` count.
   For non-negative, non-increasing coefficients the earliest, densest set is again a maximiser (McMahan, Pillutla,
   Steinke, Thakurta et al. 2024, "Hassle-free", Theorem 2 of arXiv:2405.13763), so ``sens^2 = ||c + S^b c + .. +
   S^((k-1) b) c||^2`` over the ``n`` rows (``S`` shifts down by one), which is what (1) is too. For other
   coefficients fxdp has no sensitivity (the exact maximum over sets is a combinatorial search; jax_privacy offers
   upper bounds only), so it is **refused** (:func:`pattern_sensitivity`), and the optimiser searches only the cone
   ``c_0 >= c_1 >= .. >= c_(m-1) >= 0`` (``c_j = d_j^2 + .. + d_(m-1)^2``, ``d`` free), where it is exact.

**The objective** (Choquette-Choo et al. 2023, "Amplified banded matrix factorization"; jax_privacy's
``toeplitz.loss`` times ``n``, with ``toeplitz.minsep_sensitivity_squared`` for several participations): without
amplification the release is one Gaussian mechanism of sensitivity ``sens``, so at a target epsilon sigma is
proportional to ``sens``, and the expected total squared error of the ``n`` prefix sums is, per unit of the
calibrated multiplier, ``||A C^-1||_F^2 sens^2`` (scale-free in ``c``). :func:`expected_prefix_sum_error`
computes it for a pattern, :func:`optimize_banded_toeplitz` minimises it.

**With amplification** (cyclic Poisson sampling over ``p >= m`` parts, :class:`fxdp.accounting.
CyclicPoissonBandedMFAccountant`): a sample's steps are ``p`` apart, so as in (1) they reach disjoint rows; the
accountant composes ``ceil(n / p)`` Poisson-sampled Gaussian events of sensitivity ``||c||``, the largest column
norm. Epsilon depends on ``c`` only through ``||c||``, so the objective is the single-participation one, whatever
``k`` and ``p``: :func:`optimize_banded_toeplitz` without ``min_separation``. ``m > p`` is not covered by that
reduction and is refused (by the mechanism's loader check and the accountant).

Computation: ``C^-1``'s coefficients by Newton's iteration on power series (FFT products), the sum of the pattern's
columns by cumulative sums over blocks of ``b``: ``O(n log n)`` per evaluation, differentiable, in float64.
"""

from __future__ import annotations

import functools
import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from fxdp.sinks.contract import PrivacySettingError


def sqrt_toeplitz_coefficients(bands: int) -> List[float]:
    """``c_k = binom(2k, k) / 4^k`` for ``k < bands`` (the series of ``(1 - x)^(-1/2)``), scaled to unit norm."""
    _check_bands(bands)
    coefficients = [1.0]
    for k in range(1, bands):  # binom(2k, k) / 4^k = previous * (2k - 1) / (2k)
        coefficients.append(coefficients[-1] * (2 * k - 1) / (2 * k))
    return _normalised(coefficients)


def banded_toeplitz_matrix(coefficients: Sequence[float], n: int) -> torch.Tensor:
    """The ``n x n`` lower-triangular Toeplitz matrix ``C[t, s] = c_(t-s)`` (0 beyond the bands), float64."""
    matrix = torch.zeros(n, n, dtype=torch.float64)
    for k, c in enumerate(coefficients[:n]):
        matrix += torch.diag(torch.full((n - k,), float(c), dtype=torch.float64), -k)
    return matrix


def max_column_norm(coefficients: Sequence[float], n: int) -> float:
    """C's largest column norm for ``n`` steps, in closed form: column ``s`` holds ``c_0 .. c_(min(b, n-s)-1)``, so
    the first column is the largest, ``sqrt(sum of c_k^2 over k < min(bands, n))``."""
    return math.sqrt(sum(float(c) ** 2 for c in list(coefficients)[:max(1, n)]))


def participations(n: int, min_separation: int, max_participations: Optional[int] = None) -> int:
    """``k``: the most of ``n`` steps a sample can take part in when its steps are ``min_separation`` or more apart,
    and at most ``max_participations`` (None: no other limit)."""
    most = -(-n // min_separation)
    return most if max_participations is None else min(most, max_participations)


def check_pattern(n: Any, min_separation: Any, max_participations: Any = None) -> Tuple[int, int, int]:
    """``(n, b, k)`` of a participation pattern (``min_separation`` None: one participation, ``b = n``)."""
    for name, value in (("n (the number of steps)", n), ("min_separation", min_separation),
                        ("max_participations", max_participations)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PrivacySettingError(f"fxdp: {name} must be an int >= 1, got {value!r}")
    if n is None:
        raise PrivacySettingError("fxdp: n (the number of steps) must be an int >= 1, got None")
    b = min_separation or n
    return n, b, participations(n, b, max_participations)


def bands_overlap(bands: int, n: int, min_separation: int, max_participations: Optional[int] = None) -> bool:
    """Whether two of a sample's steps can reach a common row of a ``bands``-banded ``C`` (case 2 of the module
    docstring): ``bands > min_separation`` and at least two participations."""
    return bands > min_separation and participations(n, min_separation, max_participations) >= 2


def effective_bands(coefficients: Sequence[float]) -> int:
    """The bands ``C`` really has: one past its last non-zero coefficient (trailing zeros reach no row)."""
    c = [float(x) for x in coefficients]
    return max((j + 1 for j, x in enumerate(c) if x != 0.0), default=1)


def covered(coefficients: Sequence[float]) -> bool:
    """Non-negative and non-increasing: where the sensitivity of overlapping bands is known (module docstring)."""
    c = [float(x) for x in coefficients]
    return all(x >= 0 for x in c) and all(a >= b for a, b in zip(c, c[1:]))


def pattern_sensitivity(coefficients: Sequence[float], n: int, min_separation: Optional[int] = None,
                        max_participations: Optional[int] = None) -> float:
    """The banded Toeplitz ``C``'s sensitivity over ``n`` steps under ``(k, b)`` min-separation participation
    (``b = min_separation``, default ``n``: one participation; ``k`` at most ``max_participations``, default
    ``ceil(n / b)``), the norm of the sum of the columns ``0, b, .., (k-1) b`` (module docstring, cases 1 and 2).
    Refused where the bands overlap and the coefficients are not non-negative and non-increasing."""
    return math.sqrt(_checked_sensitivity_squared(coefficients, n, min_separation, max_participations))


def _checked_sensitivity_squared(coefficients: Sequence[float], n: int, min_separation: Optional[int],
                                 max_participations: Optional[int]) -> float:
    n, b, k = check_pattern(n, min_separation, max_participations)
    if bands_overlap(effective_bands(coefficients), n, b, k) and not covered(coefficients):
        raise PrivacySettingError(
            f"fxdp: banded MF with {len(coefficients)} bands and min_separation={b}: a sample's bands of C overlap, "
            "and fxdp's sensitivity holds then only for non-negative, non-increasing coefficients; got "
            f"{list(coefficients)}. Use min_separation >= bands, or such coefficients (sqrt_toeplitz_coefficients, "
            "optimize_banded_toeplitz(..., min_separation=...))")
    c = torch.tensor([float(x) for x in coefficients], dtype=torch.float64)
    return float(_pattern_sensitivity_squared(c, n, b, k))


def expected_prefix_sum_error(coefficients: Sequence[float], n: int, *, min_separation: Optional[int] = None,
                              max_participations: Optional[int] = None) -> float:
    """``||A C^-1||_F^2 * sens(C)^2``: the expected total squared error of the ``n`` prefix sums of the noise,
    ``sum_t E||sum_(s<=t) w_s||^2`` per coordinate, per unit of the noise multiplier calibrated for the sensitivity
    (the objective of Choquette-Choo et al. 2023). ``sens`` is under the pattern (:func:`pattern_sensitivity`; one
    participation by default, which is also the objective with amplification). DP-SGD's (C = I, one participation)
    is ``n (n + 1) / 2``."""
    sensitivity_squared = _checked_sensitivity_squared(coefficients, n, min_separation, max_participations)
    c = torch.tensor([float(x) for x in coefficients], dtype=torch.float64)
    return float(_workload_error(c, n)) * sensitivity_squared


def optimize_banded_toeplitz(bands: int, n: int, *, min_separation: Optional[int] = None,
                             max_participations: Optional[int] = None, iterations: int = 200) -> List[float]:
    """Banded Toeplitz coefficients minimising :func:`expected_prefix_sum_error` for ``n`` steps under ``(k, b)``
    participation (``min_separation`` b, default ``n``: one participation, the objective with amplification too;
    ``max_participations`` k, default ``ceil(n / b)``), normalised to unit column norm.

    L-BFGS in float64 from :func:`sqrt_toeplitz_coefficients`: over ``c_1 .. c_(m-1)`` with ``c_0 = 1`` (the
    objective does not depend on the scale) when the bands do not overlap; over the cone of non-negative,
    non-increasing coefficients when they do (the only ones whose sensitivity is known then; module docstring),
    compared there with the ``b``-band optimum followed by zeros (its bands do not overlap, whatever its signs), the
    latter kept when within 1e-9 relative (with ``k = ceil(n / b)`` it was the cone's optimum too, in every case
    tried). A local optimum, never worse than the start (returned if the optimiser does not improve on it). Cached
    in the process: the same arguments return the same strategy without optimising again
    (:func:`optimize_banded_toeplitz_cache_info`)."""
    _check_bands(bands)
    n, b, k = check_pattern(n, min_separation, max_participations)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"fxdp: iterations must be an int >= 1, got {iterations!r}")
    # k = 1 is one participation whatever b is: one cache entry for it
    return list(_optimize(bands, n, b if k > 1 else n, k, iterations))


def optimize_banded_toeplitz_cache_info() -> Any:
    """Hits and misses of :func:`optimize_banded_toeplitz`'s cache (``functools.lru_cache``'s ``cache_info()``)."""
    return _optimize.cache_info()


@functools.lru_cache(maxsize=64)
def _optimize(bands: int, n: int, b: int, k: int, iterations: int) -> Tuple[float, ...]:
    start = torch.tensor(sqrt_toeplitz_coefficients(bands), dtype=torch.float64)
    start = start / start[0]
    if bands == 1:
        return (1.0,)
    if bands_overlap(bands, n, b, k):  # the cone c_j = d_j^2 + .. + d_(m-1)^2 (start: the square root's, in it)
        steps = torch.cat([start[:-1] - start[1:], start[-1:]])
        raw = steps.sqrt().requires_grad_(True)

        def coefficients() -> torch.Tensor:
            return torch.flip(torch.cumsum(torch.flip(raw * raw, [0]), 0), [0])
    else:
        raw = start[1:].clone().requires_grad_(True)

        def coefficients() -> torch.Tensor:
            return torch.cat([start[:1], raw])
    optimizer = torch.optim.LBFGS([raw], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-12, tolerance_change=1e-15)

    def objective() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.log(_pattern_error(coefficients(), n, b, k))
        loss.backward()
        return loss

    optimizer.step(objective)
    with torch.no_grad():
        found = coefficients()
    candidates = [start] + ([found] if bool(torch.isfinite(found).all()) and found[0] > 0 else [])
    if bands_overlap(bands, n, b, k):  # also the b-band optimum (disjoint bands, any signs), zeros after it
        fewer = torch.tensor(_optimize(b, n, b, k, iterations), dtype=torch.float64)
        candidates.append(torch.cat([fewer / fewer[0], fewer.new_zeros(bands - b)]))
    errors = [float(_pattern_error(c, n, b, k)) for c in candidates]
    # the best, and of those within 1e-9 of it the last (the b-band one: exact zeros, b - 1 noise vectors of state)
    best = max(i for i, e in enumerate(errors) if e <= min(errors) * (1 + 1e-9))
    return tuple(_normalised(candidates[best].tolist()))


def _check_bands(bands: Any) -> None:
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise PrivacySettingError(f"fxdp: bands must be an int >= 1, got {bands!r}")


def _normalised(coefficients: Sequence[float]) -> List[float]:
    norm = math.sqrt(sum(c * c for c in coefficients))
    return [c / norm for c in coefficients]


def _series_inverse(c: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` coefficients of ``1 / c(x)`` (C^-1's Toeplitz coefficients), by Newton's iteration
    ``g <- g (2 - c g)`` on power series, each product an FFT convolution (differentiable)."""
    g = (1.0 / c[:1])
    m = 1
    while m < n:
        m = min(2 * m, n)
        cg = _product(c[:m], g, m)
        two_minus = -cg
        two_minus = torch.cat([two_minus[:1] + 2.0, two_minus[1:]])
        g = _product(g, two_minus, m)
    return g


def _product(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    size = 1 << (len(a) + len(b) - 1).bit_length()
    full = torch.fft.irfft(torch.fft.rfft(a, size) * torch.fft.rfft(b, size), size)
    return full[:n] if full.numel() >= n else torch.cat([full, full.new_zeros(n - full.numel())])


def _workload_error(c: torch.Tensor, n: int) -> torch.Tensor:
    """``||A C^-1||_F^2``: A C^-1 is Toeplitz with coefficients the prefix sums ``e_k`` of C^-1's, so its squared
    Frobenius norm is ``sum_k (n - k) e_k^2``."""
    e = torch.cumsum(_series_inverse(c, n), 0)
    weights = torch.arange(n, 0, -1, dtype=c.dtype)
    return (weights * e * e).sum()


def _prefix_error(c: torch.Tensor, n: int) -> torch.Tensor:
    """``||A C^-1||_F^2 * sens^2`` for one participation (sens: the largest column norm)."""
    return _workload_error(c, n) * (c[:n] ** 2).sum()


def _pattern_sensitivity_squared(c: torch.Tensor, n: int, b: int, k: int) -> torch.Tensor:
    """``||c + S^b c + .. + S^((k-1) b) c||^2`` over ``n`` rows (differentiable): ``c`` zero-padded to whole blocks
    of ``b`` rows, cumulative sums down the blocks give every earlier participation's contribution to a row; the
    sums from ``k`` blocks back are taken off again (at most ``k`` participations)."""
    c = c[:n]
    blocks = -(-n // b)
    padded = torch.cat([c, c.new_zeros(blocks * b - len(c))])
    total = torch.cumsum(padded.reshape(blocks, b), 0).reshape(-1)
    if k < blocks:
        total = torch.cat([total[:k * b], total[k * b:] - total[:-k * b]])
    total = total[:n]
    return (total * total).sum()


def _pattern_error(c: torch.Tensor, n: int, b: int, k: int) -> torch.Tensor:
    return _workload_error(c, n) * _pattern_sensitivity_squared(c, n, b, k)
