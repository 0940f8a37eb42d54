"""Lanes: the small uses of one backward pass that are alike (same kind, shapes, dtype and loss scale), whose
per-sample norms and clipped sums are formed for all of them at once.

A small layer's arithmetic takes a few microseconds; the step's time is then the fixed cost of one small kernel
after another, per layer. A lane stacks its members' tensors and forms what each needs in one batched kernel:
sixteen ``Linear(32, 32)`` layers on ``(N, 32)`` inputs have their norms from two reductions over ``(16, N, 32)``
stacks, their clipped sums from one ``bmm``, where each layer alone took its own. The results are the same
numbers (each member's row of the batched result is computed as that member alone would compute it).

Members join a lane as the sink forms their uses (:meth:`Lane.join`); the lane computes on the first request,
for every member still in it. Rows dropped (:meth:`~fxdp.sinks.bookkeeping.uses.Use.drop_samples`) by one mask for
every member (a padded batch's padding rows) are selected out of the lane's stacks; rows dropped by another mask
after that make the member leave its lane and be computed alone, from its own tensors, both masks applied.
Clipped sums are formed together only for members given the very same factors tensor (flat clipping gives every
parameter one): :func:`clipped_sums_in_lanes` forms them before the sink asks each use, and a use answers from
that result when asked with those factors.

Only small uses join (:data:`SMALL`): for large layers one kernel per layer is the cost of the arithmetic, and a
stack would copy large tensors.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from fxdp.sinks.bookkeeping.uses import Materialised, Use

#: a use joins a lane when each of its tensors holds at most this many elements
SMALL = 1 << 16
#: a lane takes members until their tensors hold this many elements (its stacks, copies of them, are made one lane
#: at a time: this bounds the memory they add to a step); then the sink opens another
LANE_VALUES = 1 << 20


def small(*tensors: torch.Tensor) -> bool:
    return all(t.numel() <= SMALL for t in tensors)


class Lane:
    """Alike uses of one backward pass. A subclass says how to stack its members (:meth:`stacks`) and how to
    form norms and clipped sums from the stacks (:meth:`batched_norms`, :meth:`batched_clipped_sums`)."""

    def __init__(self, scale: float):
        self.scale = scale
        # held weakly: a member refers to its lane, and a cycle would keep its A and G alive after the sink drops
        # the member (until Python's cycle collector runs), not as soon as its clipped sum is taken
        self._members: List[weakref.ref] = []
        self.values = 0  # elements of the members' tensors
        self._norms: Optional[Tuple[torch.Tensor, ...]] = None  # each member's row of the batched norms
        self._stacks: Optional[Tuple[Tuple[int, ...], tuple]] = None  # (member indices, stacks) while in use
        self._mask: Optional[torch.Tensor] = None  # rows dropped from the members that took it (take_mask)

    @property
    def closed(self) -> bool:
        """Norms formed, or full: no member may join any more (the sink opens a new lane)."""
        return self._norms is not None or self.values >= LANE_VALUES

    def join(self, use: "LaneMember", values: int) -> "LaneMember":
        """``use`` joins, its tensors holding ``values`` elements."""
        use.lane, use.lane_index = self, len(self._members)
        self.values += values
        self._members.append(weakref.ref(use))
        return use

    @property
    def members(self) -> List["LaneMember"]:
        """The members that joined, in order (all alive while their norms are formed: the sink holds them)."""
        return [ref() for ref in self._members]

    def _stacked(self, members: List["LaneMember"]) -> tuple:
        key = tuple(m.lane_index for m in members)
        if self._stacks is None or self._stacks[0] != key:
            self._stacks = (key, self.stacks(members))
        return self._stacks[1]

    def take_mask(self, dropped: torch.Tensor) -> bool:
        """Whether the lane drops the rows ``dropped`` marks for a member, in its stacks: yes for the first such mask
        (a padded batch's padding rows, the same tensor for every parameter), and for that mask again."""
        if self._mask is None:
            self._mask = dropped
        return self._mask is dropped

    def norms_of(self, use: "LaneMember") -> Optional[torch.Tensor]:
        """``use``'s norms, formed with every member's (read once the backward pass has ended: all have joined);
        ``None`` where a member is gone already, or rows were dropped (then each forms its own)."""
        if self._mask is not None:
            return None
        if self._norms is None:
            everyone = self.members
            if any(m is None for m in everyone):
                return None
            self._norms = self.batched_norms(self._stacked(everyone)).unbind(0)  # (one call for every row)
            self._stacks = None  # a copy of the members' tensors: not kept until the sums (stacked again then)
        return self._norms[use.lane_index]

    def clipped_sums(self, members: List["LaneMember"], c: torch.Tensor) -> torch.Tensor:
        """``(len(members), ...)``: each member's clipped sum under the factors ``c`` (one per sample); with the
        lane's mask where the members took it (their dropped rows selected out of the stacks: an inf or NaN in them
        would survive a factor of 0)."""
        stacks = self._stacked(members)
        if members[0]._pending is not None:
            stacks = tuple(t.masked_fill(self._mask.to(t.device).view(1, -1, *[1] * (t.dim() - 2)), 0) for t in stacks)
        out = self.batched_clipped_sums(stacks, c)
        self._stacks = None  # the sums are the last use of the stacks
        return out

    # -- a lane kind's own arithmetic ------------------------------------------------------------------------

    def stacks(self, members: List["LaneMember"]) -> tuple:
        raise NotImplementedError

    def batched_norms(self, stacks: tuple) -> torch.Tensor:  # (L, N)
        raise NotImplementedError

    def batched_clipped_sums(self, stacks: tuple, c: torch.Tensor) -> torch.Tensor:  # (L, *shape)
        raise NotImplementedError


class LaneMember(Use):
    """What a use in a lane adds to its own class: norms from the lane, a clipped sum formed with the lane's
    when asked with the factors it was formed for, and leaving the lane when its rows change."""

    lane: Optional[Lane] = None
    lane_index: int = 0
    _clipped: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (factors, this use's clipped sum under them)
    _pending: Optional[torch.Tensor] = None  # rows dropped, which the lane drops from its stacks (not from ours yet)

    def _settle(self) -> None:
        """Leave the lane, the rows it was to drop dropped from this use's own tensors."""
        pending, self._pending = self._pending, None
        self.lane, self._clipped = None, None
        if pending is not None:
            self._mask_own(pending)

    def _mask_own(self, dropped: torch.Tensor) -> None:
        super().drop_samples(dropped)  # the use's own class: its tensors' rows zeroed by selection

    def squared_norms(self) -> torch.Tensor:
        if self._pending is not None:
            self._settle()
        norms = None
        if self.lane is not None and len(self.lane._members) > 1:  # (alone: a stack would only copy it)
            norms = self.lane.norms_of(self)
        return super().squared_norms() if norms is None else norms

    def clipped_sum(self, c: torch.Tensor) -> torch.Tensor:
        formed, self._clipped = self._clipped, None
        if formed is not None and formed[0] is c:
            return formed[1]
        if self._pending is not None:
            self._settle()
        return super().clipped_sum(c)

    def grad_samples(self) -> torch.Tensor:
        if self._pending is not None:
            self._settle()
        return super().grad_samples()

    def drop_samples(self, dropped: torch.Tensor) -> None:
        if self.lane is not None and self._pending is None and self.lane.take_mask(dropped):
            self._pending, self._clipped = dropped, None  # the lane drops them from its stacks
            return
        self._settle()  # computed alone from now on, from its own (masked) tensors
        self._mask_own(dropped)


def clipped_sums_in_lanes(uses: Dict[object, List[tuple]], skip=()) -> None:
    """Form together the clipped sums of the lane members among ``uses`` (``{p: [(use, factors), ...]}``, as the
    sink passes them to each use's ``clipped_sum``) that share a lane and the same factors tensor; each keeps its
    result until asked. ``skip``: ids of uses whose sums are formed another way."""
    groups: Dict[Tuple[int, int], Tuple[Lane, torch.Tensor, List[LaneMember]]] = {}
    for pairs in uses.values():
        for use, c in pairs:
            lane = getattr(use, "lane", None)
            # (in a lane that drops rows, the members that took its mask; the others are formed alone)
            if lane is not None and id(use) not in skip and (lane._mask is None) == (use._pending is None):
                groups.setdefault((id(lane), id(c)), (lane, c, []))[2].append(use)
    for lane, c, members in groups.values():
        if len(members) < 2:
            continue
        members.sort(key=lambda m: m.lane_index)
        for member, total in zip(members, lane.clipped_sums(members, c).unbind(0)):
            member._clipped = (c, total)


# -- the lane kinds ---------------------------------------------------------------------------------------------


class OuterLane(Lane):
    """Linear weights on ``(N, d)`` inputs: per-sample gradient ``g_i a_i^T``, norm ``|a_i|^2 |g_i|^2``."""

    def stacks(self, members):
        return torch.stack([m.a for m in members]), torch.stack([m.g for m in members])  # (L, N, 1, d), (L, N, 1, p)

    def batched_norms(self, stacks):
        a, g = stacks
        return a.square().sum((2, 3)) * g.square().sum((2, 3)) * self.scale ** 2

    def batched_clipped_sums(self, stacks, c):
        a, g = (s.flatten(1, 2) for s in stacks)  # (L, N, d), (L, N, p)
        c = (c * self.scale).to(g.dtype).view(1, -1, 1)
        a, g = (a * c, g) if a.shape[-1] <= g.shape[-1] else (a, g * c)
        return torch.bmm(g.transpose(1, 2), a)


class GradSampleLane(Lane):
    """Per-sample gradients small enough to be formed (a bias, a norm layer's weight and bias): a stack
    ``(L, N, k)`` of them, made by ``stack`` (from the members', or by a batched rule)."""

    def __init__(self, scale: float, stack: Optional[Callable[[], torch.Tensor]] = None):
        super().__init__(scale)
        self._make = stack

    def stacks(self, members):
        if self._make is not None and len(members) == len(self._members):
            return (self._make().flatten(2),)
        return (torch.stack([m.unscaled().flatten(1) for m in members]),)

    def batched_norms(self, stacks):
        return stacks[0].square().sum(2) * self.scale ** 2

    def batched_clipped_sums(self, stacks, c):
        return torch.matmul((c * self.scale).to(stacks[0].dtype), stacks[0])  # (N,) @ (L, N, k) -> (L, k)


class LaneGradSamples(LaneMember, Materialised):
    """A per-sample gradient in a :class:`GradSampleLane`: ``scale *`` its row of the lane's stack, or of
    ``own`` (a bias's G summed, or the row handed over when it leaves its lane)."""

    def __init__(self, lane: GradSampleLane, batch_size: int, shape: torch.Size, own: Optional[torch.Tensor] = None,
                 row: Optional[Callable[[], torch.Tensor]] = None):
        self.batch_size, self.shape, self.scale = batch_size, shape, lane.scale
        self._own, self._row = own, row
        lane.join(self, batch_size * shape.numel())

    def unscaled(self) -> torch.Tensor:
        if self._own is None:
            self._own = self._row()
        return self._own

    @property
    def gs(self) -> torch.Tensor:
        gs = self.unscaled().reshape(self.batch_size, *self.shape)
        return gs * self.scale if self.scale != 1.0 else gs

    def _mask_own(self, dropped: torch.Tensor) -> None:
        own = self.unscaled()
        self._own = own.masked_fill(dropped.to(own.device).view(-1, *[1] * (own.dim() - 1)), 0)


class LayerNormLane:
    """LayerNorms of one shape and ``eps``: their inputs and output gradients stacked, ``x_hat`` recomputed by one
    ``layer_norm`` over the stack, weight and bias per-sample gradients summed for all (the layer's rule, batched),
    each a :class:`GradSampleLane` of its own."""

    def __init__(self, normalized_shape, eps: float, scale: float):
        self.normalized_shape, self.eps = tuple(normalized_shape), eps
        self.values = 0  # elements of the inputs and output gradients taken
        self.xs: List[torch.Tensor] = []
        self.gs: List[torch.Tensor] = []
        self._result: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.weights = GradSampleLane(scale, lambda: self.result()[0])
        self.biases = GradSampleLane(scale, lambda: self.result()[1])

    @property
    def closed(self) -> bool:
        return (self._result is not None or self.weights.closed or self.biases.closed
                or self.values >= LANE_VALUES)

    def add(self, x: torch.Tensor, g: torch.Tensor) -> int:
        self.values += x.numel() + g.numel()
        self.xs.append(x)
        self.gs.append(g)
        return len(self.xs) - 1

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._result is None:
            x, g = torch.stack(self.xs), torch.stack(self.gs)
            x_hat = F.layer_norm(x.to(g.dtype), self.normalized_shape, eps=self.eps)
            l, n, k = g.shape[0], g.shape[1], len(self.normalized_shape)
            trailing = g.shape[g.dim() - k:]
            self._result = ((g * x_hat).reshape(l, n, -1, *trailing).sum(2), g.reshape(l, n, -1, *trailing).sum(2))
            self.xs, self.gs = [], []
        return self._result

    def row(self, which: int, index: int) -> Callable[[], torch.Tensor]:
        return lambda: self.result()[which][index]
