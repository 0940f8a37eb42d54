"""Accountants by name: ``create_accountant("pld")`` (fxdp's default), ``"rdp"``, and the names code written
for Opacus uses: ``"prv"`` (served by the PLD accountant) and ``"gdp"``."""

from __future__ import annotations

from typing import Callable, Dict

from fxdp.accounting.accountant import Accountant
from fxdp.accounting.gdp import GDPAccountant
from fxdp.accounting.pld import PLDAccountant
from fxdp.accounting.rdp import RDPAccountant

ACCOUNTANTS: Dict[str, Callable[[], Accountant]] = {
    PLDAccountant.mechanism: PLDAccountant,
    RDPAccountant.mechanism: RDPAccountant,
    # Opacus's default, the privacy random variable: the same object as the privacy-loss distribution, whose
    # numerical composition the PLD accountant does (as tight: a bound, never below the exact ε)
    "prv": PLDAccountant,
    GDPAccountant.mechanism: GDPAccountant,  # a central-limit approximation, not a bound (it says so)
}


def create_accountant(name: str) -> Accountant:
    """A fresh accountant of kind ``name``: ``"pld"`` (the default: the tightest bound), ``"rdp"``,
    ``"prv"`` (the PLD accountant, under Opacus's name) or ``"gdp"`` (an approximation, not a bound)."""
    if not isinstance(name, str) or name not in ACCOUNTANTS:
        raise ValueError(
            f"unknown accountant {name!r}; choose one of {', '.join(repr(n) for n in ACCOUNTANTS)}"
        )
    return ACCOUNTANTS[name]()
