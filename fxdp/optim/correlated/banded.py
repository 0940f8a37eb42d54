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

Strategies (:mod:`.banded_strategy`): :func:`sqrt_toeplitz_coefficients` (the first ``bands`` coefficients of
``(1 - x)^(-1/2)``, whose full Toeplitz matrix squares to ``A``: banded square root, a good strategy without
optimisation) and :func:`optimize_banded_toeplitz` (coefficients minimising the expected total squared error of the
``n`` prefix sums per unit of sensitivity under a participation pattern, :func:`expected_prefix_sum_error`);
:meth:`BandedMatrixFactorization.optimized` builds the mechanism with the strategy for its accounting's pattern.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from fxdp.optim.correlated.banded_strategy import (_check_bands, _normalised, _product,  # noqa: F401 (re-exported)
                                                   _series_inverse, banded_toeplitz_matrix, check_pattern,
                                                   effective_bands, expected_prefix_sum_error, max_column_norm,
                                                   optimize_banded_toeplitz, pattern_sensitivity,
                                                   sqrt_toeplitz_coefficients)
from fxdp.optim.correlated.cycle import FollowsCycle
from fxdp.optim.correlated.mechanism import NoiseMechanism
from fxdp.optim.correlated.processes import check_noise_state, unit_draws
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError


class BandedMatrixFactorization(FollowsCycle, NoiseMechanism):
    """Banded MF noise for :class:`~fxdp.optim.DPOptimizer` (see the module docstring).

    Args:
        bands: b, the number of bands (steps over which the noise is correlated); the strategy is then
            :func:`sqrt_toeplitz_coefficients`.
        coefficients: ``c_0 .. c_(b-1)`` of a banded Toeplitz ``C`` instead (``c_0 > 0``), e.g. from
            :func:`optimize_banded_toeplitz`; scaled here to unit column norm. :meth:`optimized` builds the
            mechanism with the strategy optimised for its steps and participation pattern.

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

    @classmethod
    def optimized(cls, bands: int, *, steps: int, min_separation: Optional[int] = None, amplified: bool = False,
                  iterations: int = 200) -> "BandedMatrixFactorization":
        """Banded MF whose strategy is optimised (:func:`optimize_banded_toeplitz`) for ``steps`` steps and the
        participation pattern it is accounted under:

        - ``amplified=False`` (default): accounted without amplification, planned for ``steps`` steps with a
          sample's steps ``min_separation`` (default ``steps``: one participation) or more apart, so
          ``ceil(steps / min_separation)`` participations (make_private's fixed-epoch loader: ``min_separation =
          len(loader)``, ``steps = epochs * len(loader)``). Where ``bands > min_separation`` the strategy minimises
          the error under the overlapping participations, among non-negative, non-increasing coefficients (the
          strategies whose sensitivity is known then), and where that optimum is the ``min_separation``-band one
          (zeros after it: with ``ceil(steps / min_separation)`` participations it was, in every case tried) the
          mechanism keeps only those bands (``bands`` is then ``min_separation``: less state). Where ``bands <=
          min_separation`` it is the single-participation optimum (up to the last participation's cut columns).
        - ``amplified=True``: accounted with amplification by cyclic Poisson sampling (no plan, as
          ``BandedMatrixFactorization(bands)``); the accountant's epsilon depends on the strategy only through its
          largest column norm, so the strategy is the single-participation optimum for ``steps`` steps, whatever the
          participations. ``min_separation`` is then the cyclic loader's ``partitions`` (at least ``bands``,
          checked when the loader is followed) and is not given here.

        (module docstring of :mod:`fxdp.optim.correlated.banded_strategy`: the derivation.)"""
        if amplified:
            if min_separation is not None:
                raise PrivacySettingError(
                    "fxdp: BandedMatrixFactorization.optimized(amplified=True) is accounted by cyclic Poisson "
                    "sampling, whose partitions (at least bands) separate a sample's steps; min_separation= is for "
                    "the accounting without amplification (amplified=False)")
            return cls(coefficients=optimize_banded_toeplitz(bands, steps, iterations=iterations))
        check_pattern(steps, min_separation)
        coefficients = optimize_banded_toeplitz(bands, steps, min_separation=min_separation, iterations=iterations)
        coefficients = coefficients[:effective_bands(coefficients)]  # zeros after the b-band optimum: no state
        return cls(coefficients=coefficients, steps=steps, min_separation=min_separation)

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


def min_separation_sensitivity_of_banded(coefficients: Sequence[float], n: int, min_separation: int,
                                        max_participations: Optional[int] = None) -> float:
    """The banded Toeplitz ``C``'s sensitivity over ``n`` steps when a sample's steps are ``min_separation`` (b) or
    more apart, at most ``max_participations`` (k, default ``ceil(n / b)``) of them, without amplification: ``||c +
    S^b c + ... + S^((k-1) b) c||`` over the first ``n`` rows, the sum of the columns of the earliest, densest
    pattern ``0, b, .., (k-1) b``. It is the largest over all such patterns when ``b >= bands`` (the columns'
    supports are then disjoint: the squared norm of a sum is the sum of the columns' squared norms, each at most its
    earlier ones'), or when the coefficients are non-negative and non-increasing (McMahan et al. 2024, "Hassle-free",
    Theorem 2; as for BLT); other cases are refused (:func:`~fxdp.optim.correlated.banded_strategy.
    pattern_sensitivity`, whose module docstring has the derivation)."""
    return pattern_sensitivity(coefficients, n, min_separation, max_participations)


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
    pattern_sensitivity(coefficients, steps, separation)  # refuses overlapping bands it does not cover
    return steps, separation
