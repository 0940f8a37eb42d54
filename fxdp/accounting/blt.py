"""Accounting for BLT (buffered linear Toeplitz) noise under min-separation participation, without amplification.

The analysis (Denisov, McMahan, Rush, Smith, Thakurta 2022, "Improved differential privacy for SGD via optimal
private linear operators on adaptive streams"; Choquette-Choo et al. 2023 for multiple participations;
McMahan et al. 2024, "Hassle-free ...", for BLTs). What is assumed, each point checked or refused:

1. *The noise*: the training noise is ``C^-1 Z``, ``C`` lower-triangular Toeplitz, ``Z``'s rows i.i.d.
   ``N(0, sigma^2 C_clip^2)``, and ``C`` normalised so that its sensitivity over the planned ``steps`` under the
   participation pattern below is ``sensitivity`` (:class:`fxdp.optim.correlated.BufferedLinearToeplitz`
   normalises to 1; a step past the planned ones is refused by the mechanism and by :meth:`get_epsilon`).
2. *The participation*: a sample's steps are at least ``min_separation`` apart. A cyclic loader
   (:class:`fxdp.data.CyclicPoissonDataLoader`) of ``partitions >= min_separation`` whose batches are used in
   order, one per step, guarantees it, whatever its sample rate (the mechanism refuses a step that breaks the
   cycle; :meth:`check_loader` refuses any other loader).
3. *Neighbouring*: add/remove one sample; each sample's gradient clipped to ``C_clip``.
4. *One noise multiplier* for the whole run (a history with more than one is refused).

The claim. With ``C`` lower triangular, the release ``C X + Z`` of adaptively chosen gradients ``X`` is as
private as the Gaussian mechanism of the same sensitivity (Denisov et al. 2022, Theorem 2.1, for any number of
participations within the pattern): ``sigma / sensitivity`` is its noise multiplier, whatever the sample rate
(no amplification by sampling is claimed) and however many of the planned steps have run. This accountant gives
``dp-accounting``'s PLD ε of that one Gaussian event.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from fxdp.accounting.accountant import Accountant, check_delta
from fxdp.accounting.banded_mf import check_cyclic_loader, check_pld_settings
from fxdp.accounting.pld import import_dp_accounting


class MinSeparationBLTAccountant(Accountant):
    """(ε, δ) of BLT noise under min-separation participation (see the module docstring for what is assumed).

    Args:
        min_separation: the fewest steps between two of a sample's steps (``noise_mechanism.min_separation``).
        steps: the steps the noise is planned (normalised) for (``noise_mechanism.planned_steps``).
        partitions: the cyclic loader's (``loader.partitions``), at least ``min_separation``.
        sensitivity: of the normalised strategy under the pattern (``noise_mechanism.sensitivity``: 1).
        value_discretization_interval: of the PLD, as for :class:`~fxdp.accounting.PLDAccountant`.
    """

    mechanism = "blt_min_separation"
    #: the noise it accounts, in messages, and in the saved history's ``correlated`` entry
    noise_label, kind = "BLT", "blt"
    analyses_correlated_noise = True

    def __init__(self, *, min_separation: int, steps: int, partitions: int, sensitivity: float = 1.0,
                 value_discretization_interval: float = 1e-4) -> None:
        super().__init__()
        self._dp_accounting = import_dp_accounting()
        for name, value in (("min_separation", min_separation), ("steps", steps), ("partitions", partitions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if partitions < min_separation:
            raise ValueError(f"{self.noise_label} noise planned for a minimum separation of {min_separation} steps is "
                             f"accounted only for a cyclic loader of at least {min_separation} partitions, got "
                             f"partitions={partitions}")
        check_pld_settings(sensitivity, value_discretization_interval)
        self.min_separation, self.planned_steps, self.partitions = min_separation, steps, partitions
        self.sensitivity = float(sensitivity)
        self.value_discretization_interval = float(value_discretization_interval)

    def check_loader(self, loader: Any) -> None:
        """Refuse a loader whose participation this accountant does not cover: anything but a cyclic loader
        (:class:`fxdp.data.CyclicPoissonDataLoader`) of this accountant's partitions."""
        check_cyclic_loader(loader, self.partitions, lambda sampler: (
            f"{self.noise_label} noise is accounted for participation at least {self.min_separation} steps apart; "
            f"this loader samples with {sampler}, under which a sample may take part in steps closer than that, "
            f"and this ε would not hold. Train on fxdp.data.CyclicPoissonDataLoader(..., "
            f"partitions={self.partitions}) (each sample in one fixed part, step t drawing from part t mod "
            "partitions)"))

    def dp_event(self) -> Any:
        """The ``dp-accounting`` event this run is as private as (``None`` when no step ran)."""
        steps = len(self)
        if steps == 0:
            return None
        if steps > self.planned_steps:
            raise ValueError(f"{steps} steps were recorded; the {self.noise_label} noise was planned for "
                             f"{self.planned_steps}, and no ε is claimed past them. Plan the mechanism for the whole "
                             "run (steps=)")
        sigmas = {sigma for sigma, _, _ in self.history}
        if len(sigmas) > 1:
            raise ValueError(f"{self.noise_label} noise is accounted for one noise multiplier for the whole run; "
                             f"these steps used {sorted(sigmas)}. Keep it fixed (no noise scheduler) with "
                             f"{self.noise_label} noise")
        (sigma,) = sigmas
        return self._dp_accounting.GaussianDpEvent(sigma / self.sensitivity)

    def get_epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        event = self.dp_event()
        if event is None:
            return 0.0
        if event.noise_multiplier == 0:
            return math.inf
        dpa = self._dp_accounting
        accountant = dpa.pld.PLDAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                           value_discretization_interval=self.value_discretization_interval)
        accountant.compose(event)
        return float(accountant.get_epsilon(delta))

    def _mine(self) -> Dict[str, Any]:
        return {"kind": self.kind, "min_separation": self.min_separation, "steps": self.planned_steps,
                "partitions": self.partitions, "sensitivity": self.sensitivity}

    def state_dict(self, destination: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        state = super().state_dict(destination)
        state["correlated"] = self._mine()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Only a history this kind of accountant saved, for the same plan: steps of independent noise, or of
        another mechanism or pattern, are not what this analysis covers."""
        saved = state_dict.get("correlated") if isinstance(state_dict, dict) else None
        if saved != self._mine():
            raise ValueError(f"the history was saved for {saved or 'independent Gaussian noise'}; this accountant "
                             f"analyses {self.noise_label} noise with {self._mine()}. Load it into an accountant of "
                             "the same kind")
        super().load_state_dict(state_dict)


def blt_noise_multiplier(*, target_epsilon: float, target_delta: float, sensitivity: float = 1.0,
                         epsilon_tolerance: float = 0.01, value_discretization_interval: float = 1e-4) -> float:
    """The smallest noise multiplier (within ``epsilon_tolerance``) for which :class:`MinSeparationBLTAccountant`
    reports at most ``target_epsilon``: bisection on the one Gaussian event's PLD ε."""
    dpa = import_dp_accounting()
    delta = check_delta(target_delta)
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}")

    def epsilon(sigma: float) -> float:
        accountant = dpa.pld.PLDAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                           value_discretization_interval=value_discretization_interval)
        accountant.compose(dpa.GaussianDpEvent(sigma / sensitivity))
        return float(accountant.get_epsilon(delta))

    low, high = 0.0, 1.0
    while epsilon(high) > target_epsilon:
        low, high = high, 2 * high
        if high > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon={target_epsilon} at delta={delta}")
    for _ in range(200):
        if epsilon(high) >= target_epsilon - epsilon_tolerance:
            break
        middle = (low + high) / 2
        if epsilon(middle) > target_epsilon:
            low = middle
        else:
            high = middle
    return high
