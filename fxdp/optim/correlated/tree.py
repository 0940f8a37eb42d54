"""Tree aggregation: DP-FTRL's binary-tree noise (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu 2021, "Practical
and private (deep) learning without sampling or shuffling"), the simple baseline of the correlated mechanisms.

The tree mechanism releases, for each dyadic interval of steps ``[j 2^l, (j + 1) 2^l)`` once it is complete, the
sum of the gradients over it plus fresh Gaussian noise; the ``t``-th prefix sum is estimated from the intervals
of the binary decomposition of ``t + 1`` (one per set bit), so its noise is a sum of at most ``log2(t + 1) + 1``
node noises. Only the intervals some prefix uses need releasing: at step ``t`` exactly one, the interval ending
at ``t`` of length ``lowbit(t + 1)`` (the lowest set bit of ``t + 1``). In the matrix-mechanism view (as for
banded MF, :mod:`.banded`), that is the square, lower-triangular 0/1 strategy::

    C[t, s] = 1   if   t + 1 - lowbit(t + 1) <= s <= t            (else 0)

with ``A = B C``, ``B[t, r] = 1`` when the interval released at step ``r`` is in the decomposition of ``t + 1``
(:func:`tree_matrices`). Training on ``X + C^-1 Z`` is the release ``C X + Z`` post-processed, and the noise added
at step ``t`` is the change of the prefix noise::

    w_t = z_t - (the node noises of the decomposition of t that the new interval covers: lengths 1, 2, .., lowbit/2)

so the state is the node noises of the current decomposition: at most ``floor(log2 steps) + 1`` copies of the
trainable parameters (:meth:`TreeAggregation.memory_bytes`).

Sensitivity (:func:`tree_sensitivity`, no normalisation: ``noise_multiplier`` is per node, as for DP-SGD per
step). A step is in at most one released interval per level, so ``C``'s largest column norm is
``sqrt(h)``, ``h = floor(log2 n) + 1`` (reached by step 0): exact for one participation. For participations
``b`` or more steps apart (at most ``k = ceil(n / b)`` among ``n``), two steps ``d`` apart share at most
``u(d) = max(0, h - ceil(log2(d + 1)))`` intervals (one of length ``> d`` per level), a non-increasing function
of ``d``; so ``||sum of k columns||^2 = sum_(i,j) <col_i, col_j> <= k h + 2 sum_(m=1..k-1) (k - m) u(m b)``: an
upper bound. Where ``n`` is small enough, the (often tighter) bound of Choquette-Choo et al. 2023's Algorithm 4
on the explicit ``C^T C`` is computed too and the smaller one used (:func:`tree_sensitivity`; the tests compare
both with the brute-force maximum and with jax_privacy's).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from fxdp.optim.correlated.cycle import FollowsCycle, check_plan
from fxdp.optim.correlated.mechanism import NoiseMechanism
from fxdp.optim.noise import add_gaussian_noise_all_
from fxdp.sinks.contract import StepRefusedError


def lowbit(m: int) -> int:
    """The lowest set bit of ``m >= 1`` (the length of the interval released at step ``m - 1``)."""
    return m & -m


def tree_matrices(n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(C, B)`` of tree aggregation over ``n`` steps (float64, see the module docstring), built from the
    intervals: ``C``'s row ``r`` is the interval released at step ``r``, ``B``'s row ``t`` selects the released
    intervals that partition ``[0, t]``."""
    C = torch.zeros(n, n, dtype=torch.float64)
    for r in range(n):
        C[r, r + 1 - lowbit(r + 1):r + 1] = 1.0
    B = torch.zeros(n, n, dtype=torch.float64)
    for t in range(n):
        end = t + 1  # peel the binary decomposition of t + 1 off from its end
        while end > 0:
            B[t, end - 1] = 1.0
            end -= lowbit(end)
    return C, B


def tree_height(n: int) -> int:
    """``floor(log2 n) + 1``: the levels of released intervals among ``n`` steps."""
    return n.bit_length()


# Above this many additions (a few seconds on one busy core), the bound of Choquette-Choo et al.'s Algorithm 4 is
# not computed and the closed-form one alone is used
_ALGORITHM_4_WORK = 2 * 10 ** 7


