"""Banded matrix factorization (banded MF): noise correlated over the last ``bands`` steps.

The mechanism (Denisov et al. 2022; Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization: A
unified approach to private training"). Write the gradients of ``n`` steps as the rows of ``X`` and the
workload as ``A`` (lower-triangular ones: SGD's iterates are prefix sums of the gradients). A factorization
``A = B C`` with ``C`` lower triangular releases ``C X + Z`` (``Z`` independent Gaussian rows), from which
``B (C X + Z) = A (X + C^-1 Z)``: training on ``X + C^-1 Z`` is that release, post-processed. So the noise
added at step ``t`` is ``w_t = (C^-1 Z)_t``, and with ``C`` banded (``C[t, s] = c_(t-s)`` for
``0 <= t - s < bands``, Toeplitz) it follows from ``C w = Z``::

    w_t = (z_t - c_1 w_(t-1) - ... - c_(b-1) w_(t-b+1)) / c_0            z_t ~ N(0, I), fresh each step

so the state is the last ``bands - 1`` noise vectors: ``(bands - 1) x`` the trainable parameters
(:meth:`BandedMatrixFactorization.memory_bytes`), each ``w_t`` scaled by DP-SGD's std (``sigma * C * scale``).
``bands=1`` is DP-SGD's independent noise.

Normalisation: the coefficients are scaled so that C's largest column norm (its sensitivity to one
participation), ``sqrt(c_0^2 + ... + c_(b-1)^2)``, is 1; ``noise_multiplier`` then means what it means for
DP-SGD, and the accountant (:class:`fxdp.accounting.CyclicPoissonBandedMFAccountant`) composes Gaussian
mechanisms of that multiplier.

Strategies here: :func:`sqrt_toeplitz_coefficients` (the first ``bands`` coefficients of ``(1 - x)^(-1/2)``,
whose full Toeplitz matrix squares to ``A``: banded square root, a good strategy without optimisation) and
:func:`optimize_banded_toeplitz` (coefficients minimising the expected total squared error of the ``n`` prefix
sums per unit of sensitivity, :func:`expected_prefix_sum_error`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from fxdp.optim.correlated.cycle import FollowsCycle
from fxdp.optim.correlated.mechanism import NoiseMechanism
from fxdp.optim.correlated.processes import check_noise_state, unit_draws
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError


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


def expected_prefix_sum_error(coefficients: Sequence[float], n: int) -> float:
    """``||A C^-1||_F^2 * sens(C)^2``: the expected total squared error of the ``n`` prefix sums of the noise,
    ``sum_t E||sum_(s<=t) w_s||^2`` per coordinate, at noise multiplier 1 and sensitivity normalised to 1 (the
    objective of Choquette-Choo et al. 2023, per unit of sigma^2 C^2). DP-SGD's (C = I) is ``n (n + 1) / 2``."""
    c = torch.tensor([float(x) for x in coefficients], dtype=torch.float64)
    return float(_prefix_error(c, n))


def optimize_banded_toeplitz(bands: int, n: int, *, iterations: int = 200) -> List[float]:
    """Banded Toeplitz coefficients minimising :func:`expected_prefix_sum_error` for ``n`` steps (L-BFGS in
    float64 from :func:`sqrt_toeplitz_coefficients`, ``c_0`` held at 1: the objective does not depend on the
    scale), normalised to unit column norm. A local optimum: never worse than the start, which is returned if
    the optimiser does not improve on it."""
    _check_bands(bands)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"fxdp: n (the number of steps) must be a positive int, got {n!r}")
    start = torch.tensor(sqrt_toeplitz_coefficients(bands), dtype=torch.float64)
    start = start / start[0]
    if bands == 1:
        return [1.0]
    tail = start[1:].clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([tail], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-12, tolerance_change=1e-15)

    def objective() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.log(_prefix_error(torch.cat([start[:1], tail]), n))
        loss.backward()
        return loss

    optimizer.step(objective)
    found = torch.cat([start[:1], tail.detach()])
    best = found if bool(torch.isfinite(found).all()) and _prefix_error(found, n) < _prefix_error(start, n) else start
    return _normalised(best.tolist())


