"""Privacy accounting for DP-SGD: how much (ε, δ) the steps taken have spent, and how much noise a
target ε needs.

- :class:`PLDAccountant` (``"pld"``, the PrivacyEngine's default): privacy-loss distributions through
  Google's ``dp-accounting``; the tightest bound here. ``"prv"``, Opacus's default, names it too.
- :class:`RDPAccountant` (``"rdp"``, pure ``math``): Rényi DP of the Poisson-subsampled Gaussian mechanism;
  a looser bound (about 10-15% more ε), fast.
- :class:`GDPAccountant` (``"gdp"``, Opacus's ``GaussianAccountant``): the central-limit Gaussian-DP
  approximation, not a bound.
- :class:`PRVAccountant` (``"prv"``): the PLD accountant under Opacus's name.
- :class:`CyclicPoissonBandedMFAccountant`: banded matrix-factorization noise amplified by cyclic Poisson
  sampling (:mod:`fxdp.accounting.banded_mf`), through ``dp-accounting``'s PLD.
- :class:`MinSeparationBLTAccountant`: BLT noise under min-separation participation, without amplification
  (:mod:`fxdp.accounting.blt`); :class:`MinSeparationBandedMFAccountant` and :class:`MinSeparationTreeAccountant`,
  the same analysis for banded MF without amplification and tree aggregation (:mod:`fxdp.accounting.min_separation`).
- :func:`group_privacy_epsilon`: an example-level history's ε for a group of k records (user-level contrast).
- :func:`create_accountant` by name (:func:`register_accountant` adds one), :func:`get_noise_multiplier` for
  calibration.

All assume Poisson sampling and add/remove neighbouring (see :mod:`fxdp.accounting.accountant`).
This package is pure math and imports nothing from the rest of fxdp.
"""

from fxdp.accounting import registry
from fxdp.accounting.accountant import Accountant
from fxdp.accounting.banded_mf import CyclicPoissonBandedMFAccountant
from fxdp.accounting.blt import MinSeparationBLTAccountant, blt_noise_multiplier
from fxdp.accounting.calibration import get_noise_multiplier, steps_in_epochs
from fxdp.accounting.gdp import GDPAccountant
from fxdp.accounting.min_separation import MinSeparationBandedMFAccountant, MinSeparationTreeAccountant
from fxdp.accounting.group_privacy import group_privacy_epsilon
from fxdp.accounting.pld import PLDAccountant, PRVAccountant
from fxdp.accounting.rdp import DEFAULT_ORDERS, RDPAccountant, compute_rdp, epsilon_from_rdp
from fxdp.accounting.registry import ACCOUNTANTS, create_accountant, register_accountant

GaussianAccountant = GDPAccountant  # Opacus's name for the "gdp" accountant

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "CyclicPoissonBandedMFAccountant",
    "MinSeparationBLTAccountant",
    "MinSeparationBandedMFAccountant",
    "MinSeparationTreeAccountant",
    "DEFAULT_ORDERS",
    "GDPAccountant",
    "GaussianAccountant",
    "PLDAccountant",
    "PRVAccountant",
    "RDPAccountant",
    "compute_rdp",
    "create_accountant",
    "register_accountant",
    "registry",
    "epsilon_from_rdp",
    "blt_noise_multiplier",
    "get_noise_multiplier",
    "group_privacy_epsilon",
    "steps_in_epochs",
]
