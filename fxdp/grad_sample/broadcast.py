"""A trainable parameter added to per-sample data (``x + self.pos``: a learned position table): its per-sample
gradient is the output gradient itself, summed over the dimensions the parameter is broadcast along, and
negated where it is subtracted. No generic rule runs, and nothing larger than the output gradient is formed."""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence

import torch

_SIGNS = {operator.add: 1.0, torch.add: 1.0, "add": 1.0, operator.sub: -1.0, torch.sub: -1.0, "sub": -1.0}
ADDITIONS = tuple(_SIGNS)  # the functions and Tensor methods (by name) that add or subtract their arguments


def added_parameter_sign(fn, position: int, n_args: int, has_kwargs: bool) -> Optional[float]:
    """``+1`` / ``-1`` when ``fn`` with ``n_args`` positional arguments (and no keyword ones, such as ``alpha``)
    adds the parameter at ``position`` to the other argument, or subtracts it; else None."""
    try:
        sign = _SIGNS.get(fn)
    except TypeError:  # an unhashable function (a folded graph is hashable; this is for anything else)
        return None
    if sign is None or has_kwargs or n_args != 2:
        return None
    return -1.0 if sign < 0 and position == 1 else 1.0


def summed_dims(out_shape: Sequence[int], batch_at: int, param_shape: Sequence[int]) -> Optional[List[int]]:
    """The dimensions of the output (batch in ``batch_at``) its gradient is summed over to give the parameter's
    per-sample gradient: those the parameter does not have or has with size 1, but the batch's. None where the
    parameter itself has a size other than 1 along the batch (its rows would be samples' own: not this rule)."""
    lead = len(out_shape) - len(param_shape)
    if lead < 0 or not 0 <= batch_at < len(out_shape) or (batch_at >= lead and param_shape[batch_at - lead] != 1):
        return None
    return [d for d in range(len(out_shape))
            if d != batch_at and (d < lead or (param_shape[d - lead] == 1 and out_shape[d] != 1))]


def added_parameter_grad_samples(g: torch.Tensor, batch_at: int, param: torch.Tensor, dims: List[int],
                                 scale: float) -> torch.Tensor:
    """``(N, *param.shape)``: ``scale`` times the output gradient ``g`` summed over ``dims``
    (:func:`summed_dims`), the batch moved first (a view of ``g`` where nothing is summed and ``scale`` is 1)."""
    n = g.shape[batch_at]
    if dims:
        g = g.sum(dims, keepdim=True)
    g = g.movedim(batch_at, 0).reshape(n, *param.shape)  # only dimensions of size 1 come and go: a view
    if scale != 1.0:
        g = g * scale
    return g.to(param.dtype)
