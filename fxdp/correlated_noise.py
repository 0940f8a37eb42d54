"""``make_private(..., noise_mechanism=BandedMatrixFactorization(bands))``: what the PrivacyEngine does for noise
correlated across steps, kept out of :mod:`fxdp.privacy_engine`.

For banded MF noise (:mod:`fxdp.optim.correlated.banded`) with amplification:

- the loader becomes a cyclic Poisson one (:class:`fxdp.data.CyclicPoissonDataLoader`) of ``partitions = bands``,
  with about the user's batch size: ``len(loader)`` steps per pass rounded up to a multiple of ``bands``, each
  sample in one fixed part, step ``t`` sampling part ``t mod bands`` at rate ``bands / steps per pass``;
- the noise mechanism follows that loader (a step whose batch breaks the cycle is refused);
- the engine's accountant becomes a :class:`fxdp.accounting.CyclicPoissonBandedMFAccountant` (PLD), which checks
  the loader;
- ``make_private_with_epsilon`` calibrates sigma for that accountant's composition.

For BLT noise (:mod:`fxdp.optim.correlated.blt`), banded MF planned for a number of steps
(``BandedMatrixFactorization(bands, steps=n, min_separation=b)``; ``BandedMatrixFactorization.optimized(bands,
steps=n, min_separation=b)`` with its strategy optimised for that pattern) and tree aggregation
(:mod:`fxdp.optim.correlated.tree`), all without amplification (min-separation participation):

- the loader becomes a cyclic loader of ``partitions = len(loader)`` and sample rate 1 (fixed-epoch participation:
  each sample in one fixed batch per pass, its steps ``len(loader)`` apart), refused when the mechanism was planned
  for a larger minimum separation;
- the engine's accountant becomes a :class:`fxdp.accounting.MinSeparationBLTAccountant` (or its banded MF and tree
  variants, :mod:`fxdp.accounting.min_separation`: one Gaussian event of noise ``sigma / sensitivity``), which
  checks the loader; ``make_private_with_epsilon`` refuses epochs needing more
  steps than the mechanism was planned for.

Across processes (DDP, FSDP2) the cyclic loader gives each rank its share of the batches one process draws
(:mod:`fxdp.data.cyclic`) and the noise is one process's (:mod:`fxdp.optim.correlated.processes`).

Refused (no analysis here covers them yet): a loader kept as it is (``poisson_sampling=False``), padded batches,
an engine whose accountant already recorded steps or is not PLD-based (``"rdp"``, ``"gdp"``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from fxdp.accounting import CyclicPoissonBandedMFAccountant, get_noise_multiplier, steps_in_epochs
from fxdp.accounting.accountant import Accountant
from fxdp.accounting.blt import MinSeparationBLTAccountant, blt_noise_multiplier
from fxdp.accounting.min_separation import MinSeparationBandedMFAccountant, MinSeparationTreeAccountant
from fxdp.data import CyclicPoissonDataLoader
from fxdp.optim.correlated import BandedMatrixFactorization, BufferedLinearToeplitz, NoiseMechanism, TreeAggregation

_PLD_ACCOUNTANTS = ("pld", "prv")
_MIN_SEPARATION_ACCOUNTANTS = {"blt": MinSeparationBLTAccountant, "banded_mf": MinSeparationBandedMFAccountant,
                               "tree": MinSeparationTreeAccountant}


def without_amplification(mechanism: NoiseMechanism) -> bool:
    """Whether ``mechanism`` is accounted under min-separation participation, without amplification (BLT, tree
    aggregation, banded MF built with ``steps=``), rather than with cyclic Poisson amplification (banded MF)."""
    return isinstance(mechanism, (BufferedLinearToeplitz, TreeAggregation)) or (
        isinstance(mechanism, BandedMatrixFactorization) and not mechanism.amplified)


def _label(mechanism: NoiseMechanism) -> str:
    return {"blt": "BLT", "tree": "tree aggregation"}.get(mechanism.name, "banded MF")


def check_correlated_noise(mechanism: NoiseMechanism, *, accountant: Accountant, accountant_name: str,
                           poisson_sampling: bool, padded_batches: Any, across_processes: bool) -> None:
    """Refuse, before anything is compiled, a setting whose privacy no analysis here covers."""
    if not isinstance(mechanism, (BandedMatrixFactorization, BufferedLinearToeplitz, TreeAggregation)):
        raise ValueError(f"fxdp: make_private knows how to sample and account for BandedMatrixFactorization, "
                         f"BufferedLinearToeplitz and TreeAggregation noise; {type(mechanism).__name__} has no "
                         "accountant here yet")
    label = _label(mechanism)
    problems = []
    if not poisson_sampling:
        problems.append(f"poisson_sampling=False ({label} needs its cyclic loader)")
    if across_processes and not mechanism.across_processes:
        problems.append(f"a model trained across processes (not supported with {type(mechanism).__name__} yet)")
    if padded_batches:
        problems.append("padded_batches (not supported with the cyclic loader yet)")
    if accountant_name not in _PLD_ACCOUNTANTS:
        problems.append(f"accountant={accountant_name!r} ({label} is accounted with PLD: "
                        "PrivacyEngine(accountant='pld'))")
    if len(accountant) > 0:
        problems.append(f"an accountant that already recorded {len(accountant)} steps of independent noise")
    if problems:
        raise ValueError(f"fxdp: make_private with {label} noise refuses " + "; ".join(problems))


def cyclic_loader(data_loader: DataLoader, mechanism: NoiseMechanism, generator: Optional[torch.Generator],
                  batch_first: bool, distributed: bool = False) -> Tuple[CyclicPoissonDataLoader, float, int]:
    """``(loader, sample rate within a part, expected batch size)`` for ``mechanism``: ``partitions = bands`` for
    banded MF with amplification; without (BLT, tree, banded MF with ``steps``) ``partitions = len(data_loader)`` at
    rate 1 (each sample in one fixed batch per pass). ``distributed``: each rank's share of the batches
    (``data_loader`` is a rank's: ``len`` its share's batches)."""
    unamplified = without_amplification(mechanism)
    partitions = max(1, len(data_loader)) if unamplified else mechanism.bands
    if unamplified and partitions < mechanism.min_separation:
        raise ValueError(
            f"fxdp: the {_label(mechanism)} noise was planned for a sample's steps {mechanism.min_separation} or more "
            f"apart; with {partitions} batches a pass, make_private's fixed-epoch loader puts them {partitions} apart. "
            f"Build the mechanism with min_separation <= {partitions} (the batches a pass), or use smaller batches")
    loader = CyclicPoissonDataLoader.from_data_loader(data_loader, generator=generator, partitions=partitions,
                                                      batch_first=batch_first, distributed=distributed)
    return loader, loader.sample_rate, max(1, round(loader.expected_batch_size))


def correlated_accountant(mechanism: NoiseMechanism, loader: CyclicPoissonDataLoader) -> Accountant:
    """The accountant of ``mechanism`` on ``loader``, after the mechanism is set to follow the loader's cycle."""
    accountant: Any
    if without_amplification(mechanism):
        accountant = _MIN_SEPARATION_ACCOUNTANTS[mechanism.name](
            min_separation=mechanism.min_separation, steps=mechanism.planned_steps, partitions=loader.partitions,
            sensitivity=mechanism.sensitivity)
    else:
        accountant = CyclicPoissonBandedMFAccountant(bands=mechanism.bands, partitions=loader.partitions,
                                                     sensitivity=mechanism.sensitivity)
    accountant.check_loader(loader)
    mechanism.follow(loader)
    return accountant


