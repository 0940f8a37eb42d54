"""Book-keeping of ``nn.Linear`` (and its subclasses that keep its forward): ``outer`` on ``(N, d)``, ``ghost`` or
``per_sample`` on sequences ``(N, T, d)``, whichever costs less; the bias as G summed over positions.

A weight's per-sample gradient is ``G_i^T A_i`` (A ``(N, T, d)``, G ``(N, T, p)``): its squared norm is
``||a_i||^2 ||g_i||^2`` for ``T = 1`` (outer), ``<A_i A_i^T, G_i G_i^T>`` from Gram matrices (ghost, ``~T^2 (d + p)``
per sample) or that of the formed product (per_sample, ``~T d p``); its clipped sum is the layer's ordinary
weight-gradient product with G's rows scaled by the clip factors, ``G^T diag(c) A``.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from fxdp.grad_sample.linear import linear_grad_sample
from fxdp.sinks.bookkeeping.lanes import GradSampleLane, LaneGradSamples, LaneMember, OuterLane, small
from fxdp.sinks.bookkeeping.registry import LayerBookkeeping, LayerPlan, pick
from fxdp.sinks.bookkeeping.uses import Summed, Use


class LinearWeight(Use):
    """Weight of a Linear layer: per-sample gradient ``scale * G_i^T A_i`` with A (N, T, d), G (N, T, p)."""

    def __init__(self, a: torch.Tensor, g: torch.Tensor, method: str, scale: float = 1.0):
        n = g.shape[0]
        a = a if a.dim() == 3 else a.reshape(n, -1, a.shape[-1])  # (the checks spare a small layer two kernels)
        self.a = a if a.dtype == g.dtype else a.to(g.dtype)
        self.g = g if g.dim() == 3 else g.reshape(n, -1, g.shape[-1])
        self.method, self.scale = method, scale
        self.batch_size = n
        self.g_blocks: Optional[List[torch.Tensor]] = None  # G's Gram blocks, if formed already (see gram_of_g)

    def gram_of_g(self) -> None:
        """Form G's Gram blocks now, for the ghost norm. The sink calls this as G is delivered: backward has
        just written G, which is then still in the CPU's cache; at the end of backward it would be read
        from memory again (``benchmarks/dp_step_profile.py --model transformer`` measures the difference)."""
        if self.method == "ghost" and self.g_blocks is None:
            self.g_blocks = gram_blocks(self.g)

    def drop_samples(self, dropped: torch.Tensor) -> None:
        super().drop_samples(dropped)
        self.g_blocks = None  # formed from the G before it

    def g_gram_blocks(self) -> List[torch.Tensor]:
        return self.g_blocks if self.g_blocks is not None else gram_blocks(self.g)

    def squared_norms(self):
        if self.method == "outer":
            return self.a.pow(2).sum((1, 2)) * self.g.pow(2).sum((1, 2)) * self.scale ** 2
        if self.method == "ghost":
            return blocks_dot(gram_blocks(self.a), self.g_gram_blocks()) * self.scale ** 2
        return self.grad_samples().pow(2).sum((1, 2))

    def grad_samples(self):
        gs = torch.bmm(self.g.transpose(1, 2), self.a)
        return gs * self.scale if self.scale != 1.0 else gs

    def ordered(self):
        """``(A, G, shape for the factors)`` with the rows in G's memory order: a recurrent layer's G is
        time-major in memory (batch first only as a view), and a sum over ``(t, i)`` rather than ``(i, t)``
        needs no copy of it."""
        if not self.g.is_contiguous() and self.g.transpose(0, 1).is_contiguous():
            return self.a.transpose(0, 1), self.g.transpose(0, 1), (1, -1, 1)
        return self.a, self.g, (-1, 1, 1)

    def clipped_sum(self, c):
        # G^T diag(c) A: the factors scale the narrower of A and G (fewer multiplications, a smaller copy)
        a, g, where = self.ordered()
        c = (c * self.scale).to(g.dtype).view(where)
        a, g = (a * c, g) if a.shape[-1] <= g.shape[-1] else (a, g * c)
        return g.flatten(0, 1).t().mm(a.flatten(0, 1))


class LaneLinearWeight(LaneMember, LinearWeight):
    """A small Linear weight on ``(N, d)`` inputs (outer), its norm and clipped sum formed with the others of its
    lane (:class:`~fxdp.sinks.bookkeeping.lanes.OuterLane`)."""

    def __init__(self, lane: OuterLane, a: torch.Tensor, g: torch.Tensor, scale: float):
        super().__init__(a, g, "outer", scale)
        lane.join(self, a.numel() + g.numel())


def gram_dot(a_k, a_l, g_k, g_l) -> torch.Tensor:
    """``<A^k_i A^l_i^T, G^k_i G^l_i^T>`` for every sample i: the inner product of the two uses' per-sample
    gradients ``G^k_i^T A^k_i`` and ``G^l_i^T A^l_i`` without forming either."""
    return (torch.bmm(a_k, a_l.transpose(1, 2)) * torch.bmm(g_k, g_l.transpose(1, 2))).sum((1, 2))


def gram_blocks(x: torch.Tensor) -> List[torch.Tensor]:
    """The blocks of the per-sample Gram matrices ``X_i X_i^T`` of ``x`` (N, T, w) that :func:`blocks_dot` reads.
    Gram matrices are symmetric: with the T positions split in two halves the off-diagonal block is formed
    once and counted twice, 3/4 of the multiply-adds (short sequences gain nothing from the extra calls)."""
    t = x.shape[1]
    if t < 32:
        return [torch.bmm(x, x.transpose(1, 2))]
    x1, x2 = x[:, :t // 2], x[:, t // 2:]
    return [torch.bmm(x1, x1.transpose(1, 2)), torch.bmm(x2, x2.transpose(1, 2)), torch.bmm(x1, x2.transpose(1, 2))]


def blocks_dot(a_blocks: List[torch.Tensor], g_blocks: List[torch.Tensor]) -> torch.Tensor:
    """``<A_i A_i^T, G_i G_i^T>`` per sample from the Gram blocks of A and G (:func:`gram_blocks`)."""
    dots = [(a * g).sum((1, 2)) for a, g in zip(a_blocks, g_blocks)]
    return dots[0] if len(dots) == 1 else dots[0] + dots[1] + 2 * dots[2]


def ghost_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``<A_i A_i^T, G_i G_i^T>`` per sample, for A (N, T, d), G (N, T, p)."""
    return blocks_dot(gram_blocks(a), gram_blocks(g))


