"""The noise-mechanism interface of the DP optimizer: who draws the noise added to a step's clipped sums.

``DPOptimizer(..., noise_mechanism="gaussian")`` (the default) adds fresh, independent Gaussian noise at every
step, drawn by :func:`fxdp.optim.noise.add_gaussian_noise_all_` exactly as before this interface existed: the
optimizer keeps no mechanism object then (``optimizer.noise_mechanism is None``). Any other mechanism is a
:class:`NoiseMechanism`: once per logical step the optimizer hands it the scaled clipped sums (one tensor per
trainable parameter, in the optimizer's order, in at least float32) and the std of DP-SGD's noise for them
(``noise_multiplier * sensitivity * scale``); the mechanism adds its noise in place and advances its state. Its
state is part of the optimizer's ``state_dict``.

Across processes (:mod:`fxdp.optim.correlated.processes`, :mod:`fxdp.distributed.correlated`): under DDP the one
rank that adds the noise holds the state and the others only :meth:`NoiseMechanism.advance_`; under FSDP2 each rank
holds its shard's rows of the state and is handed its rows of the unit draws one process would make
(``add_noise_(..., draws=...)``). A mechanism supports this when :attr:`NoiseMechanism.across_processes` is true.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from fxdp.sinks.contract import PrivacySettingError

GAUSSIAN = "gaussian"


class NoiseMechanism(abc.ABC):
    """What the DP optimizer asks for the noise of each logical step (see the module docstring)."""

    #: a short name, for messages and checkpoints
    name: str = ""
    #: whether it can train across processes (:meth:`advance_`, ``draws=``; see the module docstring)
    across_processes: bool = False
    #: the keys of :meth:`state_dict` holding lists of per-parameter lists (one tensor per trainable parameter, in
    #: order, each of its parameter's shape): what a sharded optimizer gathers into whole tensors and slices back
    per_parameter_state: Tuple[str, ...] = ()

    @abc.abstractmethod
    def add_noise_(self, outs: List[torch.Tensor], std: float, *, secure_mode: bool = False,
                   generator: Optional[torch.Generator] = None,
                   draws: Optional[List[torch.Tensor]] = None) -> None:
        """Add this step's noise to each of ``outs`` in place and advance the state by one step. ``std``: the std
        of DP-SGD's independent noise for these tensors; a correlated mechanism scales its unit noise by it.
        ``draws``: this step's unit Gaussian draws, one per ``outs`` of its shape, made by the caller (a sharded
        optimizer's rows of the draws of one process) instead of drawn here."""

    def advance_(self) -> None:
        """Advance the state by one step without adding noise, on a process whose step's noise another process
        adds (DDP's ranks other than 0): the step's checks run, nothing is drawn and no noise state is kept."""
        raise PrivacySettingError(f"fxdp: the {self.name!r} noise mechanism does not support training across "
                                  "processes yet; train in one process")

    @abc.abstractmethod
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue the same noise after a restart (tensors kept bit for bit)."""

    @abc.abstractmethod
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""

    def check_step(self) -> None:
        """Raise if the step about to run must not get this mechanism's noise (called by the optimizer before
        anything of the step moves; :meth:`add_noise_` checks again)."""

    def memory_bytes(self) -> int:
        """Bytes of state kept between steps (0 for a stateless mechanism)."""
        return 0


def noise_mechanism_from(value: Union[str, NoiseMechanism, None]) -> Optional[NoiseMechanism]:
    """``None`` for the default independent Gaussian noise (``"gaussian"`` or ``None``), else the mechanism."""
    if value is None or (isinstance(value, str) and value == GAUSSIAN):
        return None
    if isinstance(value, NoiseMechanism):
        return value
    raise PrivacySettingError(
        f"fxdp: noise_mechanism must be {GAUSSIAN!r} (independent noise, the default) or a "
        f"fxdp.optim.correlated.NoiseMechanism such as BandedMatrixFactorization(bands=...), got {value!r}")


def mechanism_state(mechanism: Optional[NoiseMechanism]) -> Optional[Dict[str, Any]]:
    """What the optimizer's ``state_dict`` keeps of its mechanism (``None`` for independent noise)."""
    if mechanism is None:
        return None
    return {"name": mechanism.name, "state": mechanism.state_dict()}


def restore_mechanism_state(mechanism: Optional[NoiseMechanism], saved: Optional[Dict[str, Any]]) -> None:
    """Load a checkpoint's mechanism state into the optimizer's mechanism, refusing a mismatch: noise that does
    not continue the saved correlation is noise the privacy analysis did not cover."""
    if saved is None and mechanism is None:
        return
    if saved is None:
        raise ValueError(f"fxdp: the checkpoint was saved with independent Gaussian noise, this optimizer uses the "
                         f"{mechanism.name!r} noise mechanism; build the DPOptimizer with the checkpoint's "
                         "noise_mechanism (the default, 'gaussian')")
    if mechanism is None or mechanism.name != saved["name"]:
        mine = GAUSSIAN if mechanism is None else mechanism.name
        raise ValueError(f"fxdp: the checkpoint was saved with the {saved['name']!r} noise mechanism, this optimizer "
                         f"uses {mine!r}; build the DPOptimizer with the checkpoint's noise_mechanism")
    mechanism.load_state_dict(saved["state"])
