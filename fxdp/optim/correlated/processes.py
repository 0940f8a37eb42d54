"""Correlated noise across processes: what the DP optimizer and the mechanisms share (no torch.distributed here).

The noise must be the noise of one process (docs/correlated_noise.md, "Across processes"):

- DDP (:class:`fxdp.distributed.DistributedDPOptimizer`): rank 0 adds the noise of the logical step to its
  clipped sums before they are all-reduced, as it adds independent noise; so rank 0 holds the mechanism's state
  and draws as one process draws, and every other rank only advances (:meth:`NoiseMechanism.advance_`: the
  cycle checks and the step count, no draw, no noise state).
- FSDP2 (:class:`fxdp.distributed.FullyShardedDPOptimizer`): every rank draws each parameter's unit noise whole,
  in the order one process draws it, keeps its shard's rows and hands them to the mechanism
  (``add_noise_(shards, std, draws=rows)``); the recursions of banded MF and BLT act coordinate by coordinate,
  so each rank's state is its rows of one process's state: ``O(state x shard)`` memory.

:func:`check_noise_path` is the DP optimizer's guard: a class that forms or adds the noise its own way gets a
noise mechanism only where the class that overrides the step's noise path says it keeps a mechanism's noise
(its ``_MECHANISM_READY``, the overridden methods it vouches for).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from fxdp.optim.noise import add_gaussian_noise_all_
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError


def check_noise_path(cls: type, base: type, overrides: Sequence[str], noise_path: Sequence[str],
                     mechanism: Any) -> None:
    """Refuse a noise mechanism on an optimizer class ``cls`` (a subclass of ``base``, the DPOptimizer) that
    overrides an Opacus extension point (``overrides``) or a method of ``noise_path`` that no class vouches for;
    an override vouched for (the DDP and FSDP2 optimizers') needs a mechanism that trains across processes."""
    unvouched, vouched = list(overrides), []
    for method in noise_path:
        owner = next(klass for klass in cls.__mro__ if method in vars(klass))
        if owner is base:
            continue
        (vouched if method in vars(owner).get("_MECHANISM_READY", ()) else unvouched).append(method)
    if unvouched:
        raise PrivacySettingError(
            f"fxdp: {cls.__name__} forms or adds its noise its own way ({', '.join(unvouched)}); the noise mechanism "
            f"{mechanism.name!r} needs the DPOptimizer's own step, or DDP's or FSDP2's (noise_mechanism='gaussian' "
            "here)")
    if vouched and not mechanism.across_processes:
        raise PrivacySettingError(f"fxdp: the {mechanism.name!r} noise mechanism does not support training across "
                                  f"processes ({cls.__name__}) yet; train in one process")


def unit_draws(outs: List[torch.Tensor], draws: Optional[List[torch.Tensor]], *, secure_mode: bool,
               generator: Optional[torch.Generator], label: str) -> List[torch.Tensor]:
    """This step's unit Gaussian draws, one per ``outs``: drawn here as one process draws them (in order), or the
    caller's (a sharded optimizer's rows), checked to match ``outs``."""
    if draws is None:
        draws = [torch.zeros_like(out) for out in outs]
        add_gaussian_noise_all_(draws, 1.0, secure_mode=secure_mode, generator=generator)
        return draws
    if [tuple(d.shape) for d in draws] != [tuple(o.shape) for o in outs]:
        raise StepRefusedError(f"fxdp: the {label} noise was handed draws of shapes {[tuple(d.shape) for d in draws]} "
                               f"for tensors of shapes {[tuple(o.shape) for o in outs]}; report this")
    return [d if d.dtype == o.dtype and d.device == o.device else d.to(dtype=o.dtype, device=o.device)
            for d, o in zip(draws, outs)]


def check_noise_state(label: str, steps: int, held: int, expected: int) -> None:
    """Refuse to load a mechanism state whose noise state does not match its steps: one saved by a process that
    adds no noise (a DDP rank other than 0 holds none), whose noise would not continue the run's."""
    if held != expected:
        raise ValueError(
            f"fxdp: the checkpoint's {label} noise took {steps} steps and should hold {expected} noise tensors per "
            f"parameter; it holds {held}: it was saved by a process that does not add the noise (under DDP only rank "
            "0 adds it and holds the state). Save the checkpoint on rank 0")
