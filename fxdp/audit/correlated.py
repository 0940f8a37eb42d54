"""Auditing a run with correlated noise (``make_private(..., noise_mechanism=BandedMatrixFactorization(...))`` or
``BufferedLinearToeplitz``): where the canaries join, and how the auditor undoes the correlation.

Where. The accounting of correlated noise assumes the sampling of the cyclic loader make_private builds: every
sample in one fixed part (drawn uniformly, independently of the others), step ``t`` sampling part ``t mod b`` at
rate ``q`` (banded MF: ``b = bands``; BLT: ``b`` = the batches of a pass at ``q = 1``). A gradient canary gets a
part the same way (:func:`canary_partitions`) and can join only the steps of its part
(``CanarySink.draw(eligible=...)`` with the loader's ``cycle_position``).

How. The noise added at step ``t`` is ``w_t = (C^-1 Z)_t`` with ``C`` the mechanism's lower-triangular Toeplitz
strategy normalised to sensitivity 1 (:func:`strategy_matrix`). In units of one clipped canary's step, canary
``j``'s updates over ``T`` steps are ``u = b + sigma C^-1 z`` (``b_t = 1`` on the steps it joined), so
``y = C u = C b + sigma z`` with ``z`` independent standard normal: the release the accountant analyses.
:class:`CorrelatedStepScores` forms ``y`` and scores each canary by the log-likelihood ratio of "in" to "out":

- Poisson sampling (``q < 1``, banded MF): the steps of one part are ``b >= bands`` apart, so their columns
  ``c_t`` of ``C`` have disjoint supports and the ratio is a product over those steps:
  ``sum_t log(1 - q + q exp((<y, c_t> - ||c_t||^2 / 2) / sigma^2))``;
- every step of the part (``q = 1``, BLT's fixed-epoch participation): ``s = C 1_part`` is known, and the ratio
  is ``(<y, s> - ||s||^2 / 2) / sigma^2``.

Without noise the score is the summed update. Any score gives a valid bound; these are the best ones for
canaries of this kind, so a leak the accountant does not allow shows up as clearly as it can.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional

import torch
from torch import nn


def strategy_matrix(mechanism: Any, n: int) -> torch.Tensor:
    """The ``n x n`` lower-triangular Toeplitz strategy ``C`` of ``mechanism`` (float64), normalised as the noise
    is: the noise added over ``n`` steps is ``C^-1 Z`` times DP-SGD's std."""
    from fxdp.optim.correlated import BandedMatrixFactorization, BufferedLinearToeplitz

    if isinstance(mechanism, BandedMatrixFactorization):
        coefficients = torch.tensor(mechanism.coefficients, dtype=torch.float64)[:n]
    elif isinstance(mechanism, BufferedLinearToeplitz):
        coefficients = mechanism.coefficients(n) / mechanism.scale  # its noise is scale * C_raw^-1 z
    else:
        raise ValueError(f"fxdp.audit: no strategy matrix known for the noise mechanism {mechanism!r}; the audit "
                         "knows BandedMatrixFactorization and BufferedLinearToeplitz")
    matrix = torch.zeros(n, n, dtype=torch.float64)
    for k, c in enumerate(coefficients.tolist()):
        matrix += torch.diag(torch.full((n - k,), float(c), dtype=torch.float64), -k)
    return matrix


def canary_partitions(canaries: int, partitions: int, generator: torch.Generator) -> torch.Tensor:
    """Each canary's part of the cycle, uniform and independent (the law of the cyclic loader's samples)."""
    return torch.randint(partitions, (canaries,), generator=generator)


class CorrelatedStepScores:
    """Scores of gradient canaries under correlated noise (see the module docstring). Call it after each step (an
    optimizer step hook); ``position()`` is the cycle position of the step's batch (the loader's
    ``cycle_position``), ``partition`` each canary's part, ``strategy(n)`` the ``n x n`` normalised ``C``."""

    def __init__(self, block: nn.Parameter, *, unit: float, noise_multiplier: float, sample_rate: float,
                 partition: torch.Tensor, position: Callable[[], Optional[int]],
                 strategy: Callable[[int], torch.Tensor]):
        if unit <= 0:
            raise ValueError(f"fxdp.audit: the canaries' step unit must be positive, got {unit}")
        self.block, self.unit = block, float(unit)
        self.sigma, self.q = float(noise_multiplier), float(sample_rate)
        self.partition, self.position, self.strategy = partition.long(), position, strategy
        self.previous = block.detach().clone()
        self.updates: List[torch.Tensor] = []  # u_t, in units of one clipped canary's step
        self.positions: List[int] = []

    def __call__(self, optimizer=None) -> None:
        now = self.block.detach().clone()
        self.updates.append((self.previous - now).double().cpu() / self.unit)
        self.previous = now
        position = self.position()
        if position is None:
            raise ValueError("fxdp.audit: the loader told no cycle position for this step")
        self.positions.append(int(position))

    def scores(self) -> torch.Tensor:
        """One score per canary; high means "was in"."""
        if not self.updates:
            return torch.zeros(self.block.numel(), dtype=torch.float64)
        u = torch.stack(self.updates)  # (T, m)
        if self.sigma == 0:
            return u.sum(0)
        c = self.strategy(u.shape[0])
        y = c @ u  # C b + sigma z
        joinable = (torch.tensor(self.positions)[:, None] == self.partition[None, :]).double()  # (T, m)
        if self.q >= 1:
            s = c @ joinable  # the canary's signal if in
            return ((y * s).sum(0) - 0.5 * (s * s).sum(0)) / self.sigma ** 2
        along = c.T @ y  # <y_j, c_t>
        half = 0.5 * (c * c).sum(0)[:, None]  # ||c_t||^2 / 2
        x = (along - half) / self.sigma ** 2
        per_step = torch.logaddexp(torch.full_like(x, math.log1p(-self.q)), math.log(self.q) + x)
        return (per_step * joinable).sum(0)


__all__ = ["CorrelatedStepScores", "canary_partitions", "strategy_matrix"]
