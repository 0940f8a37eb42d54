"""Buffered linear Toeplitz (BLT) noise: correlated noise over all past steps with a few buffers of state.

The mechanism (Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024, "Efficient and near-optimal noise
generation for streaming differential privacy"; McMahan, Pillutla, Steinke, Thakurta et al. 2024, "Hassle-free
or near-optimal: BLT mechanisms under multiple participations"). As for banded MF (:mod:`.banded`), training on
``X + C^-1 Z`` is the release ``C X + Z`` post-processed, for a lower-triangular Toeplitz strategy ``C``. A BLT
``C`` with ``d`` buffers has decays ``theta_1 .. theta_d`` and scales ``omega_1 .. omega_d``::

    c_0 = 1,    c_k = omega_1 theta_1^(k-1) + ... + omega_d theta_d^(k-1)    (k >= 1)

(the generating function ``1 + sum_i omega_i x / (1 - theta_i x)``). ``C w = z`` then runs with ``d`` buffers
``u_i`` per parameter (``u_i`` at step ``t`` is ``sum_(k>=1) theta_i^(k-1) w_(t-k)``)::

    w_t = z_t - (omega_1 u_1 + ... + omega_d u_d)          then    u_i <- theta_i u_i + w_t

so the state is ``d x`` the trainable parameters, whatever the number of steps (:meth:`memory_bytes`).

Sensitivity and what it assumes. The mechanism is planned for ``steps`` (n) steps and a participation pattern in
which a sample's steps are at least ``min_separation`` (b) apart, so at most ``k = ceil(n / b)`` of them
(``min_separation >= steps``: one participation). With ``theta_i`` in [0, 1), ``omega_i >= 0`` and
``omega_1 + ... + omega_d <= 1``, ``C``'s coefficients are non-negative and non-increasing, and then the largest
norm of a sum of ``C``'s columns over such a pattern is reached by the earliest, densest one, steps ``0, b, ..,
(k-1) b`` (McMahan et al. 2024, "Hassle-free", Theorem 2 of arXiv:2405.13763):
``sens^2 = ||c + S^b c + ... + S^((k-1) b) c||^2`` over the first ``n`` rows (``S`` the shift down by one).
Parameters outside those bounds are refused. ``C`` is normalised by ``sens`` (for ``n`` steps), so that
``noise_multiplier`` sigma makes the whole release, however many steps up to ``n`` run, a Gaussian mechanism
of noise multiplier sigma (:class:`fxdp.accounting.MinSeparationBLTAccountant`); a step past ``n`` is refused.

Strategies: :func:`optimize_blt` (decays and scales minimising the expected total squared error of the ``n``
prefix sums, or its largest term, per unit of sensitivity under the pattern, L-BFGS in float64), or given ones.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from fxdp.optim.correlated.banded import _product, _series_inverse
from fxdp.optim.correlated.cycle import FollowsCycle, check_plan
from fxdp.optim.correlated.mechanism import NoiseMechanism
from fxdp.optim.correlated.blt_state import FlatBuffers
from fxdp.optim.correlated.processes import check_noise_state
from fxdp.sinks.contract import PrivacySettingError

ERRORS = ("total", "max")


def blt_toeplitz_coefficients(theta: Any, omega: Any, n: int) -> torch.Tensor:
    """``c_0 .. c_(n-1)`` of the BLT ``(theta, omega)`` (float64; differentiable in tensors given)."""
    theta, omega = _as_tensor(theta), _as_tensor(omega)
    k = torch.arange(max(0, n - 1), dtype=torch.float64)
    tail = (omega[:, None] * theta[:, None] ** k[None, :]).sum(0) if len(theta) else torch.zeros_like(k)
    return torch.cat([torch.ones(1, dtype=torch.float64), tail])[:n]


def participations(n: int, min_separation: int) -> int:
    """The most steps a sample can take part in among ``n`` when its steps are ``min_separation`` or more apart."""
    return -(-n // min_separation)


def min_separation_sensitivity(coefficients: Any, n: int, min_separation: int) -> torch.Tensor:
    """``C``'s sensitivity over ``n`` steps when a sample's steps are ``min_separation`` or more apart (see the
    module docstring), for non-negative, non-increasing Toeplitz coefficients (checked by the callers)."""
    c = _as_tensor(coefficients)
    c = torch.cat([c, c.new_zeros(max(0, n - len(c)))])[:n]
    comb = torch.zeros(n, dtype=torch.float64)
    comb[::min_separation] = 1.0  # the earliest, densest pattern: steps 0, b, 2b, ...
    column_sum = c if participations(n, min_separation) == 1 else _product(c, comb, n)
    return torch.sqrt((column_sum * column_sum).sum())


def blt_prefix_sum_error(theta: Any, omega: Any, n: int, *, min_separation: Optional[int] = None,
                         error: str = "total") -> float:
    """The expected squared error of the ``n`` prefix sums of BLT noise per unit of sensitivity (noise multiplier
    1, ``C`` normalised to sensitivity 1 under the pattern): ``"total"`` sums it over the prefix sums,
    ``||A C^-1||_F^2 sens^2`` (as :func:`~fxdp.optim.correlated.expected_prefix_sum_error` for banded MF);
    ``"max"`` is the largest, the last prefix sum's. DP-SGD's are ``n (n + 1) / 2`` and ``n`` (one
    participation). ``min_separation`` defaults to ``n`` (one participation)."""
    check_blt(theta, omega, n, min_separation)
    return float(_error(_as_tensor(theta), _as_tensor(omega), n, min_separation or n, error))


def optimize_blt(buffers: int, n: int, *, min_separation: Optional[int] = None, error: str = "total",
                 iterations: int = 300) -> Tuple[List[float], List[float]]:
    """``(theta, omega)`` of a BLT with ``buffers`` buffers minimising :func:`blt_prefix_sum_error` for ``n``
    steps and ``min_separation`` (default ``n``: one participation). L-BFGS in float64 over parameters that keep
    ``theta`` in (0, 1), ``omega >= 0`` and ``sum(omega) < 1`` (where the sensitivity above holds), from three
    starts (``sum(omega)`` 0.5, 0.8, 0.3, split equally; decays spread between ``1 - n^(-2/(d+1))`` and
    ``1 - 1/n``); the best found is returned (a local optimum; deterministic). Cached in the process: the same
    arguments return the same strategy without optimising again (:func:`optimize_blt_cache_info`)."""
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
        raise PrivacySettingError(f"fxdp: buffers must be an int >= 1, got {buffers!r}")
    check_plan(n, min_separation)
    if error not in ERRORS:
        raise ValueError(f"fxdp: error must be one of {ERRORS}, got {error!r}")
    theta, omega = _optimize_blt(buffers, n, min_separation or n, error, iterations)
    return list(theta), list(omega)


def optimize_blt_cache_info() -> Any:
    """Hits and misses of :func:`optimize_blt`'s cache (``functools.lru_cache``'s ``cache_info()``)."""
    return _optimize_blt.cache_info()


@functools.lru_cache(maxsize=64)
def _optimize_blt(buffers: int, n: int, b: int, error: str, iterations: int) -> Tuple[Tuple[float, ...], ...]:
    best: Optional[Tuple[float, torch.Tensor, torch.Tensor]] = None
    for total_scale in (0.5, 0.8, 0.3):
        spread = torch.arange(1, buffers + 1, dtype=torch.float64) / (buffers + 1)
        theta0 = 1.0 - torch.tensor(float(n), dtype=torch.float64) ** (-spread - 1.0 / (buffers + 1))
        raw_theta = torch.logit(theta0.clamp(1e-6, 1 - 1e-9)).requires_grad_(True)
        raw_share = torch.zeros(buffers, dtype=torch.float64, requires_grad=True)
        raw_total = torch.tensor(math.log(total_scale / (1 - total_scale)), dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([raw_theta, raw_share, raw_total], lr=1.0, max_iter=iterations,
                                      line_search_fn="strong_wolfe", tolerance_grad=1e-12, tolerance_change=1e-15)

        def parameters() -> Tuple[torch.Tensor, torch.Tensor]:
            # (theta kept below 1 in float64, where a saturated sigmoid would round to 1)
            theta = torch.sigmoid(raw_theta).clamp(max=1 - 1e-12)
            return theta, torch.sigmoid(raw_total) * torch.softmax(raw_share, 0)

        def objective() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.log(_error(*parameters(), n, b, error))
            loss.backward()
            return loss

        try:
            optimizer.step(objective)
        except RuntimeError:  # a start whose line search left the domain numerically: try the next
            continue
        with torch.no_grad():
            theta, omega = parameters()
            value = float(_error(theta, omega, n, b, error))
        if math.isfinite(value) and (best is None or value < best[0]):
            best = (value, theta.detach().clone(), omega.detach().clone())
    if best is None:
        raise RuntimeError(f"fxdp: optimize_blt found no finite strategy for buffers={buffers}, n={n}")
    order = torch.argsort(best[1], descending=True)
    return tuple(best[1][order].tolist()), tuple(best[2][order].tolist())


def check_blt(theta: Any, omega: Any, n: int, min_separation: Optional[int]) -> None:
    """Refuse parameters outside the bounds under which this module's sensitivity holds (module docstring)."""
    check_plan(n, min_separation)
    theta, omega = [float(x) for x in theta], [float(x) for x in omega]
    if len(theta) != len(omega) or not theta:
        raise PrivacySettingError(f"fxdp: a BLT needs as many decays (theta) as scales (omega), at least one; got "
                                  f"{len(theta)} and {len(omega)}")
    if not all(math.isfinite(x) for x in theta + omega):
        raise PrivacySettingError(f"fxdp: BLT parameters must be finite, got theta={theta}, omega={omega}")
    if not all(0 <= t < 1 for t in theta) or not all(w >= 0 for w in omega) or sum(omega) > 1:
        raise PrivacySettingError(
            f"fxdp: fxdp's BLT sensitivity holds for decays theta in [0, 1), scales omega >= 0 and sum(omega) <= 1 "
            f"(non-negative, non-increasing Toeplitz coefficients); got theta={theta}, omega={omega}. Use "
            "optimize_blt(...) or parameters within those bounds")


