"""Accountants by name: ``create_accountant("pld")`` (fxdp's default), ``"rdp"``, and the names code written
for Opacus uses: ``"prv"`` (served by the PLD accountant) and ``"gdp"``; :func:`register_accountant` adds one."""

from __future__ import annotations

from typing import Callable, Dict

from fxdp.accounting.accountant import Accountant
from fxdp.accounting.gdp import GDPAccountant
from fxdp.accounting.pld import PLDAccountant, PRVAccountant
from fxdp.accounting.rdp import RDPAccountant

ACCOUNTANTS: Dict[str, Callable[[], Accountant]] = {
    PLDAccountant.mechanism: PLDAccountant,
    RDPAccountant.mechanism: RDPAccountant,
    # Opacus's default, the privacy random variable: the same object as the privacy-loss distribution, whose
    # numerical composition the PLD accountant does (as tight: a bound, never below the exact ε)
    PRVAccountant.mechanism: PRVAccountant,
    GDPAccountant.mechanism: GDPAccountant,  # a central-limit approximation, not a bound (it says so)
}
_ACCOUNTANTS = ACCOUNTANTS  # Opacus's name for the table


def register_accountant(mechanism: str, accountant: Callable[[], Accountant], force: bool = False) -> None:
    """Make ``create_accountant(mechanism)`` build ``accountant()``. Replacing a name already taken needs
    ``force=True`` (ValueError otherwise: the engine's ε would silently come from another analysis)."""
    if mechanism in ACCOUNTANTS and not force:
        raise ValueError(f"an accountant is already registered as {mechanism!r} ({ACCOUNTANTS[mechanism]!r}); "
                         "pass force=True to replace it")
    ACCOUNTANTS[mechanism] = accountant


def create_accountant(mechanism: str) -> Accountant:
    """A fresh accountant of kind ``mechanism``: ``"pld"`` (the default: the tightest bound), ``"rdp"``,
    ``"prv"`` (the PLD accountant, under Opacus's name), ``"gdp"`` (an approximation, not a bound), or one
    :func:`register_accountant` added."""
    if not isinstance(mechanism, str) or mechanism not in ACCOUNTANTS:
        raise ValueError(
            f"unknown accountant {mechanism!r}; choose one of {', '.join(repr(n) for n in ACCOUNTANTS)}"
        )
    return ACCOUNTANTS[mechanism]()
