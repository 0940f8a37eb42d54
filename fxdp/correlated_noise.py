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

Refused (no analysis here covers them yet): a loader kept as it is (``poisson_sampling=False``), training across
processes, padded batches, an engine whose accountant already recorded steps or is not PLD-based (``"rdp"``,
``"gdp"``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from fxdp.accounting import CyclicPoissonBandedMFAccountant, get_noise_multiplier, steps_in_epochs
from fxdp.accounting.accountant import Accountant
from fxdp.data import CyclicPoissonDataLoader
from fxdp.optim.correlated import BandedMatrixFactorization, NoiseMechanism

_PLD_ACCOUNTANTS = ("pld", "prv")


def check_correlated_noise(mechanism: NoiseMechanism, *, accountant: Accountant, accountant_name: str,
                           poisson_sampling: bool, padded_batches: Any, across_processes: bool) -> None:
    """Refuse, before anything is compiled, a setting whose privacy no analysis here covers."""
    if not isinstance(mechanism, BandedMatrixFactorization):
        raise ValueError(f"fxdp: make_private knows how to sample and account for BandedMatrixFactorization noise; "
                         f"{type(mechanism).__name__} has no accountant here yet")
    problems = []
    if not poisson_sampling:
        problems.append("poisson_sampling=False (banded MF needs its cyclic Poisson loader)")
    if across_processes:
        problems.append("a model trained across processes (not supported with correlated noise yet)")
    if padded_batches:
        problems.append("padded_batches (not supported with the cyclic loader yet)")
    if accountant_name not in _PLD_ACCOUNTANTS:
        problems.append(f"accountant={accountant_name!r} (banded MF is accounted with PLD: "
                        "PrivacyEngine(accountant='pld'))")
    if len(accountant) > 0:
        problems.append(f"an accountant that already recorded {len(accountant)} steps of independent noise")
    if problems:
        raise ValueError("fxdp: make_private with banded MF noise refuses " + "; ".join(problems))


def cyclic_loader(data_loader: DataLoader, mechanism: BandedMatrixFactorization, generator: Optional[torch.Generator],
                  batch_first: bool) -> Tuple[CyclicPoissonDataLoader, float, int]:
    """``(loader, sample rate within a part, expected batch size)`` for ``mechanism``: ``partitions = bands``."""
    loader = CyclicPoissonDataLoader.from_data_loader(data_loader, generator=generator, partitions=mechanism.bands,
                                                      batch_first=batch_first)
    return loader, loader.sample_rate, max(1, round(loader.expected_batch_size))


def correlated_accountant(mechanism: BandedMatrixFactorization, loader: CyclicPoissonDataLoader) -> Accountant:
    """The accountant of ``mechanism`` on ``loader``, after the mechanism is set to follow the loader's cycle."""
    accountant = CyclicPoissonBandedMFAccountant(bands=mechanism.bands, partitions=loader.partitions,
                                                 sensitivity=mechanism.sensitivity)
    accountant.check_loader(loader)
    mechanism.follow(loader)
    return accountant


def correlated_noise_multiplier(mechanism: NoiseMechanism, data_loader: DataLoader, *, target_epsilon: float,
                                target_delta: float, epochs: float, epsilon_tolerance: float) -> float:
    """The smallest sigma (within the tolerance) for which ``epochs`` passes of the cyclic loader
    :func:`cyclic_loader` builds spend at most ``target_epsilon``: the accountant's composition is DP-SGD's
    with rate ``bands / steps per pass``, ``ceil(steps / bands)`` steps and noise ``sigma / sensitivity``."""
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