class BufferedLinearToeplitz(FollowsCycle, NoiseMechanism):
    """BLT noise for :class:`~fxdp.optim.DPOptimizer` (see the module docstring).

    Args:
        theta, omega: the decays and scales of ``C`` (one per buffer), e.g. from :func:`optimize_blt`.
        steps: n, the number of steps the noise is planned (normalised) for; a step past it is refused.
        min_separation: b, the fewest steps between two of a sample's steps (default ``steps``: each sample in at
            most one step). The mechanism follows a cyclic loader of at least ``b`` partitions (:meth:`follow`).

    :meth:`optimized` builds one with :func:`optimize_blt`'s strategy.
    """

    name = "blt"
    _label = "BLT"
    _planned = "its sensitivity normalised"
    across_processes = True
    per_parameter_state = ("buffers",)

    def __init__(self, theta: Sequence[float], omega: Sequence[float], *, steps: int,
                 min_separation: Optional[int] = None):
        check_blt(theta, omega, steps, min_separation)
        self.theta, self.omega = tuple(float(t) for t in theta), tuple(float(w) for w in omega)
        self.planned_steps, self.min_separation = steps, min_separation or steps
        self.scale = float(min_separation_sensitivity(self.coefficients(steps), steps, self.min_separation))
        self.steps = 0  # noise draws made
        self._buffers = FlatBuffers(self.theta, self.omega, self._label)  # d x the parameters, after the first step
        self._init_cycle()

    @classmethod
    def optimized(cls, buffers: int, *, steps: int, min_separation: Optional[int] = None,
                  error: str = "total") -> "BufferedLinearToeplitz":
        theta, omega = optimize_blt(buffers, steps, min_separation=min_separation, error=error)
        return cls(theta, omega, steps=steps, min_separation=min_separation)

    @property
    def buffers(self) -> int:
        return len(self.theta)

    @property
    def max_participations(self) -> int:
        return participations(self.planned_steps, self.min_separation)

    @property
    def sensitivity(self) -> float:
        """The normalised ``C``'s sensitivity under the planned pattern: 1."""
        return float(min_separation_sensitivity(self.coefficients(self.planned_steps) / self.scale,
                                                self.planned_steps, self.min_separation))

    def coefficients(self, n: int) -> torch.Tensor:
        """The first ``n`` Toeplitz coefficients of ``C`` before normalisation (``c_0 = 1``), float64."""
        return blt_toeplitz_coefficients(self.theta, self.omega, n)

    def expected_prefix_sum_error(self, error: str = "total") -> float:
        """:func:`blt_prefix_sum_error` of this strategy over its planned steps and pattern."""
        return blt_prefix_sum_error(self.theta, self.omega, self.planned_steps, min_separation=self.min_separation,
                                    error=error)

    @property
    def _separation(self) -> int:
        return self.min_separation

    def add_noise_(self, outs: List[torch.Tensor], std: float, *, secure_mode: bool = False,
                   generator: Optional[torch.Generator] = None, draws: Optional[List[torch.Tensor]] = None) -> None:
        self.check_step()
        # C normalised by its sensitivity: its inverse's noise is ``scale`` times C^-1 z (the recurrence: .blt_state)
        self._buffers.step_(outs, std * self.scale, draws=draws, secure_mode=secure_mode, generator=generator)
        self.steps += 1

    def advance_(self) -> None:
        self.check_step()
        self._buffers.clear()  # (a rank that adds no noise keeps none, even one loaded from rank 0's checkpoint)
        self.steps += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"theta": list(self.theta), "omega": list(self.omega), "planned_steps": self.planned_steps,
                "min_separation": self.min_separation, **self._cycle_state(),
                "buffers": self._buffers.per_parameter()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        mine = (list(self.theta), list(self.omega), self.planned_steps, self.min_separation)
        saved = (state["theta"], state["omega"], state["planned_steps"], state["min_separation"])
        if saved != mine:
            raise ValueError(f"fxdp: the checkpoint's BLT (theta, omega, steps, min_separation) {saved} differs from "
                             f"this mechanism's {mine}; build it with the checkpoint's")
        check_noise_state(self._label, state["steps"], len(state["buffers"]), self.buffers if state["steps"] else 0)
        self._load_cycle_state(state)
        self._buffers.load(state["buffers"])

    def memory_bytes(self) -> int:
        """Bytes of the buffers: ``buffers x`` the trainable parameters (in at least float32) after the first step."""
        return self._buffers.nbytes()

    def __repr__(self) -> str:
        return (f"BufferedLinearToeplitz(theta={list(self.theta)}, omega={list(self.omega)}, "
                f"steps={self.planned_steps}, min_separation={self.min_separation})")


def _as_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor([float(v) for v in x], dtype=torch.float64)


def _error(theta: torch.Tensor, omega: torch.Tensor, n: int, b: int, error: str) -> torch.Tensor:
    c = blt_toeplitz_coefficients(theta, omega, n)
    e = torch.cumsum(_series_inverse(c, n), 0)  # A C^-1's Toeplitz coefficients
    sens2 = min_separation_sensitivity(c, n, b) ** 2
    if error == "max":
        return (e * e).sum() * sens2
    if error != "total":
        raise ValueError(f"fxdp: error must be one of {ERRORS}, got {error!r}")
    return (torch.arange(n, 0, -1, dtype=torch.float64) * e * e).sum() * sens2
