"""Work shared between Linear weights that read one tensor: one Gram matrix of G for the weights whose G is
one tensor (an LSTM's or RNN's input and recurrent projections get the same gate gradients), one product
``G^T [A^1 c, A^2 c]`` for their clipped sums under equal clip factors, and the Gram blocks of A formed once
for the weights whose A is one tensor (an attention layer's query, key and value projections)."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn

from fxdp.sinks.bookkeeping.linear import LinearWeight, blocks_dot, gram_blocks
from fxdp.sinks.bookkeeping.uses import Use, memory_key


def shared_ghost_norms(uses: Sequence[LinearWeight]) -> List[torch.Tensor]:
    """Ghost norms of Linear weights whose G is the same tensor: ``<A^k_i A^k_i^T, G_i G_i^T>`` with the Gram
    matrix of G formed once for all of them (an LSTM's G has 4h columns, its A's d and h: the G Gram is most of
    the cost). The full Gram, not the halves of :func:`~fxdp.sinks.bookkeeping.linear.gram_blocks`: once
    shared, the halves' extra products cost more than they save."""
    g = uses[0].g
    gram = torch.bmm(g, g.transpose(1, 2))
    return [(torch.bmm(u.a, u.a.transpose(1, 2)) * gram).sum((1, 2)) * u.scale ** 2 for u in uses]


def shared_clipped_sums(uses: Sequence[LinearWeight], c: torch.Tensor) -> List[torch.Tensor]:
    """``sum_i c_i G_i^T A^k_i`` for Linear weights whose G is the same tensor, with the same factors ``c``.
    Where the A's together are no wider than G (an LSTM: d + h <= 4h), one product ``G^T [A^1 c, A^2 c, ...]``
    split by columns; else (an RNN: d + h > h) G is scaled once and multiplies each A."""
    _, g, where = uses[0].ordered()
    widths = [u.a.shape[-1] for u in uses]
    if sum(widths) > g.shape[-1]:
        g_c = (g * c.to(g.dtype).view(where)).flatten(0, 1).t()
        return [g_c.mm(u.ordered()[0].flatten(0, 1)) * u.scale for u in uses]
    scaled = g.new_empty(*g.shape[:2], sum(widths))
    for u, part in zip(uses, scaled.split(widths, -1)):
        torch.mul(u.ordered()[0], (c * u.scale).to(g.dtype).view(where), out=part)
    return [s.contiguous() for s in g.flatten(0, 1).t().mm(scaled.flatten(0, 1)).split(widths, 1)]


def shared_input_ghost_norms(uses: Sequence[LinearWeight]) -> List[torch.Tensor]:
    """Ghost norms of Linear weights whose A is the same tensor (the query, key and value projections of one
    input), with the Gram blocks of A formed once for all of them."""
    a_blocks = gram_blocks(uses[0].a)
    return [blocks_dot(a_blocks, u.g_gram_blocks()) * u.scale ** 2 for u in uses]


def clipped_sums_of_shared_g(uses: Dict[nn.Parameter, List[tuple]]) -> Dict[int, torch.Tensor]:
    """``{id(use): its clipped sum}`` for the Linear weight uses that share one G and equal clip factors
    (a recurrent layer's two projections under flat clipping), formed together by
    :func:`shared_clipped_sums`. Every other use is left to its own ``clipped_sum``."""
    groups: Dict[tuple, list] = {}
    for pairs in uses.values():
        for use, c in pairs:
            if isinstance(use, LinearWeight):
                groups.setdefault(memory_key(use.g), []).append((use, c))
    out = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        use, c = members[0]
        same = [u for u, c_u in members
                if c_u is c or (c_u.dtype == c.dtype and c_u.device == c.device and torch.equal(c_u, c))]
        if len(same) > 1:
            out.update(zip(map(id, same), shared_clipped_sums(same, c)))
    return out


def ghost_groups(pending: Dict[nn.Parameter, List[Use]], key, taken=()) -> List[List[nn.Parameter]]:
    """The parameters not in ``taken`` whose one use is a ghost-norm Linear weight, grouped by ``key(use)``:
    the groups of two or more (their uses read one tensor, whose Gram matrix serves them all)."""
    groups: Dict[tuple, List[nn.Parameter]] = {}
    for p, uses in pending.items():
        if len(uses) == 1 and isinstance(uses[0], LinearWeight) and uses[0].method == "ghost" and p not in taken:
            groups.setdefault(key(uses[0]), []).append(p)
    return [params for params in groups.values() if len(params) > 1]
