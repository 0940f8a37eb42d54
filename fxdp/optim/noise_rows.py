"""The noise of a step added to rows of the parameters' gradients: what a sharded optimizer (FSDP2, each rank holding
rows of dimension 0 of every parameter) adds to its shards, so that the noise of a gradient is formed here, in
``fxdp/optim``, and nowhere else (a test of the package's layout holds every other module to that).

Each parameter's noise is drawn whole, in the order one process draws it (:func:`~fxdp.optim.noise.add_gaussian_noise_`
of a tensor of the parameter's shape, one parameter after the other), and the rows ``start:start + len(rows)`` are
kept: every element's noise is one draw that exactly one holder of rows keeps. Holders seeded alike (one
``noise_generator`` seed on every rank) therefore add exactly the noise one process adds; holders drawing from
different sources (secure mode: the OS on each rank) keep rows of independent draws, just as private. One
parameter's whole draw exists at a time. Why not draw only the rows from a stream of the holder's own: see
docs/distributed.md ("FSDP2", the noise).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from fxdp.optim.noise import add_gaussian_noise_


def add_noise_rows_(params: Sequence[nn.Parameter], rows: List[torch.Tensor], starts: Sequence[int], std: float, *,
                    mechanism=None, secure_mode: bool = False, generator: Optional[torch.Generator] = None) -> None:
    """``rows[k] += `` rows ``starts[k]:starts[k] + len(rows[k])`` of the noise one process adds to the whole of
    ``params[k]``, in place: N(0, std^2), or the noise ``mechanism`` (a
    :class:`~fxdp.optim.correlated.NoiseMechanism`, holding its state for these rows) makes of those rows of the
    unit draws, its state advanced by one step."""
    if mechanism is not None:
        draws = [_rows_of_a_whole_draw(p, r, start, 1.0, secure_mode, generator).clone()
                 for p, r, start in zip(params, rows, starts)]
        mechanism.add_noise_(rows, std, secure_mode=secure_mode, generator=generator, draws=draws)
        return
    if std <= 0:
        return
    for p, r, start in zip(params, rows, starts):
        r += _rows_of_a_whole_draw(p, r, start, std, secure_mode, generator)


def _rows_of_a_whole_draw(p: nn.Parameter, rows: torch.Tensor, start: int, std: float, secure_mode: bool,
                          generator: Optional[torch.Generator]) -> torch.Tensor:
    """N(0, std^2) drawn for the whole of ``p`` (in ``rows``' dtype, on its device), its rows ``start:start +
    len(rows)`` (a view of the draw)."""
    whole = torch.zeros(p.shape, dtype=rows.dtype, device=rows.device)
    add_gaussian_noise_(whole, std, secure_mode=secure_mode, generator=generator)
    return whole[start:start + rows.shape[0]]
