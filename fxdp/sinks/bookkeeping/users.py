"""Per-group squared norms from book-keeping (user-level privacy, :mod:`fxdp.optim.user_level`): for each group
``u`` of samples (a user's records), ``||sum_{i in u} g_i||^2`` of one parameter's record, exactly.

A Linear weight used once (small ones formed in lanes too; ``outer`` on ``(N, d)`` inputs, ``ghost`` on ``(N, T, d)``): the per-sample gradient is
``G_i^T A_i``, so a group's summed gradient is ``G_u^T A_u`` with ``A_u`` the group's inputs concatenated along
the positions (``(k_u T, d)``) and ``G_u`` likewise: its squared norm is the ghost norm ``<A_u A_u^T, G_u G_u^T>``
of the concatenation, which holds every cross term ``<A_i A_j^T, G_i G_j^T>`` of the group's block. Groups are
padded with rows of zeros to the largest group (a zero row adds nothing to either Gram matrix), so a group of
``k`` records costs ``(k T)^2 (d + p)``: ``k`` times its records' ghost norms, never a per-sample gradient.

Every other record (a bias, an Embedding or Conv weight, a norm layer, a tied or shared weight, a Linear weight
whose plan forms per-sample gradients anyway) is materialised: its per-sample gradients, summed
per group (``index_add``), then squared. Never an approximate norm."""

from __future__ import annotations

import torch

from fxdp.sinks.bookkeeping.linear import LinearWeight, ghost_norms
from fxdp.sinks.bookkeeping.uses import Segment


def grouped_squared_norms(segment: Segment, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``(num_groups,)``: ``||sum_{i: groups[i] == u} g_i||^2`` of the parameter whose record is ``segment``."""
    uses = segment.uses
    use = uses[0]
    # (a lane member whose lane holds rows to drop has not dropped them from its own A and G yet: materialised)
    if len(uses) == 1 and isinstance(use, LinearWeight) and use.method in ("outer", "ghost") \
            and getattr(use, "_pending", None) is None:
        return _linear_grouped(use, groups, num_groups)
    rows = None
    for use in uses:
        gs = use.grad_samples()
        gs = gs.reshape(gs.shape[0], -1)
        rows = gs if rows is None else rows + gs
    rows = rows if rows.dtype in (torch.float32, torch.float64) else rows.float()
    summed = rows.new_zeros((num_groups, rows.shape[1])).index_add_(0, groups.to(rows.device), rows)
    return summed.pow(2).sum(1)


def _linear_grouped(use: LinearWeight, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    a, g = use.a, use.g  # (N, T, d), (N, T, p)
    if num_groups == 0:
        return a.new_zeros((0,))
    groups = groups.to(a.device)
    counts = torch.bincount(groups, minlength=num_groups)
    k = int(counts.max())
    t = a.shape[1]
    if groups.shape[0] == num_groups * k and bool((groups == torch.arange(num_groups, device=a.device)
                                                   .repeat_interleave(k)).all()):
        # groups of one size, each one's samples together in order: the concatenation is a view, no copy
        norms = ghost_norms(a.reshape(num_groups, k * t, -1), g.reshape(num_groups, k * t, -1))
        return norms * use.scale ** 2
    # each sample's slot within its group: its rank among the group's samples, in batch order
    order = torch.argsort(groups, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(groups)
    slot[order] = torch.arange(groups.shape[0], device=a.device) - starts[groups[order]]
    a_u = a.new_zeros((num_groups, k, t, a.shape[2]))
    g_u = g.new_zeros((num_groups, k, t, g.shape[2]))
    a_u[groups, slot] = a
    g_u[groups, slot] = g
    norms = ghost_norms(a_u.reshape(num_groups, k * t, -1), g_u.reshape(num_groups, k * t, -1))
    return norms * use.scale ** 2
