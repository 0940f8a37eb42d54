"""Privacy accounting for DP-SGD: how much (ε, δ) the steps taken have spent, and how much noise a
target ε needs.

- :class:`RDPAccountant` (``"rdp"``, built in): Rényi DP of the Poisson-subsampled Gaussian mechanism.
- :class:`PLDAccountant` (``"pld"``): privacy-loss distributions through Google's ``dp-accounting``
  (``pip install "fxdp[accounting]"``); tighter, slower.
- :func:`create_accountant` by name, :func:`get_noise_multiplier` for calibration.

All assume Poisson sampling and add/remove neighbouring (see :mod:`fxdp.accounting.accountant`).
This package is pure math and imports nothing from the rest of fxdp.
"""

from fxdp.accounting.accountant import Accountant
from fxdp.accounting.calibration import get_noise_multiplier, steps_in_epochs
from fxdp.accounting.pld import PLDAccountant
from fxdp.accounting.rdp import DEFAULT_ORDERS, RDPAccountant, compute_rdp, epsilon_from_rdp
from fxdp.accounting.registry import ACCOUNTANTS, create_accountant

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "DEFAULT_ORDERS",
    "PLDAccountant",
    "RDPAccountant",
    "compute_rdp",
    "create_accountant",
    "epsilon_from_rdp",
    "get_noise_multiplier",
    "steps_in_epochs",
]
