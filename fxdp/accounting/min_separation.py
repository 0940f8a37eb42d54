"""Accounting without amplification for the other correlated-noise mechanisms under min-separation participation:
banded MF planned for a number of steps (:class:`MinSeparationBandedMFAccountant`) and tree aggregation
(:class:`MinSeparationTreeAccountant`).

The analysis and its assumptions are those of :class:`fxdp.accounting.MinSeparationBLTAccountant` (see
:mod:`fxdp.accounting.blt`): the release ``C X + Z`` of a lower-triangular ``C`` on adaptively chosen gradients
is as private as one Gaussian mechanism of noise multiplier ``sigma / sensitivity``, ``sensitivity`` the largest
norm of a sum of ``C``'s columns over a participation pattern whose steps are ``min_separation`` or more apart,
among the planned ``steps`` (the mechanism computes it: :attr:`fxdp.optim.correlated.BandedMatrixFactorization.
sensitivity`, :attr:`fxdp.optim.correlated.TreeAggregation.sensitivity`). No amplification by sampling is claimed;
the loader is checked (a cyclic loader of at least ``min_separation`` partitions), and steps past the planned
ones, or a changing noise multiplier, are refused. Only the name in messages and checkpoints differs.
"""

from __future__ import annotations

from fxdp.accounting.blt import MinSeparationBLTAccountant


class MinSeparationBandedMFAccountant(MinSeparationBLTAccountant):
    """(ε, δ) of banded MF noise without amplification, under min-separation participation (module docstring).
    Arguments as for :class:`~fxdp.accounting.MinSeparationBLTAccountant`; ``sensitivity`` is
    ``noise_mechanism.sensitivity`` of a ``BandedMatrixFactorization(..., steps=, min_separation=)``."""

    mechanism = "banded_mf_min_separation"
    noise_label, kind = "banded MF", "banded_mf_min_separation"


class MinSeparationTreeAccountant(MinSeparationBLTAccountant):
    """(ε, δ) of tree-aggregation noise under min-separation participation (module docstring). Arguments as for
    :class:`~fxdp.accounting.MinSeparationBLTAccountant`; ``sensitivity`` is ``noise_mechanism.sensitivity``."""

    mechanism = "tree_min_separation"
    noise_label, kind = "tree aggregation", "tree"
