"""Book-keeping of ``nn.Embedding``: sample i's gradient has row v = the sum of its output gradients g_t at the
positions that looked up v (``idx_t = v``), so its squared norm is ``sum_v ||sum_{t: idx_t = v} g_t||^2`` (rows
of equal index summed per sample, the index-equality form of ``sum_{t,s} [idx_t = idx_s] <g_t, g_s>``) and its
clipped sum adds ``c_i g_t`` into row ``idx_t``: no ``(N, V, D)`` tensor is formed."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from fxdp.grad_sample.embedding import embedding_grad_sample
from fxdp.sinks.bookkeeping.registry import LayerBookkeeping, LayerPlan
from fxdp.sinks.bookkeeping.uses import Use


class EmbeddingWeight(Use):
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
        positions once for the batch, not per (sample, index) pair."""
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
            return grouped_squared_norms([self], self.batch_size)
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


def grouped_squared_norms(uses: Sequence[EmbeddingWeight], n: int) -> torch.Tensor:
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


def _lookup(padding_idx):
    def fn(indices, weight):
        return torch.nn.functional.embedding(indices, weight, padding_idx)

    return fn


class EmbeddingBookkeeping(LayerBookkeeping):
    rule = embedding_grad_sample

    def plan(self, module, a, g, prefer):
        name = type(module).__name__
        if module.max_norm is not None:
            return LayerPlan(name, "materialise", "max_norm is set: the per-sample rule decides")
        if module.scale_grad_by_freq:
            return LayerPlan(name, "materialise", "scale_grad_by_freq: per-sample frequencies")
        if a + [module.embedding_dim] != g:
            return LayerPlan(name, "materialise", f"output gradient {tuple(g)} is not indices {tuple(a)} + (D,)")
        return LayerPlan(name, "index", "rows of equal index summed per sample (no dense per-sample gradient)")

    def uses(self, captured, sink):
        if not captured.params:
            return {}
        # G is (N, T, D), small next to the table: scaled once here
        g = captured.g * captured.scale if captured.scale != 1.0 else captured.g
        return {p: EmbeddingWeight(captured.module, captured.a, g) for p in captured.params}

    def functional_forward(self, module, x):
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            return None
        return _lookup(module.padding_idx), (module.weight,)
