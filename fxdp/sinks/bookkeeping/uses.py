"""What one capture contributed to one parameter (one *use*), and how its norms and clipped sum are formed
from A and G: ``outer`` / ``ghost`` / ``per_sample`` for Linear and Conv weights, ``index`` for Embedding,
and materialised per-sample gradients for everything else; the norms of a parameter used several times."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from fxdp.diagnostics.errors import PerSampleError
from fxdp.grad_sample.conv import _pad_activations, conv_grad_sample


class _Use:
    """What one capture contributed to one parameter: enough for its norm, its clipped sum and, if asked,
    its per-sample gradient. ``scale``: the factor G still carries to be a summed loss's (a mean loss's
    ``N``), folded into norms (``scale^2``) and clip factors instead of copying G."""

    batch_size: int
    scale: float = 1.0

    def squared_norms(self) -> torch.Tensor:  # (N,), this use alone
        return self.grad_samples().flatten(1).pow(2).sum(1)

    def clipped_sum(self, c: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def grad_samples(self) -> torch.Tensor:  # (N, *p.shape)
        raise NotImplementedError


class _Materialised(_Use):
    def __init__(self, grad_samples: torch.Tensor):
        self.gs = grad_samples
        self.batch_size = grad_samples.shape[0]

    def grad_samples(self):
        return self.gs

    def clipped_sum(self, c):
        return torch.tensordot(c.to(self.gs.dtype), self.gs, dims=1)


class _LinearWeight(_Use):
    """Weight of a Linear layer: per-sample gradient ``scale * G_i^T A_i`` with A (N, T, d), G (N, T, p)."""

    def __init__(self, a: torch.Tensor, g: torch.Tensor, method: str, scale: float = 1.0):
        n = g.shape[0]
        self.a = a.reshape(n, -1, a.shape[-1]).to(g.dtype)
        self.g = g.reshape(n, -1, g.shape[-1])
        self.method, self.scale = method, scale
        self.batch_size = n
        self.g_blocks: Optional[List[torch.Tensor]] = None  # G's Gram blocks, if formed already (see gram_of_g)

    def gram_of_g(self) -> None:
        """Form G's Gram blocks now, for the ghost norm. The sink calls this as G is delivered: backward has
        just written G, which is then still in the CPU's cache; at the end of backward it would be read
        from memory again. On the benchmark transformer (``dp_step_profile.py --model transformer
        --cpu-time``, three runs each, taking turns) the DP step was 1.38-1.41x a plain step this way
        against 1.41-1.49x forming them at the end."""
        if self.method == "ghost" and self.g_blocks is None:
            self.g_blocks = _gram_blocks(self.g)

    def _g_blocks(self) -> List[torch.Tensor]:
        return self.g_blocks if self.g_blocks is not None else _gram_blocks(self.g)

    def squared_norms(self):
        if self.method == "outer":
            return self.a.pow(2).sum((1, 2)) * self.g.pow(2).sum((1, 2)) * self.scale ** 2
        if self.method == "ghost":
            return _blocks_dot(_gram_blocks(self.a), self._g_blocks()) * self.scale ** 2
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


# -- Linear weights whose uses share one G (an LSTM's or RNN's two projections: one tensor of gate gradients) --


def memory_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors alive at the same time exactly when they read the same elements of the same
    memory, hence hold the same values (G is never written after it is delivered)."""
    return t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride()


def shared_ghost_norms(uses: Sequence["_LinearWeight"]) -> List[torch.Tensor]:
    """Ghost norms of Linear weights whose G is the same tensor: ``<A^k_i A^k_i^T, G_i G_i^T>`` with the Gram
    matrix of G formed once for all of them (an LSTM's G has 4h columns, its A's d and h: the G Gram is most of
    the cost). The full Gram, not the halves of :func:`_ghost_norms`: once shared, the halves' extra products
    cost more than they save (measured at T = 50)."""
    g = uses[0].g
    gram = torch.bmm(g, g.transpose(1, 2))
    return [(torch.bmm(u.a, u.a.transpose(1, 2)) * gram).sum((1, 2)) * u.scale ** 2 for u in uses]


