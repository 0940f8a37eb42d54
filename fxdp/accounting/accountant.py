"""The accountant interface: a record of the DP-SGD steps taken, and the privacy they spent.

An accountant only *records* steps: one entry of its :attr:`Accountant.history` is
``(noise_multiplier, sample_rate, num_steps)``, consecutive steps with the same parameters merged into
one entry. What ε those steps cost is computed on demand by :meth:`Accountant.get_epsilon`, so the
history is the whole state: a checkpoint that keeps it keeps the privacy already spent.

Every accountant here analyses the same mechanism, one DP-SGD step:

- *Poisson subsampling*: each example joins the batch independently with probability ``sample_rate``
  (``q``). The analysis does not hold for shuffled fixed-size batches.
- the *Gaussian mechanism*: the sum of per-example gradients, each clipped to norm ``C``, plus noise
  ``N(0, sigma^2 C^2)`` per coordinate, ``sigma`` the ``noise_multiplier``.
- *add/remove neighbouring*: two datasets are neighbours when one is the other plus one example.

This package is pure math: it imports nothing from the rest of fxdp.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

HistoryEntry = Tuple[float, float, int]  # (noise_multiplier, sample_rate, num_steps)


def check_noise_multiplier(noise_multiplier: Any) -> float:
    """``noise_multiplier`` as a float, or a ValueError naming it."""
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float)):
        raise ValueError(f"noise_multiplier must be a number, got {noise_multiplier!r}")
    value = float(noise_multiplier)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    return value


def check_sample_rate(sample_rate: Any) -> float:
    """``sample_rate`` as a float in [0, 1], or a ValueError naming it."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)):
        raise ValueError(f"sample_rate must be a number, got {sample_rate!r}")
    value = float(sample_rate)
    if not 0 <= value <= 1:  # also refuses nan
        raise ValueError(
            f"sample_rate must lie in [0, 1] (the probability that an example joins a batch), "
            f"got {sample_rate!r}"
        )
    return value


def check_delta(delta: Any) -> float:
    """``delta`` as a float in (0, 1), or a ValueError naming it."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    value = float(delta)
    if not 0 < value < 1:  # also refuses nan
        raise ValueError(
            f"delta must lie strictly between 0 and 1, got {delta!r}; a common choice is "
            f"delta < 1 / (number of examples), e.g. 1e-5"
        )
    return value


def check_num_steps(num_steps: Any, name: str = "num_steps") -> int:
    """``num_steps`` as an int >= 0, or a ValueError naming it."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int):
        if not (isinstance(num_steps, float) and num_steps.is_integer()):
            raise ValueError(f"{name} must be a whole number >= 0, got {num_steps!r}")
    if num_steps < 0:
        raise ValueError(f"{name} must be >= 0, got {num_steps!r}")
    return int(num_steps)


class MechanismName(str):
    """An accountant's name, read as Opacus's code reads it too: ``accountant.mechanism`` is the string,
    and ``accountant.mechanism()`` (Opacus's classmethod) returns it."""

    def __call__(self) -> str:
        return str(self)


class Accountant(abc.ABC):
    """Records DP-SGD steps and reports the (ε, δ) they spent (Opacus's ``IAccountant``).

    Subclasses set :attr:`mechanism` (the name :func:`create_accountant` knows them by) and implement
    :meth:`get_epsilon`; the history, its merging and its (de)serialisation live here.
    """

    mechanism: str = MechanismName("")
    #: whether :meth:`get_epsilon` is an upper bound on the ε spent (the GDP approximation is not)
    is_bound: bool = True
    #: whether it analyses noise correlated across steps (a history of such steps, saved with a "correlated" entry,
    #: loads only into an accountant of that kind: :mod:`fxdp.accounting.banded_mf`)
    analyses_correlated_noise: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if isinstance(vars(cls).get("mechanism"), str):
            cls.mechanism = MechanismName(vars(cls)["mechanism"])

    def __init__(self) -> None:
        self.history: List[HistoryEntry] = []

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one step of the Poisson-subsampled Gaussian mechanism."""
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + 1)
        else:
            self.history.append((sigma, q, 1))

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """The ε such that all recorded steps together are (ε, ``delta``)-DP; ``math.inf`` when a step
        with ``sample_rate > 0`` had no noise, 0 when no step touched the data."""

    def __len__(self) -> int:
        """The total number of steps recorded."""
        return sum(num_steps for _, _, num_steps in self.history)

    def get_privacy_spent(self, *, delta: float, **kwargs: Any) -> Tuple[float, Optional[float]]:
        """``(ε, None)`` at ``delta`` (Opacus's name; Opacus's RDP accountant puts the best Rényi order second,
        fxdp's :meth:`RDPAccountant.get_privacy_spent` too)."""
        return self.get_epsilon(delta=delta, **kwargs), None

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """A step hook for ``DPOptimizer.attach_step_hook``: records one step at ``sample_rate`` with the
        optimizer's noise multiplier at that step (a scheduler's change counts from the step it applies to)."""
        sample_rate = check_sample_rate(sample_rate)

        def hook(optimizer: Any) -> None:
            self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=sample_rate)

        return hook

    def state_dict(self, destination: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The history (a copy: plain floats and ints) and the mechanism's name, into ``destination`` when given."""
        state = {} if destination is None else destination
        state["history"] = [tuple(entry) for entry in self.history]
        state["mechanism"] = str(self.mechanism)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Replace the history with a saved one.

        A history records what was done, not how it was analysed, so one saved by another accountant that
        reports a bound is accepted: loading an RDP accountant's history into a PLD accountant analyses the
        same steps more tightly. An accountant that is not a bound (GDP) loads only its own kind's history: a
        run reported with a bound would silently continue with an approximation.
        """
        if not isinstance(state_dict, dict) or "history" not in state_dict or "mechanism" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expects the dict that state_dict() returned "
                f"(with 'history' and 'mechanism' keys), got {state_dict!r:.200}"
            )
        if state_dict.get("correlated") is not None and not self.analyses_correlated_noise:
            raise ValueError(
                f"the history was saved by a {state_dict['mechanism']!r} accountant, of steps with noise correlated "
                f"across steps; {type(self).__name__} analyses independent noise and would report an ε that does "
                "not hold. Load it into the accountant that saved it")
        if not self.is_bound and str(state_dict["mechanism"]) != self.mechanism:
            raise ValueError(
                f"the history was saved by a {state_dict['mechanism']!r} accountant; "
                f"{type(self).__name__} ({self.mechanism!r}) is an approximation, not a bound. Load it into an "
                "accountant that reports a bound (create_accountant('pld') or 'rdp')")
        history: List[HistoryEntry] = []
        for i, entry in enumerate(state_dict["history"]):
            try:
                sigma, q, num_steps = entry
            except (TypeError, ValueError):
                raise ValueError(
                    f"history[{i}] must be (noise_multiplier, sample_rate, num_steps), got {entry!r}"
                ) from None
            history.append(
                (
                    check_noise_multiplier(sigma),
                    check_sample_rate(q),
                    check_num_steps(num_steps, f"history[{i}] num_steps"),
                )
            )
        self.history = history

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={len(self)}, history={self.history!r})"