def tree_sensitivity(n: int, min_separation: Optional[int] = None) -> float:
    """The sensitivity of tree aggregation's ``C`` over ``n`` steps: exact (``sqrt(floor(log2 n) + 1)``) for one
    participation (``min_separation`` None or ``>= n``); for participations ``min_separation`` or more apart an
    upper bound, the smaller of the closed form of the module docstring and, where ``n^2 k`` is small enough
    (:data:`_ALGORITHM_4_WORK`), the bound of Choquette-Choo et al. 2023 (arXiv:2306.08153, Algorithm 4, which
    jax_privacy's ``get_min_sep_sensitivity_upper_bound`` also computes) on the explicit ``C^T C``."""
    check_plan(n, min_separation)
    h = tree_height(n)
    b = min_separation or n
    k = -(-n // b)
    total = k * h
    for m in range(1, k):
        d = m * b
        total += 2 * (k - m) * max(0, h - math.ceil(math.log2(d + 1)))
    if k > 1 and n * n * k <= _ALGORITHM_4_WORK:
        C, _ = tree_matrices(n)
        X = C.T @ C  # non-negative: <col_i, col_j>
        row_max = _max_over_patterns(X, b, k)  # per row i, the largest sum of X[i, S] over patterns S
        total = min(total, float(_max_over_patterns(row_max[None, :], b, k)[0]))
    return math.sqrt(total)


def _max_over_patterns(x: torch.Tensor, b: int, k: int) -> torch.Tensor:
    """For each row of ``x``, the largest ``sum(x[row, S])`` over sets ``S`` of at most ``k`` indices, consecutive
    ones ``b`` or more apart (Algorithm 3 of Choquette-Choo et al. 2023, a dynamic programme over ``k``):
    ``f[i]`` is the best over the indices ``>= i`` with one participation more each round."""
    rows, n = x.shape
    f = x.new_zeros(rows, n + b)
    for _ in range(k):
        f[:, :n] = x + f[:, b:]
        f = torch.flip(torch.cummax(torch.flip(f, [1]), 1).values, [1])
    return f[:, 0]


class TreeAggregation(FollowsCycle, NoiseMechanism):
    """Tree-aggregation noise for :class:`~fxdp.optim.DPOptimizer` (see the module docstring).

    Args:
        steps: n, the number of steps the noise is planned for (its sensitivity computed for); a step past it is
            refused.
        min_separation: b, the fewest steps between two of a sample's steps (default ``steps``: each sample in at
            most one step). The mechanism follows a cyclic loader of at least ``b`` partitions (:meth:`follow`).

    Accounted without amplification (:class:`fxdp.accounting.MinSeparationTreeAccountant`): one Gaussian mechanism
    of noise multiplier ``sigma / sensitivity``.
    """

    name = "tree"
    _label = "tree aggregation"

    def __init__(self, *, steps: int, min_separation: Optional[int] = None):
        check_plan(steps, min_separation)
        self.planned_steps, self.min_separation = steps, min_separation or steps
        self._sensitivity = tree_sensitivity(steps, min_separation)
        self.steps = 0  # noise draws made
        # the node noises of the decomposition of ``steps``: (interval length, one tensor per parameter), longest
        # (earliest) first
        self._nodes: List[Tuple[int, List[torch.Tensor]]] = []
        self._init_cycle()

    @property
    def sensitivity(self) -> float:
        """:func:`tree_sensitivity` over the planned steps and pattern (computed once, at construction)."""
        return self._sensitivity

    @property
    def max_participations(self) -> int:
        return -(-self.planned_steps // self.min_separation)

    @property
    def _separation(self) -> int:
        return self.min_separation

    def add_noise_(self, outs: List[torch.Tensor], std: float, *, secure_mode: bool = False,
                   generator: Optional[torch.Generator] = None) -> None:
        self.check_step()
        if self._nodes and [tuple(t.shape) for t in self._nodes[0][1]] != [tuple(o.shape) for o in outs]:
            raise StepRefusedError("fxdp: the trainable parameters changed since the tree aggregation noise began (its "
                                   "state holds node noises per parameter); keep them for the whole run")
        length = lowbit(self.steps + 1)
        fresh = [torch.zeros_like(out) for out in outs]  # z of the interval released at this step
        add_gaussian_noise_all_(fresh, 1.0, secure_mode=secure_mode, generator=generator)
        w = [z.clone() for z in fresh]
        while self._nodes and self._nodes[-1][0] < length:  # the intervals the new one covers leave the prefix
            _, covered = self._nodes.pop()
            torch._foreach_sub_(w, covered)
        self._nodes.append((length, fresh))
        if std != 0:
            torch._foreach_add_(outs, w, alpha=std)
        self.steps += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"planned_steps": self.planned_steps, "min_separation": self.min_separation, **self._cycle_state(),
                "nodes": [(length, [t.clone() for t in node]) for length, node in self._nodes]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = (state["planned_steps"], state["min_separation"])
        if saved != (self.planned_steps, self.min_separation):
            raise ValueError(f"fxdp: the checkpoint's tree aggregation (steps, min_separation) {saved} differs from "
                             f"this mechanism's {(self.planned_steps, self.min_separation)}; build it with the "
                             "checkpoint's")
        self._load_cycle_state(state)
        self._nodes = [(int(length), [t.clone() for t in node]) for length, node in state["nodes"]]

    def memory_bytes(self) -> int:
        """Bytes of the kept node noises: at most ``floor(log2 steps) + 1`` copies of the trainable parameters (in
        at least float32)."""
        return sum(t.numel() * t.element_size() for _, node in self._nodes for t in node)

    def __repr__(self) -> str:
        return f"TreeAggregation(steps={self.planned_steps}, min_separation={self.min_separation})"

