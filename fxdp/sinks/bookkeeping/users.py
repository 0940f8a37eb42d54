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
Never an approximate norm.

Grouped only (the sink was told that no per-sample norm will be read: user-level training,
:meth:`~fxdp.sinks.contract.GradientSink.set_grouped_norms_only`): a group's summed gradient, where it is formed
for the norm, is kept as the parameter's record (:class:`GroupedSums`) in place of its uses, and the clipped sum,
whose factors are then one per group, is ``sum_u c_u (sum_{i in u} g_i)``: ``U`` rows instead of the weight
gradient's product over every position again. A weight's group gradients are then formed (rather than its ghost
norms) wherever that costs less than the ghost norms and the clipped sum's product together, ``p d < (k T)^2 (d +
p)``, and kept while all the group sums kept hold no more elements than the uses they replaced held (A and G,
per-sample gradients), so that the step's memory does not grow; elsewhere nothing changes."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from fxdp.diagnostics.errors import PerSampleError
from fxdp.sinks.bookkeeping.conv import ConvWeight, _patches
from fxdp.sinks.bookkeeping.embedding import EmbeddingWeight
from fxdp.sinks.bookkeeping.linear import LinearWeight, ghost_norms
from fxdp.sinks.bookkeeping.uses import Segment, Summed, Use

GROUPED_ONLY = (
    "fxdp: this parameter's per-sample gradients were summed per user when its per-user norms were read: its sink "
    "was told (set_grouped_norms_only, by a user-level optimizer) that only per-user norms would be read, so it "
    "holds no per-sample {what}. Read per-sample values only from a model whose optimizer is example-level (or "
    "call sink.set_grouped_norms_only(False) before the backward pass)")


class Grouping:
    """The samples' groups (``groups``, a long ``(N,)``, one group below ``num_groups`` per sample) and what every
    parameter's grouped norms read of them, worked out once per step and device: each group's size, whether the
    groups are of one size with each one's samples together in order (then a group's concatenation is a view),
    each sample's slot in its group, each group's first sample."""

    def __init__(self, groups: torch.Tensor, num_groups: int):
        self.groups, self.num_groups = groups, num_groups
        self.counts = torch.bincount(groups, minlength=num_groups)
        n = groups.shape[0]
        self.k = int(self.counts.max()) if num_groups and n else 0
        # (n == U k with no group above k: every group has k samples; in order then means sorted)
        self.in_order = bool(num_groups) and n == num_groups * self.k and self.counts.shape[0] == num_groups and bool(
            (groups[1:] >= groups[:-1]).all())
        self._slot: Optional[torch.Tensor] = None
        self._firsts: Optional[torch.Tensor] = None
        self._last_factors: Optional[tuple] = None  # (factors, their version, per group): see per_group
        self._devices = {groups.device: self}

    def on(self, device: torch.device) -> "Grouping":
        found = self._devices.get(device)
        if found is None:
            found = self._devices[device] = Grouping(self.groups.to(device), self.num_groups)
        return found

    @property
    def slot(self) -> torch.Tensor:
        """Each sample's rank in its group."""
        if self._slot is None:
            order = torch.argsort(self.groups, stable=True)
            starts = torch.cumsum(self.counts, 0) - self.counts
            slot = torch.empty_like(self.groups)
            slot[order] = torch.arange(self.groups.shape[0], device=self.groups.device) - starts[self.groups[order]]
            self._slot = slot
        return self._slot

    @property
    def firsts(self) -> torch.Tensor:
        """Each group's first sample (an empty group's: the last sample, any would do: its sum is 0)."""
        if self._firsts is None:
            n = self.groups.shape[0]
            first = torch.full((self.num_groups,), max(n - 1, 0), dtype=torch.long, device=self.groups.device)
            self._firsts = first.scatter_reduce_(0, self.groups, torch.arange(n, device=self.groups.device), "amin")
        return self._firsts

    def per_group(self, c: torch.Tensor) -> torch.Tensor:
        """``(U,)``: each group's factor from the samples' factors ``c`` ``(N,)``, which must be equal within each
        group (checked; once per factors tensor, while it is unchanged: flat clipping hands every parameter the
        same one)."""
        last = self._last_factors
        if last is not None and last[0] is c and last[1] == c._version:
            return last[2]
        per_group = c[self.firsts] if self.groups.shape[0] else c.new_zeros(self.num_groups)
        if not torch.equal(per_group[self.groups], c):
            raise PerSampleError(
                "fxdp: the clip factors of one user's records differ, but the sink summed each user's records "
                "already (a user-level step): a user's records must share one factor, their user's clip factor "
                "over their number of records")
        self._last_factors = (c, c._version, per_group)
        return per_group

    def sum_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``(U, w)``: the rows ``(N, w)`` added up per group."""
        if self.in_order:  # (each group's rows together: a view)
            return rows.reshape(self.num_groups, self.k, -1).sum(1)
        return rows.new_zeros((self.num_groups, rows.shape[1])).index_add_(0, self.groups, rows)


def grouped_squared_norms(segment: Segment, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``(num_groups,)``: ``||sum_{i: groups[i] == u} g_i||^2`` of the parameter whose record is ``segment``."""
    return grouped_norms_and_sums(segment, Grouping(groups, num_groups))[0]