class BandedMatrixFactorization(FollowsCycle, NoiseMechanism):
    """Banded MF noise for :class:`~fxdp.optim.DPOptimizer` (see the module docstring).

    Args:
        bands: b, the number of bands (steps over which the noise is correlated); the strategy is then
            :func:`sqrt_toeplitz_coefficients`.
        coefficients: ``c_0 .. c_(b-1)`` of a banded Toeplitz ``C`` instead (``c_0 > 0``), e.g. from
            :func:`optimize_banded_toeplitz`; scaled here to unit column norm.

        steps: n, to account *without amplification* (min-separation participation, as for BLT): the noise is
            planned for ``n`` steps (a step past them is refused) and :attr:`sensitivity` is ``C``'s under a
            participation pattern whose steps are ``min_separation`` or more apart. Without ``steps`` (the
            default), banded MF is accounted *with amplification* by cyclic Poisson sampling.
        min_separation: b, the fewest steps between two of a sample's steps (default ``steps``: one
            participation); only with ``steps``. Below ``bands`` only for non-negative, non-increasing
            coefficients (where the earliest, densest pattern is the worst one).

    The noise is correlated across steps, so its privacy depends on which steps a sample can take part in: the
    mechanism draws only while it follows a cyclic loader (:meth:`follow`, which ``make_private`` calls) whose
    ``partitions >= bands`` (``>= min_separation`` without amplification), and refuses a step whose batch is not
    the next one of the cycle.
    """

    name = "banded_mf"
    _label = "banded MF"
    across_processes = True
    per_parameter_state = ("history",)

    def __init__(self, bands: Optional[int] = None, *, coefficients: Optional[Sequence[float]] = None,
                 steps: Optional[int] = None, min_separation: Optional[int] = None):
        if coefficients is None:
            if bands is None:
                raise PrivacySettingError("fxdp: BandedMatrixFactorization needs bands (or coefficients)")
            coefficients = sqrt_toeplitz_coefficients(bands)
        coefficients = [float(c) for c in coefficients]
        if bands is not None and len(coefficients) != bands:
            raise PrivacySettingError(f"fxdp: BandedMatrixFactorization got bands={bands} and {len(coefficients)} "
                                      "coefficients; give one of them, or as many coefficients as bands")
        _check_bands(len(coefficients))
        if not all(math.isfinite(c) for c in coefficients) or not coefficients[0] > 0:
            raise PrivacySettingError(f"fxdp: banded MF coefficients must be finite with c_0 > 0 (C must be "
                                      f"invertible), got {coefficients}")
        self.coefficients = tuple(_normalised(coefficients))
        self.bands = len(self.coefficients)
        self.planned_steps, self.min_separation = check_min_separation_plan(self.coefficients, steps, min_separation)
        self.steps = 0  # noise draws made
        self._history: List[List[torch.Tensor]] = []  # [w_(t-1), w_(t-2), ...], each one tensor per parameter
        self._init_cycle()

    @property
    def amplified(self) -> bool:
        """Whether the noise is accounted with amplification by cyclic Poisson sampling (no ``steps`` given) or
        without, under min-separation participation (``steps`` given)."""
        return self.planned_steps is None

    @property
    def sensitivity(self) -> float:
        """With amplification, C's largest column norm: 1 after normalisation (for any number of steps >= 1).
        Without, C's sensitivity over the planned steps under min-separation participation
        (:func:`min_separation_sensitivity_of_banded`): ``sqrt(k)`` for ``k`` participations whose bands fit."""
        if self.planned_steps is None:
            return max_column_norm(self.coefficients, self.bands)
        return min_separation_sensitivity_of_banded(self.coefficients, self.planned_steps, self.min_separation)

    @property
    def max_participations(self) -> int:
        """The most steps a sample takes part in among the planned ones (1 with amplification: per cycle)."""
        return 1 if self.planned_steps is None else -(-self.planned_steps // self.min_separation)

    @property
    def _separation(self) -> int:
        return self.bands if self.planned_steps is None else self.min_separation

    def _separation_need(self) -> str:
        if self.planned_steps is None:
            return f"banded MF with {self.bands} bands"
        return f"banded MF planned for a minimum separation of {self.min_separation}"

    def _separation_reason(self) -> str:
        return "so that they meet disjoint bands of C" if self.planned_steps is None else "as the accounting assumes"

    def add_noise_(self, outs: List[torch.Tensor], std: float, *, secure_mode: bool = False,
                   generator: Optional[torch.Generator] = None, draws: Optional[List[torch.Tensor]] = None) -> None:
        self.check_step()
        if self._history and [tuple(h.shape) for h in self._history[0]] != [tuple(o.shape) for o in outs]:
            raise StepRefusedError("fxdp: the trainable parameters changed since the banded MF noise began (its "
                                   "state holds one noise vector per parameter); keep them for the whole run")
        draws = unit_draws(outs, draws, secure_mode=secure_mode, generator=generator, label=self._label)  # z_t, w_t
        c = self.coefficients
        for k, (out, w) in enumerate(zip(outs, draws)):
            for j, earlier in enumerate(self._history, start=1):
                w.sub_(earlier[k], alpha=c[j])
            if c[0] != 1.0:
                w.div_(c[0])
            if std != 0:
                out.add_(w, alpha=std)
        if self.bands > 1:
            self._history = [draws] + self._history[:self.bands - 2]
        self.steps += 1

    def advance_(self) -> None:
        self.check_step()
        self._history = []  # (a rank that adds no noise keeps none, even one loaded from rank 0's checkpoint)
        self.steps += 1

    def state_dict(self) -> Dict[str, Any]:
        plan = {} if self.planned_steps is None else {"planned_steps": self.planned_steps,
                                                      "min_separation": self.min_separation}
        return {"coefficients": list(self.coefficients), **plan, **self._cycle_state(),
                "history": [[t.clone() for t in step] for step in self._history]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if tuple(state["coefficients"]) != self.coefficients:
            raise ValueError(f"fxdp: the checkpoint's banded MF coefficients {state['coefficients']} differ from "
                             f"this mechanism's {list(self.coefficients)}; build it with the checkpoint's")
        saved = (state.get("planned_steps"), state.get("min_separation"))
        if saved != (self.planned_steps, self.min_separation):
            raise ValueError(f"fxdp: the checkpoint's banded MF was planned for (steps, min_separation) {saved}, this "
                             f"mechanism for {(self.planned_steps, self.min_separation)} ((None, None): accounted "
                             "with amplification); build it with the checkpoint's")
        check_noise_state(self._label, state["steps"], len(state["history"]), min(state["steps"], self.bands - 1))
        self._load_cycle_state(state)
        self._history = [[t.clone() for t in step] for step in state["history"]]

    def memory_bytes(self) -> int:
        """Bytes of the kept noise vectors: ``(bands - 1)`` copies of the trainable parameters (in at least
        float32) once the first ``bands - 1`` steps have run."""
        return sum(t.numel() * t.element_size() for step in self._history for t in step)

    def __repr__(self) -> str:
        plan = "" if self.planned_steps is None else (f", steps={self.planned_steps}, "
                                                      f"min_separation={self.min_separation}")
        return f"BandedMatrixFactorization(bands={self.bands}, coefficients={list(self.coefficients)}{plan})"


def min_separation_sensitivity_of_banded(coefficients: Sequence[float], n: int, min_separation: int) -> float:
    """The banded Toeplitz ``C``'s sensitivity over ``n`` steps when a sample's steps are ``min_separation`` (b) or
    more apart, without amplification: ``||c + S^b c + ... + S^((k-1) b) c||`` over the first ``n`` rows, the sum of
    the columns of the earliest, densest pattern ``0, b, .., (k-1) b`` (``k = ceil(n / b)``). It is the largest
    over all such patterns when ``b >= bands`` (the columns' supports are then disjoint: the squared norm of a sum
    is the sum of the columns' squared norms, each at most its earlier ones'), or when the coefficients are
    non-negative and non-increasing (McMahan et al. 2024, "Hassle-free", Theorem 2; as for BLT).
    :func:`check_min_separation_plan` refuses other cases."""
    c = torch.tensor([float(x) for x in coefficients][:n], dtype=torch.float64)
    c = torch.cat([c, c.new_zeros(n - len(c))])
    comb = torch.zeros(n, dtype=torch.float64)
    comb[::min_separation] = 1.0  # the earliest, densest pattern: steps 0, b, 2b, ...
    column_sum = c if min_separation >= n else _product(c, comb, n)
    return float(torch.sqrt((column_sum * column_sum).sum()))


def check_min_separation_plan(coefficients: Sequence[float], steps: Any,
                              min_separation: Any) -> Tuple[Optional[int], Optional[int]]:
    """``(steps, min_separation)`` of a banded MF accounted without amplification (``(None, None)`` with it),
    refusing what :func:`min_separation_sensitivity_of_banded` does not cover."""
    if steps is None:
        if min_separation is not None:
            raise PrivacySettingError("fxdp: BandedMatrixFactorization(min_separation=...) accounts without "
                                      "amplification and needs steps= (the steps the noise is planned for)")
        return None, None
    for name, value in (("steps", steps), ("min_separation", min_separation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PrivacySettingError(f"fxdp: {name} must be an int >= 1, got {value!r}")
    separation = min_separation or steps
    monotone = all(c >= 0 for c in coefficients) and all(a >= b for a, b in zip(coefficients, coefficients[1:]))
    if separation < len(coefficients) and separation < steps and not monotone:
        raise PrivacySettingError(
            f"fxdp: banded MF with {len(coefficients)} bands and min_separation={separation}: a sample's bands of C "
            "overlap, and fxdp's sensitivity holds then only for non-negative, non-increasing coefficients; got "
            f"{list(coefficients)}. Use min_separation >= bands, or such coefficients (sqrt_toeplitz_coefficients)")
    return steps, separation


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


def _prefix_error(c: torch.Tensor, n: int) -> torch.Tensor:
    """``||A C^-1||_F^2 * sens^2``: A C^-1 is Toeplitz with coefficients the prefix sums ``e_k`` of C^-1's, so its
    squared Frobenius norm is ``sum_k (n - k) e_k^2``."""
    e = torch.cumsum(_series_inverse(c, n), 0)
    weights = torch.arange(n, 0, -1, dtype=c.dtype)
    return (weights * e * e).sum() * (c[:n] ** 2).sum()
