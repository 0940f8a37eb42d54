"""Accounting for banded matrix factorization (banded MF) noise with amplification by cyclic Poisson sampling.

The reduction (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu 2023, "Amplified Banded Matrix
Factorization: A unified approach to private training", NeurIPS 2023; the analysis jax_privacy's
``DpsgdTrainingAccountant`` implements with ``cycle_length``). What is assumed, each point checked or refused:

1. *The noise*: banded MF with a lower-triangular ``C`` of at most ``bands`` bands; the noise added at step ``t`` is
   ``(C^-1 Z)_t`` with ``Z``'s rows i.i.d. ``N(0, sigma^2 C_clip^2 sens^2)``, ``sens`` the largest column norm
   of ``C`` (:class:`fxdp.optim.correlated.BandedMatrixFactorization` normalises ``C`` so that ``sens = 1``),
   ``C_clip`` the clipping bound of each sample's gradient (flat clipping, or the total of per-layer bounds).
2. *The sampling*: the dataset split once into ``partitions >= bands`` parts, each sample's part independent
   of the others; step ``t`` Poisson-samples part ``t mod partitions`` at rate ``q`` (:class:`fxdp.data.
   CyclicPoissonDataLoader`), every batch used by exactly one step, in order (the noise mechanism refuses a
   step whose batch breaks the cycle).
3. *Neighbouring*: add/remove one sample, as for fxdp's DP-SGD accountants.
4. *One noise multiplier and one rate* for the whole run: the reduction's blocks of steps must all see the same
   mechanism; a history with more than one ``(noise_multiplier, sample_rate)`` is refused.

The claim. A sample of part ``j`` can only enter the steps ``t = j, j + b', j + 2b', ...`` (``b'`` the
partitions); with ``C`` at most ``b'``-banded, the rows of ``C X + Z`` that such a step's gradient reaches, rows
``t .. t + bands - 1``, reach no other step the sample can enter. The release is then, row block by row
block, an adaptive composition of Poisson-subsampled Gaussian mechanisms (the paper's Theorem 4, which handles
the adaptivity): the run is as private as DP-SGD with rate ``q``, noise multiplier ``sigma / sens`` and
``ceil(steps / partitions)`` steps, the most steps a sample's part can have among ``steps`` consecutive ones.
This accountant composes exactly those events with ``dp-accounting``'s PLD accountant.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

from fxdp.accounting.accountant import Accountant, check_delta
from fxdp.accounting.pld import import_dp_accounting


class CyclicPoissonBandedMFAccountant(Accountant):
    """(ε, δ) of banded MF noise under cyclic Poisson sampling (see the module docstring for what is assumed).

    Args:
        bands: the noise's bands (``noise_mechanism.bands``).
        partitions: the loader's parts (``loader.partitions``), at least ``bands``.
        sensitivity: the largest column norm of ``C`` (``noise_mechanism.sensitivity``: 1 for fxdp's strategies).
        value_discretization_interval: of the PLD, as for :class:`~fxdp.accounting.PLDAccountant`.

    Steps are recorded as for the other accountants (``step(noise_multiplier=, sample_rate=)`` with the rate
    within a part, or the optimizer hook of :meth:`get_optimizer_hook_fn`). :meth:`check_loader` refuses a loader
    whose sampling this analysis does not cover.
    """

    mechanism = "banded_mf_cyclic_poisson"
    analyses_correlated_noise = True

    def __init__(self, *, bands: int, partitions: int, sensitivity: float = 1.0,
                 value_discretization_interval: float = 1e-4) -> None:
        super().__init__()
        self._dp_accounting = import_dp_accounting()
        for name, value in (("bands", bands), ("partitions", partitions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if partitions < bands:
            raise ValueError(f"banded MF with {bands} bands is accounted with amplification only for a cyclic loader "
                             f"of at least {bands} partitions (a sample's steps must meet disjoint bands of C), got "
                             f"partitions={partitions}")
        check_pld_settings(sensitivity, value_discretization_interval)
        self.bands, self.partitions, self.sensitivity = bands, partitions, float(sensitivity)
        self.value_discretization_interval = float(value_discretization_interval)

    def check_loader(self, loader: Any) -> None:
        """Refuse a loader whose sampling this accountant does not cover: anything but a cyclic Poisson loader
        (:class:`fxdp.data.CyclicPoissonDataLoader`) of this accountant's partitions."""
        check_cyclic_loader(loader, self.partitions, lambda sampler: (
            f"banded MF noise is accounted with amplification for cyclic Poisson sampling only (each sample in "
            f"one fixed part, step t sampling part t mod partitions); this loader samples with {sampler}, under "
            f"which a sample may take part in steps closer than {self.bands} apart and this ε would not hold. Train "
            f"on fxdp.data.CyclicPoissonDataLoader(..., partitions={self.partitions})"))

    def dp_event(self) -> Any:
        """The ``dp-accounting`` event this run is as private as (``None`` when no step touched the data)."""
        dpa = self._dp_accounting
        spending = [(sigma, q, n) for sigma, q, n in self.history if q > 0 and n > 0]
        if not spending:
            return None
        settings = {(sigma, q) for sigma, q, _ in spending}
        if len(settings) > 1:
            raise ValueError(
                f"the cyclic Poisson reduction for banded MF covers one noise multiplier and one sample rate for the "
                f"whole run; these steps used {sorted(settings)} (noise_multiplier, sample_rate). Keep both fixed "
                "(no noise scheduler) with banded MF noise")
        (sigma, q), = settings
        steps = sum(n for _, _, n in self.history)  # every step counts for the cycle, even one at rate 0
        participations = math.ceil(steps / self.partitions)
        return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma / self.sensitivity)),
                                       participations)

    def get_epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        event = self.dp_event()
        if event is None:
            return 0.0
        if event.event.event.noise_multiplier == 0:
            return math.inf  # a step without noise that may touch the data is not private
        dpa = self._dp_accounting
        accountant = dpa.pld.PLDAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                           value_discretization_interval=self.value_discretization_interval)
        accountant.compose(event)
        return float(accountant.get_epsilon(delta))

    def state_dict(self, destination: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        state = super().state_dict(destination)
        state["correlated"] = {"bands": self.bands, "partitions": self.partitions, "sensitivity": self.sensitivity}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Only a history this kind of accountant saved, for the same bands, partitions and sensitivity: steps of
        independent noise, or of another cycle, are not the mechanism this analysis covers."""
        mine = {"bands": self.bands, "partitions": self.partitions, "sensitivity": self.sensitivity}
        saved = state_dict.get("correlated") if isinstance(state_dict, dict) else None
        if saved != mine:
            raise ValueError(f"the history was saved for {saved or 'independent Gaussian noise'}; this accountant "
                             f"analyses banded MF with {mine}. Load it into an accountant of the same kind")
        super().load_state_dict(state_dict)


def check_pld_settings(sensitivity: Any, value_discretization_interval: Any) -> None:
    """A correlated-noise accountant's sensitivity and PLD discretization, checked."""
    if isinstance(sensitivity, bool) or not isinstance(sensitivity, (int, float)) or not (0 < sensitivity < math.inf):
        raise ValueError(f"sensitivity must be a finite number > 0, got {sensitivity!r}")
    if not value_discretization_interval > 0:
        raise ValueError(f"value_discretization_interval must be > 0, got {value_discretization_interval!r}")


def check_cyclic_loader(loader: Any, partitions: int, refusal: Callable[[str], str]) -> None:
    """Refuse a loader that is not a cyclic loader (:class:`fxdp.data.CyclicPoissonDataLoader`) of ``partitions``
    partitions; ``refusal(sampler's class name)`` says why another sampling is not covered."""
    sampler = getattr(loader, "batch_sampler", None)
    if type(sampler).__name__ != "CyclicPoissonBatchSampler" or not hasattr(sampler, "partition_of"):
        raise ValueError(refusal(type(sampler).__name__))
    if getattr(sampler, "partitions", None) != partitions:
        raise ValueError(f"the loader has {sampler.partitions} partitions, this accountant analyses {partitions}; "
                         "build both with the same partitions")