def plan_matmul(layer: str, a: List[int], g: List[int], d_in: int, d_out: int, prefer: Optional[str]) -> LayerPlan:
    """The plan of ``(N, *, d_in) -> (N, *, d_out)`` by a weight matrix (Linear, transformers' Conv1D)."""
    if len(a) < 2 or a[:-1] != g[:-1] or a[-1] != d_in or g[-1] != d_out:
        return LayerPlan(layer, "materialise", f"input {tuple(a)} / output gradient {tuple(g)} not (N, *, d) -> (N, *, p)")
    t = math.prod(a[1:-1])
    if t == 1:
        return LayerPlan(layer, "outer", "input (N, d): ||a_i|| * ||g_i||")
    d, p = a[-1], g[-1]
    return pick(layer, t * t * (d + p), t * d * p, prefer, f"sequence T={t}, d={d}, p={p}")


class LinearBookkeeping(LayerBookkeeping):
    rule = linear_grad_sample
    #: form G's Gram blocks as G is delivered (:meth:`LinearWeight.gram_of_g`); a recurrent layer's two
    #: projections, which share one G, form its Gram once for both instead
    gram_on_delivery = True

    def plan(self, module, a, g, prefer):
        return plan_matmul(type(module).__name__, a, g, module.in_features, module.out_features, prefer)

    def uses(self, captured, sink):
        out = {}
        a, g, scale = captured.a, captured.g, captured.scale
        # small layers on (N, d): formed with the others alike in one batched kernel (see lanes.py)
        laned = captured.method == "outer" and small(a, g)
        bias = captured.module.bias
        for p in captured.params:
            if p is bias:  # summed over the middle positions (G itself on (N, p))
                if laned:
                    lane = sink.lane(("bias", g.shape[0], p.shape, g.dtype, g.device, scale),
                                     lambda: GradSampleLane(scale))
                    out[p] = LaneGradSamples(lane, g.shape[0], p.shape, own=sink.bias_sum(g))
                else:
                    out[p] = Summed(sink.bias_sum(g), scale)
                continue
            if laned:
                lane = sink.lane(("outer", a.shape, g.shape, g.dtype, g.device, scale), lambda: OuterLane(scale))
                out[p] = LaneLinearWeight(lane, a, g, scale)
                continue
            out[p] = LinearWeight(a, g, captured.method, scale)
            if self.gram_on_delivery and getattr(sink, "per_sample_norms", True):
                out[p].gram_of_g()
        return out

    def functional_forward(self, module, x):
        return torch.nn.functional.linear, (module.weight, module.bias)