def shared_clipped_sums(uses: Sequence["_LinearWeight"], c: torch.Tensor) -> List[torch.Tensor]:
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


def _gram_dot(a_k, a_l, g_k, g_l) -> torch.Tensor:
    """``<A^k_i A^l_i^T, G^k_i G^l_i^T>`` for every sample i: the inner product of the two uses' per-sample
    gradients ``G^k_i^T A^k_i`` and ``G^l_i^T A^l_i`` without forming either."""
    return (torch.bmm(a_k, a_l.transpose(1, 2)) * torch.bmm(g_k, g_l.transpose(1, 2))).sum((1, 2))


def _gram_blocks(x: torch.Tensor) -> List[torch.Tensor]:
    """The blocks of the per-sample Gram matrices ``X_i X_i^T`` of ``x`` (N, T, w) that :func:`_blocks_dot` reads.
    Gram matrices are symmetric: with the T positions split in two halves the off-diagonal block is formed
    once and counted twice, 3/4 of the multiply-adds (15-20% faster on CPU at T = 64; short sequences gain
    nothing from the extra calls)."""
    t = x.shape[1]
    if t < 32:
        return [torch.bmm(x, x.transpose(1, 2))]
    x1, x2 = x[:, :t // 2], x[:, t // 2:]
    return [torch.bmm(x1, x1.transpose(1, 2)), torch.bmm(x2, x2.transpose(1, 2)), torch.bmm(x1, x2.transpose(1, 2))]


def _blocks_dot(a_blocks: List[torch.Tensor], g_blocks: List[torch.Tensor]) -> torch.Tensor:
    """``<A_i A_i^T, G_i G_i^T>`` per sample from the Gram blocks of A and G (:func:`_gram_blocks`)."""
    dots = [(a * g).sum((1, 2)) for a, g in zip(a_blocks, g_blocks)]
    return dots[0] if len(dots) == 1 else dots[0] + dots[1] + 2 * dots[2]


def _ghost_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``<A_i A_i^T, G_i G_i^T>`` per sample, for A (N, T, d), G (N, T, p)."""
    return _blocks_dot(_gram_blocks(a), _gram_blocks(g))


def shared_input_ghost_norms(uses: Sequence["_LinearWeight"]) -> List[torch.Tensor]:
    """Ghost norms of Linear weights whose A is the same tensor (the query, key and value projections of one
    input), with the Gram blocks of A formed once for all of them."""
    a_blocks = _gram_blocks(uses[0].a)
    return [_blocks_dot(a_blocks, u._g_blocks()) * u.scale ** 2 for u in uses]


class _Summed(_Use):
    """A bias: its per-sample gradient is ``scale *`` G summed over every non-batch, non-channel position."""

    def __init__(self, per_sample: torch.Tensor, scale: float = 1.0):
        self.gs = per_sample  # (N, p), already materialised: as small as the bias
        self.scale = scale
        self.batch_size = per_sample.shape[0]

    def grad_samples(self):
        return self.gs * self.scale if self.scale != 1.0 else self.gs

    def squared_norms(self):
        return self.gs.pow(2).sum(1) * self.scale ** 2

    def clipped_sum(self, c):
        return (c * self.scale).to(self.gs.dtype) @ self.gs


class _ConvWeight(_Use):
    """Weight of a Conv layer, from its input A (N, C_in, *S) and output gradient G (N, C_out, *L)."""

    def __init__(self, module: nn.Module, a: torch.Tensor, g: torch.Tensor, method: str, scale: float = 1.0):
        self.module, self.a, self.g, self.method, self.scale = module, a.to(g.dtype), g, method, scale
        self.batch_size = g.shape[0]

    def grad_samples(self):
        gs = conv_grad_sample(self.module, [self.a], self.g)[self.module.weight]
        return gs * self.scale if self.scale != 1.0 else gs

    def squared_norms(self):
        if self.method != "ghost":
            return super().squared_norms()
        n, groups = self.batch_size, self.module.groups
        u = _patches(self.module, self.a)  # (N * groups, L, k * C_in / groups)
        g = self.g.reshape(n * groups, -1, u.shape[1]).transpose(1, 2)  # (N * groups, L, C_out / groups)
        return _ghost_norms(u, g).view(n, groups).sum(1) * self.scale ** 2

    def clipped_sum(self, c):
        m = self.module
        x, padding = _pad_activations(m, self.a)
        g = self.g * (c * self.scale).to(self.g.dtype).view(-1, *[1] * (self.g.dim() - 1))
        _, weight_grad, _ = torch.ops.aten.convolution_backward(
            g, x, m.weight.detach(), None, list(m.stride), list(padding), list(m.dilation),
            False, [0] * len(padding), m.groups, [False, True, False],
        )
        return weight_grad


def _patches(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The convolution's input patches per sample and group, ``(N * groups, L, prod(k) * C_in / groups)``,
    for any number of spatial dims, stride, padding and dilation. Channels are innermost (one copy of a
    channels-last view: faster than unfolding channels-first); the columns are then not in the weight's
    order, which the Gram matrix ``U U^T`` does not see."""
    x, padding = _pad_activations(module, x)
    if any(padding):
        x = torch.nn.functional.pad(x, [p for p in reversed(padding) for _ in (0, 1)])
    x = x.movedim(1, -1).contiguous()  # (N, *S, C)
    n, spatial, c, groups = x.shape[0], x.shape[1:-1], x.shape[-1], module.groups
    out = [(size - d * (k - 1) - 1) // s + 1
           for size, k, s, d in zip(spatial, module.kernel_size, module.stride, module.dilation)]
    steps = [x.stride(1 + j) for j in range(len(spatial))]
    windows = x.as_strided(
        (n, *out, *module.kernel_size, groups, c // groups),
        (x.stride(0), *[st * s for st, s in zip(steps, module.stride)],
         *[st * d for st, d in zip(steps, module.dilation)], c // groups, 1),
    )
    return windows.movedim(1 + 2 * len(spatial), 1).reshape(n * groups, math.prod(out), -1)


class _EmbeddingWeight(_Use):
    """Weight of an Embedding: sample i's gradient has row v = sum of g_t where idx_t = v (padding_idx
    rows excluded)."""

    def __init__(self, module: nn.Embedding, idx: torch.Tensor, g: torch.Tensor):
        n = g.shape[0]
        self.num_rows, self.padding_idx = module.num_embeddings, module.padding_idx
        self.idx = idx.reshape(n, -1)
        self.g = g.reshape(n, -1, g.shape[-1])
        self.batch_size = n
        self._common = False  # not looked at yet (see common_indices)

    def _kept(self):
        """(sample id, index, g) of every looked-up position that is not padding."""
        n, t = self.idx.shape
        samples = torch.arange(n, device=self.idx.device).repeat_interleave(t)
        idx, g = self.idx.reshape(-1), self.g.reshape(n * t, -1)
        if self.padding_idx is not None:
            keep = idx != self.padding_idx
            samples, idx, g = samples[keep], idx[keep], g[keep]
        return samples, idx, g

    def common_indices(self) -> Optional[torch.Tensor]:
        """The one row of indices every sample looked up, when all samples looked up the same (a position
        embedding: ``arange(T)`` expanded over the batch), else None. Its norms and clipped sum then group
        positions once for the batch, not per (sample, index) pair: for the benchmark transformer's position
        embedding (32 samples x 64 positions, D = 128, 2 threads) the norms took 0.08 ms instead of 1.6 ms."""
        if self._common is False:
            n, idx = self.idx.shape[0], self.idx
            same = n > 1 and (idx.stride(0) == 0 or torch.equal(idx, idx[:1].expand_as(idx)))
            self._common = idx[0] if same else None
        return self._common

    def _common_kept(self):
        """(the common row of indices, G at those positions), padding positions left out; None unless every
        sample looked up the same indices (see :meth:`common_indices`)."""
        row = self.common_indices()
        if row is None:
            return None
        if self.padding_idx is not None:
            keep = row != self.padding_idx
            if not bool(keep.all()):
                return row[keep], self.g[:, keep]
        return row, self.g

    def squared_norms(self):
        common = self._common_kept()
        if common is None:
            return _grouped_squared_norms([self], self.batch_size)
        row, g = common
        unique, inverse = torch.unique(row, return_inverse=True)
        if unique.shape[0] == row.shape[0]:  # every position its own row (positions): no two summed
            return g.pow(2).sum((1, 2))
        rows = g.new_zeros(g.shape[0], unique.shape[0], g.shape[-1]).index_add_(1, inverse, g)
        return rows.pow(2).sum((1, 2))

    def grad_samples(self):
        samples, idx, g = self._kept()
        out = g.new_zeros(self.batch_size * self.num_rows, g.shape[-1])
        out.index_add_(0, samples * self.num_rows + idx, g)
        return out.view(self.batch_size, self.num_rows, -1)

    def clipped_sum(self, c):
        out = self.g.new_zeros(self.num_rows, self.g.shape[-1])
        common = self._common_kept()
        if common is not None:  # the batch's positions weighted and added first, then one row per position
            row, g = common
            return out.index_add_(0, row, torch.tensordot(c.to(g.dtype), g, dims=1))
        samples, idx, g = self._kept()
        return out.index_add_(0, idx, g * c.to(g.dtype)[samples].unsqueeze(1))


def _grouped_squared_norms(uses: Sequence[_EmbeddingWeight], n: int) -> torch.Tensor:
    """``sum_v ||sum_{t: idx_t = v} g_t||^2`` per sample, over the positions of all ``uses`` together:
    positions with the same (sample, index) are summed, then squared."""
    parts = [u._kept() for u in uses]
    if len(parts) == 1:  # (no copy of G)
        samples, idx, g = parts[0]
    else:
        samples, idx, g = (torch.cat(column) for column in zip(*parts))
    keys = samples * uses[0].num_rows + idx
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = g.new_zeros(unique.shape[0], g.shape[-1]).index_add_(0, inverse, g)
    return g.new_zeros(n).index_add_(0, unique // uses[0].num_rows, rows.pow(2).sum(1))


# -- a parameter's uses in one backward pass ------------------------------------------------------------


def _tied_squared_norms(uses: List[_Use], prefer: Optional[str]) -> torch.Tensor:
    """Norms of the per-sample *sum* of several uses of one parameter."""
    if all(isinstance(u, _LinearWeight) for u in uses):
        t = [u.a.shape[1] for u in uses]
        d, p = uses[0].a.shape[-1], uses[0].g.shape[-1]
        ghost, per_sample = sum(t) ** 2 * (d + p), (sum(t) + 1) * d * p
        if prefer == "ghost" or (prefer != "per_sample" and ghost <= per_sample):
            return _linear_uses_dot(uses)
    if all(isinstance(u, _EmbeddingWeight) for u in uses):
        return _grouped_squared_norms(uses, uses[0].batch_size)
    embedding = [u for u in uses if isinstance(u, _EmbeddingWeight)]
    linear = [u for u in uses if isinstance(u, _LinearWeight)]
    kept = [u for u in uses if isinstance(u, _Materialised)]
    if embedding and len(embedding) + len(linear) + len(kept) == len(uses) and not (linear and kept):
        # one (V, d) table used as an Embedding and as a Linear weight (a language model's tied input and
        # output embeddings): |E_i + W_i|^2 from the index norms, the Linear uses' norms and the cross terms,
        # without forming the Embedding's (N, V, d) per-sample gradient E
        table = (embedding[0].num_rows, embedding[0].g.shape[-1])
        total = _grouped_squared_norms(embedding, embedding[0].batch_size)
        if linear and all((u.g.shape[-1], u.a.shape[-1]) == table for u in linear):  # ghost: no (N, V, d) at all
            total = total + _linear_uses_dot(linear)
            return total + 2 * sum(_linear_embedding_dot(k, e) for k in linear for e in embedding)
        if kept and all(tuple(u.gs.shape[1:]) == table for u in kept):  # the Linear's own, kept per-sample
            w = sum(u.gs for u in kept)
            return total + w.pow(2).sum((1, 2)) + 2 * sum(_rows_dot(w, e) for e in embedding)
    total = uses[0].grad_samples()
    for u in uses[1:]:
        total = total + u.grad_samples()
    return total.flatten(1).pow(2).sum(1)


def _linear_uses_dot(uses: List[_LinearWeight]) -> torch.Tensor:
    """``|sum_k G^k_i^T A^k_i|^2`` per sample: each use's own ghost norm (from the Gram blocks of G formed as
    it was delivered, when it was) plus twice the cross terms."""
    total = sum(u.squared_norms() if u.method == "ghost" else _gram_dot(u.a, u.a, u.g, u.g) * u.scale ** 2
                for u in uses)
    for i, k in enumerate(uses):
        for l in uses[i + 1:]:
            total = total + 2 * _gram_dot(k.a, l.a, k.g, l.g) * (k.scale * l.scale)
    return total


def _linear_embedding_dot(linear: _LinearWeight, embedding: _EmbeddingWeight) -> torch.Tensor:
    """``<G_i^T A_i, E_i>`` per sample for a (V, d) table used as a Linear weight (A (N, S, d), G (N, S, V)) and
    as an Embedding (indices (N, T), rows g (N, T, d)): ``sum_{s,t} G_i[s, idx_t] (a_s . g_t)`` over the
    looked-up positions that are not padding, at ``S * T * d`` multiply-adds per sample."""
    idx, g = embedding.idx, embedding.g.to(linear.g.dtype)
    n, s, t = linear.a.shape[0], linear.a.shape[1], idx.shape[1]
    dots = torch.bmm(linear.a, g.transpose(1, 2))  # (N, S, T): a_s . g_t
    picked = torch.gather(linear.g, 2, idx.unsqueeze(1).expand(n, s, t))  # (N, S, T): G[s, idx_t]
    if embedding.padding_idx is not None:
        picked = picked * (idx != embedding.padding_idx).unsqueeze(1).to(picked.dtype)
    return (dots * picked).sum((1, 2)) * linear.scale


def _rows_dot(w: torch.Tensor, embedding: _EmbeddingWeight) -> torch.Tensor:
    """``<W_i, E_i>`` per sample for per-sample gradients ``w`` (N, V, d) of a table also used as an
    Embedding: ``sum_t W_i[idx_t] . g_t`` over the looked-up positions that are not padding."""
    idx, g = embedding.idx, embedding.g.to(w.dtype)
    rows = torch.gather(w, 1, idx.unsqueeze(-1).expand(*idx.shape, w.shape[-1]))  # (N, T, d): W_i[idx_t]
    if embedding.padding_idx is not None:
        rows = rows * (idx != embedding.padding_idx).unsqueeze(-1).to(rows.dtype)
    return (rows * g).sum((1, 2))


@dataclass
class _Segment:
    """One backward pass's record of one parameter: its per-sample squared norms and the uses that
    produce its clipped sum."""

    norms: torch.Tensor
    uses: List[_Use]


def _same_batch(param: nn.Parameter, uses: List[_Use]) -> int:
    sizes = {u.batch_size for u in uses}
    if len(sizes) != 1:
        raise PerSampleError(
            f"fxdp: parameter of shape {tuple(param.shape)} was used with batches of {sorted(sizes)} samples in "
            "one backward pass; per-sample norms need one batch per backward. Call backward once per batch"
        )
    return sizes.pop()
