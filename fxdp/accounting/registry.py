"""Accountants by name: ``create_accountant("rdp")``, ``create_accountant("pld")``."""

from __future__ import annotations

from typing import Callable, Dict

from fxdp.accounting.accountant import Accountant
from fxdp.accounting.pld import PLDAccountant
from fxdp.accounting.rdp import RDPAccountant

ACCOUNTANTS: Dict[str, Callable[[], Accountant]] = {
    RDPAccountant.mechanism: RDPAccountant,
    PLDAccountant.mechanism: PLDAccountant,
}


def create_accountant(name: str) -> Accountant:
    """A fresh accountant of kind ``name``: ``"rdp"`` (built in) or ``"pld"`` (needs dp-accounting)."""
    if not isinstance(name, str) or name not in ACCOUNTANTS:
        raise ValueError(
            f"unknown accountant {name!r}; choose one of {', '.join(repr(n) for n in ACCOUNTANTS)}"
        )
    return ACCOUNTANTS[name]()