def held_elements(segment: Segment) -> int:
    """How many elements the tensors of the segment's uses hold (A, G, per-sample gradients)."""
    return sum(t.numel() for u in segment.uses for t in vars(u).values() if isinstance(t, torch.Tensor))


class Budget:
    """The elements a segment's group sums may hold (see :func:`grouped_norms_and_sums`): what its uses hold
    (:func:`held_elements`, counted when first asked: most records never ask) plus ``credit``."""

    def __init__(self, segment: Segment, credit: int = 0):
        self.segment, self.credit, self.held = segment, credit, None

    def __call__(self) -> int:
        if self.held is None:
            self.held = held_elements(self.segment)
        return self.held + self.credit


def grouped_norms_and_sums(segment: Segment, grouping: Grouping,
                           budget: Optional[Callable[[], int]] = None) -> Tuple[torch.Tensor, Optional["GroupedSums"]]:
    """:func:`grouped_squared_norms`, and with a ``budget`` (elements they may hold, asked only where a sum could be
    kept: :class:`Budget`) the groups' summed gradients where they are formed and worth keeping (see the module
    docstring), as the use to replace the segment's uses (else None)."""
    uses = segment.uses
    use = uses[0]
    if len(uses) == 1 and isinstance(use, GroupedSums):
        return use.grouped_norms(grouping), None
    # (a lane member whose lane holds rows to drop has not dropped them from its own A and G yet: materialised)
    if len(uses) == 1 and getattr(use, "_pending", None) is None:
        if isinstance(use, LinearWeight):
            norms, sums = _matmul_grouped(use.a, use.g, use.scale, grouping, budget)
            return norms, None if sums is None else GroupedSums(sums, grouping.on(sums.device), use.scale)
        if isinstance(use, ConvWeight) and use.module.groups == 1:
            n = use.batch_size
            patches = _patches(use.module, use.a)  # (N, L, k * C_in)
            g = use.g.reshape(n, use.g.shape[1], -1).transpose(1, 2)  # (N, L, C_out)
            norms, sums = _matmul_grouped(patches, g, use.scale, grouping, budget)
            if sums is None:
                return norms, None
            # the patches' columns are (kernel positions, C_in): the weight's order is (C_in, kernel positions)
            shape = (g.shape[2], *use.module.kernel_size, use.a.shape[1])
            return norms, GroupedSums(sums, grouping.on(sums.device), use.scale,
                                      lambda w: w.view(shape).movedim(-1, 1))
    if all(type(u) is EmbeddingWeight for u in uses):
        return _embedding_grouped(uses, grouping), None
    rows, scale = None, 1.0
    if len(uses) == 1 and type(use) is Summed:  # a bias: G summed over positions, its loss scale applied at the end
        rows, scale = use.gs.reshape(use.gs.shape[0], -1), use.scale
    for use in uses if rows is None else ():
        gs = use.grad_samples()
        gs = gs.reshape(gs.shape[0], -1)
        rows = gs if rows is None else rows + gs
    rows = rows if rows.dtype in (torch.float32, torch.float64) else rows.float()
    on = grouping.on(rows.device)
    summed = on.sum_rows(rows)
    kept = budget is not None and summed.numel() <= budget()
    return _scaled(summed.pow(2).sum(1), scale), GroupedSums(summed, on, scale) if kept else None