def correlated_noise_multiplier(mechanism: NoiseMechanism, data_loader: DataLoader, *, target_epsilon: float,
                                target_delta: float, epochs: float, epsilon_tolerance: float) -> float:
    """The smallest sigma (within the tolerance) for which ``epochs`` passes of the cyclic loader
    :func:`cyclic_loader` builds spend at most ``target_epsilon``: the accountant's composition is DP-SGD's
    with rate ``bands / steps per pass``, ``ceil(steps / bands)`` steps and noise ``sigma / sensitivity``. For
    mechanisms without amplification (BLT, tree, banded MF with ``steps``), one Gaussian event of noise
    ``sigma / sensitivity``, if the epochs fit in the steps it was planned for."""
    if without_amplification(mechanism):
        steps = steps_in_epochs(epochs * max(1, len(data_loader)), 1.0)
        if steps > mechanism.planned_steps:
            raise ValueError(f"fxdp: {epochs} epochs of {len(data_loader)} batches are {steps} steps; the "
                             f"{_label(mechanism)} noise was planned for {mechanism.planned_steps}. Build it with "
                             f"steps={steps}")
        return blt_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                    sensitivity=mechanism.sensitivity, epsilon_tolerance=epsilon_tolerance)
    if not isinstance(mechanism, BandedMatrixFactorization):
        raise ValueError(f"fxdp: make_private_with_epsilon calibrates BandedMatrixFactorization noise; "
                         f"{type(mechanism).__name__} has no accountant here yet")
    bands = mechanism.bands
    per_pass = -(-max(1, len(data_loader)) // bands) * bands
    participations = math.ceil(steps_in_epochs(epochs * per_pass, 1.0) / bands)
    sigma = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                 sample_rate=bands / per_pass, steps=participations, accountant="pld",
                                 epsilon_tolerance=epsilon_tolerance)
    return sigma * mechanism.sensitivity
