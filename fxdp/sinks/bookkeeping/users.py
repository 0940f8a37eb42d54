"""Per-group squared norms from book-keeping (user-level privacy, :mod:`fxdp.optim.user_level`): for each group
``u`` of samples (a user's records), ``||sum_{i in u} g_i||^2`` of one parameter's record, exactly.

A weight whose per-sample gradient is ``G_i^T A_i`` (a Linear used once, small ones formed in lanes too, on
``(N, d)`` or ``(N, T, d)`` inputs; a Conv with ``groups=1``, A its input patches): a group's summed gradient is
``G_u^T A_u`` with ``A_u`` the group's inputs concatenated along the positions (``(k_u T, d)``) and ``G_u``
likewise. Its squared norm is either the ghost norm ``<A_u A_u^T, G_u G_u^T>`` of the concatenation, which holds
every cross term ``<A_i A_j^T, G_i G_j^T>`` of the group's block (``(k T)^2 (d + p)`` a group), or the norm of the
formed ``G_u^T A_u`` (``k T d p`` a group: the ordinary weight gradient's work, one ``(p, d)`` per group, never one
per sample), whichever costs less. Groups are padded with rows of zeros to the largest group (a zero row adds
nothing), or read as a view when they are of one size and in order.

An Embedding table: each group's looked-up positions with the same index summed, then squared (as its
per-sample norms, with the group for the sample). Every other record (a bias, a norm layer, a grouped Conv, a
tied or shared weight) is materialised: its per-sample gradients, summed per group (``index_add``), then squared.
Never an approximate norm."""

from __future__ import annotations

import torch

from fxdp.sinks.bookkeeping.conv import ConvWeight, _patches
from fxdp.sinks.bookkeeping.embedding import EmbeddingWeight
from fxdp.sinks.bookkeeping.linear import LinearWeight, ghost_norms
from fxdp.sinks.bookkeeping.uses import Segment


def grouped_squared_norms(segment: Segment, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``(num_groups,)``: ``||sum_{i: groups[i] == u} g_i||^2`` of the parameter whose record is ``segment``."""
    uses = segment.uses
    use = uses[0]
    # (a lane member whose lane holds rows to drop has not dropped them from its own A and G yet: materialised)
    if len(uses) == 1 and getattr(use, "_pending", None) is None:
        if isinstance(use, LinearWeight):
            return _matmul_grouped(use.a, use.g, use.scale, groups, num_groups)
        if isinstance(use, ConvWeight) and use.module.groups == 1:
            n = use.batch_size
            patches = _patches(use.module, use.a)  # (N, L, k * C_in)
            g = use.g.reshape(n, use.g.shape[1], -1).transpose(1, 2)  # (N, L, C_out)
            return _matmul_grouped(patches, g, use.scale, groups, num_groups)
    if all(type(u) is EmbeddingWeight for u in uses):
        return _embedding_grouped(uses, groups, num_groups)
    rows = None
    for use in uses:
        gs = use.grad_samples()
        gs = gs.reshape(gs.shape[0], -1)
        rows = gs if rows is None else rows + gs
    rows = rows if rows.dtype in (torch.float32, torch.float64) else rows.float()
    summed = rows.new_zeros((num_groups, rows.shape[1])).index_add_(0, groups.to(rows.device), rows)
    return summed.pow(2).sum(1)


def _matmul_grouped(a: torch.Tensor, g: torch.Tensor, scale: float, groups: torch.Tensor,
                    num_groups: int) -> torch.Tensor:
    """A weight whose per-sample gradient is ``scale * G_i^T A_i`` (A ``(N, T, d)``, G ``(N, T, p)``; a Linear, a
    Conv from its patches): each group's ``G_u^T A_u`` over its samples' concatenated positions, its squared norm
    by Gram products (ghost, ``(k T)^2 (d + p)`` a group) or by forming the group's gradient (``k T d p``, the
    weight gradient's own work), whichever costs less."""
    n = a.shape[0]
    a = a if a.dim() == 3 else a.reshape(n, -1, a.shape[-1])
    g = g if g.dim() == 3 else g.reshape(n, -1, g.shape[-1])
    a = a if a.dtype == g.dtype else a.to(g.dtype)
    if num_groups == 0:
        return a.new_zeros((0,))
    groups = groups.to(a.device)
    counts = torch.bincount(groups, minlength=num_groups)
    k, t = int(counts.max()), a.shape[1]
    if groups.shape[0] == num_groups * k and bool((groups == torch.arange(num_groups, device=a.device)
                                                   .repeat_interleave(k)).all()):
        # groups of one size, each one's samples together in order: the concatenation is a view, no copy
        a_u, g_u = a.reshape(num_groups, k * t, -1), g.reshape(num_groups, k * t, -1)
    else:  # padded with rows of zeros to the largest group, each sample in its slot (its rank in its group)
        order = torch.argsort(groups, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(groups)
        slot[order] = torch.arange(groups.shape[0], device=a.device) - starts[groups[order]]
        a_u = a.new_zeros((num_groups, k, t, a.shape[2]))
        g_u = g.new_zeros((num_groups, k, t, g.shape[2]))
        a_u[groups, slot] = a
        g_u[groups, slot] = g
        a_u, g_u = a_u.reshape(num_groups, k * t, -1), g_u.reshape(num_groups, k * t, -1)
    d, p = a_u.shape[2], g_u.shape[2]
    if k * t * (d + p) < d * p:
        norms = ghost_norms(a_u, g_u)
    else:
        norms = torch.bmm(g_u.transpose(1, 2), a_u).pow(2).sum((1, 2))
    return norms * scale ** 2


def _embedding_grouped(uses, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """An Embedding table: each group's looked-up positions with the same index summed, then squared
    (the table's rows are never formed per sample)."""
    num_rows = uses[0].num_rows
    parts = [u._kept() for u in uses]
    samples, idx, g = (torch.cat(column) for column in zip(*parts)) if len(parts) > 1 else parts[0]
    keys = groups.to(samples.device)[samples] * num_rows + idx
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = g.new_zeros(unique.shape[0], g.shape[-1]).index_add_(0, inverse, g)
    rows = rows if rows.dtype in (torch.float32, torch.float64) else rows.float()
    return rows.new_zeros(num_groups).index_add_(0, unique // num_rows, rows.pow(2).sum(1))
