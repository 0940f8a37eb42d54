"""Correlated noise (banded MF, BLT) under FSDP2: each rank keeps its shard's rows of the mechanism's state.

How :class:`~fxdp.distributed.FullyShardedDPOptimizer` runs a mechanism (see :mod:`fxdp.optim.correlated.processes` for
the whole design, DDP included):

- the noise: :class:`~fxdp.distributed.FullyShardedDPOptimizer` says which rows of each parameter it holds, and
  :mod:`fxdp.optim.noise_rows` hands the mechanism those rows of the unit draws one process makes (one parameter's
  draw exists at a time); the mechanism runs its recursion on the rows: every coordinate's noise, and every
  coordinate of the state, is one process's. Each rank's state is its rows: ``mechanism.memory_bytes()`` is
  ``buffers x`` the shard, not the parameters.
- :func:`gathered_mechanism_state` / :func:`sharded_mechanism_state`: the checkpoint holds the mechanism's
  per-parameter state as whole tensors (gathered from every rank's rows, as FSDP2's checkpoint holds the optimizer
  state), the state one process would hold; loading keeps this rank's rows. So a checkpoint of one process, of any
  number of sharded ranks, loads in any of them, and the resumed noise is the noise of a run that never stopped.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn


def gathered_mechanism_state(optimizer: Any, saved: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``saved`` (the optimizer's ``mechanism_state``) with each per-parameter tensor gathered whole from every
    rank's rows, on the CPU (a collective: every rank calls it, as the sharded optimizer's ``state_dict``)."""
    if saved is None:
        return None
    params = optimizer._trainable_params()
    state = dict(saved["state"])
    for key in optimizer.noise_mechanism.per_parameter_state:
        state[key] = [[_gathered(optimizer, p, t) for p, t in zip(params, group)] for group in state[key]]
    return {**saved, "state": state}


def sharded_mechanism_state(optimizer: Any, saved: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A checkpoint's mechanism state (whole tensors) cut to this rank's rows, on its shards' devices."""
    if saved is None or optimizer.noise_mechanism is None or saved.get("name") != optimizer.noise_mechanism.name:
        return saved  # (a mismatch is refused with its reason by the optimizer's load_state_dict)
    params = optimizer._trainable_params()
    state = dict(saved["state"])
    for key in optimizer.noise_mechanism.per_parameter_state:
        groups = state[key]
        if any(len(group) != len(params) for group in groups):
            raise ValueError(f"fxdp: the checkpoint's {saved['name']!r} noise state holds tensors for "
                             f"{[len(g) for g in groups]} parameters, this optimizer trains {len(params)}")
        state[key] = [[_rows(optimizer, p, t) for p, t in zip(params, group)] for group in groups]
    return {**saved, "state": state}


def _gathered(optimizer: Any, p: nn.Parameter, rows: torch.Tensor) -> torch.Tensor:
    chunk = optimizer._chunk(p)
    padded = rows.new_zeros((chunk, *rows.shape[1:]))
    padded[:rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(optimizer.world_size)]
    dist.all_gather(parts, padded.contiguous(), group=optimizer.process_group)
    return torch.cat(parts)[:p.shape[0]].cpu()


def _rows(optimizer: Any, p: nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
    if tuple(whole.shape) != tuple(p.shape):
        raise ValueError(f"fxdp: the checkpoint's noise state for parameter '{optimizer._name(p)}' has shape "
                         f"{tuple(whole.shape)}, the parameter {tuple(p.shape)}")
    local = p.to_local()
    start = optimizer.rank * optimizer._chunk(p)
    return whole[start:start + local.shape[0]].to(local.device).clone()