class GroupedSums(Use):
    """A parameter's per-sample gradients summed per group, ``scale * sums[u] = sum_{i in u} g_i`` (``sums``
    ``(U, ...)``, flat per group, ``layout`` putting one flat sum in the parameter's order), kept in place of its
    uses once its grouped norms were formed (grouped only: user-level training). Its clipped sum takes one factor
    per sample, which must be equal within each group (the user's clip factor over their number of records);
    dropping samples drops whole groups. Per-sample norms and gradients are gone: asking for them raises."""

    def __init__(self, sums: torch.Tensor, grouping: Grouping, scale: float = 1.0,
                 layout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.sums, self.grouping, self.scale, self.layout = sums, grouping, scale, layout
        self.batch_size = grouping.groups.shape[0]

    def grouped_norms(self, grouping: Grouping) -> torch.Tensor:
        if grouping.num_groups != self.grouping.num_groups or not torch.equal(
                grouping.groups.to(self.sums.device), self.grouping.groups):
            raise PerSampleError(
                "fxdp: per-user norms were asked for other users than those the records were summed for already; "
                "the sink holds no per-sample gradient to group them otherwise. Ask once per step, with the users "
                "of the step's batch")
        return _scaled(self.sums.flatten(1).pow(2).sum(1), self.scale)

    def clipped_sum(self, c):
        per_group = self.grouping.per_group(c.to(self.sums.device))
        total = torch.tensordot((per_group * self.scale).to(self.sums.dtype), self.sums, dims=1)
        return total if self.layout is None else self.layout(total)

    def drop_samples(self, dropped: torch.Tensor) -> None:
        groups = self.grouping.groups
        dropped = dropped.to(groups.device)
        hit = torch.zeros(self.grouping.num_groups, dtype=torch.bool, device=groups.device)
        hit[groups[dropped]] = True
        if not torch.equal(hit[groups], dropped):
            raise PerSampleError(
                "fxdp: some but not all of a user's records are to be dropped, but the sink summed each user's "
                "records already (a user-level step): only whole users can be dropped")
        self.sums = self.sums.masked_fill(hit.view(-1, *[1] * (self.sums.dim() - 1)), 0)

    def squared_norms(self):
        raise PerSampleError(GROUPED_ONLY.format(what="norms"))

    def grad_samples(self):
        raise PerSampleError(GROUPED_ONLY.format(what="gradients"))


def _matmul_grouped(a: torch.Tensor, g: torch.Tensor, scale: float, grouping: Grouping,
                    budget: Optional[Callable[[], int]] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A weight whose per-sample gradient is ``scale * G_i^T A_i`` (A ``(N, T, d)``, G ``(N, T, p)``; a Linear, a
    Conv from its patches): each group's ``G_u^T A_u`` over its samples' concatenated positions, its squared norm
    by Gram products (ghost, ``(k T)^2 (d + p)`` a group) or by forming the group's gradient (``k T d p``, the
    weight gradient's own work), whichever costs less. With a ``budget`` (elements the group gradients may hold;
    None: none), the group gradients ``(U, p * d)`` are formed and returned where they fit it and cost less than the
    ghost norms and the clipped sum's product together, ``p d < (k T)^2 (d + p)`` (else None)."""
    n, num_groups = a.shape[0], grouping.num_groups
    a = a if a.dim() == 3 else a.reshape(n, -1, a.shape[-1])
    g = g if g.dim() == 3 else g.reshape(n, -1, g.shape[-1])
    a = a if a.dtype == g.dtype else a.to(g.dtype)
    if num_groups == 0:
        return a.new_zeros((0,)), None
    on = grouping.on(a.device)
    k, t = on.k, a.shape[1]
    if on.in_order:  # groups of one size, each one's samples together in order: the concatenation is a view
        a_u, g_u = a.reshape(num_groups, k * t, -1), g.reshape(num_groups, k * t, -1)
    else:  # padded with rows of zeros to the largest group, each sample in its slot (its rank in its group)
        a_u = a.new_zeros((num_groups, k, t, a.shape[2]))
        g_u = g.new_zeros((num_groups, k, t, g.shape[2]))
        a_u[on.groups, on.slot] = a
        g_u[on.groups, on.slot] = g
        a_u, g_u = a_u.reshape(num_groups, k * t, -1), g_u.reshape(num_groups, k * t, -1)
    d, p = a_u.shape[2], g_u.shape[2]
    if budget is not None and d * p < (k * t) ** 2 * (d + p) and num_groups * d * p <= budget():
        sums = torch.bmm(g_u.transpose(1, 2), a_u)  # (U, p, d)
        return _scaled(sums.pow(2).sum((1, 2)), scale), sums.reshape(num_groups, -1)
    if k * t * (d + p) < d * p:
        norms = ghost_norms(a_u, g_u)
    else:
        norms = torch.bmm(g_u.transpose(1, 2), a_u).pow(2).sum((1, 2))
    return _scaled(norms, scale), None


def _scaled(squares: torch.Tensor, scale: float) -> torch.Tensor:
    """``squares * scale ** 2`` (the squares as they are for the usual scale 1: the same values, one kernel less)."""
    return squares if scale == 1.0 else squares * scale ** 2


def _embedding_grouped(uses, grouping: Grouping) -> torch.Tensor:
    """An Embedding table: each group's looked-up positions with the same index summed, then squared
    (the table's rows are never formed per sample)."""
    num_rows, num_groups = uses[0].num_rows, grouping.num_groups
    parts = [u._kept() for u in uses]
    samples, idx, g = (torch.cat(column) for column in zip(*parts)) if len(parts) > 1 else parts[0]
    keys = grouping.on(samples.device).groups[samples] * num_rows + idx
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = g.new_zeros(unique.shape[0], g.shape[-1]).index_add_(0, inverse, g)
    rows = rows if rows.dtype in (torch.float32, torch.float64) else rows.float()
    return rows.new_zeros(num_groups).index_add_(0, unique // num_rows, rows.pow(2).sum(1))
