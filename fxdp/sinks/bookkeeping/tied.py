"""The per-sample norms of a parameter used several times in one step (tied weights, a layer called twice):
the norm of the per-sample *sum* of its uses, ``||sum_k g_i^(k)||``.

From cross terms ``sum_{k,l} <A^k_i A^l_i^T, G^k_i G^l_i^T>`` when all its uses are Linear weights, from the
concatenated indices when all are Embedding tables. A ``(V, d)`` table used both ways (a language model's input
embedding tied to its output layer, GPT-2's ``wte``/``lm_head``) adds the cross terms
``<G_i^T A_i, E_i> = sum_{s,t} G_i[s, idx_t] (a_s . g_t)``, or ``sum_t W_i[idx_t] . g_t`` where the output
layer's per-sample gradient ``W_i`` is kept: the Embedding's ``(N, V, d)`` gradient is never formed. Any other
mix (a new registration's uses among them) adds the uses' per-sample gradients and takes the norm.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from fxdp.sinks.bookkeeping.embedding import EmbeddingWeight, grouped_squared_norms
from fxdp.sinks.bookkeeping.linear import LinearWeight, gram_dot
from fxdp.sinks.bookkeeping.uses import Materialised, Use


def tied_squared_norms(uses: List[Use], prefer: Optional[str]) -> torch.Tensor:
    """Norms of the per-sample *sum* of several uses of one parameter."""
    if all(isinstance(u, LinearWeight) for u in uses):
        t = [u.a.shape[1] for u in uses]
        d, p = uses[0].a.shape[-1], uses[0].g.shape[-1]
        ghost, per_sample = sum(t) ** 2 * (d + p), (sum(t) + 1) * d * p
        if prefer == "ghost" or (prefer != "per_sample" and ghost <= per_sample):
            return _linear_uses_dot(uses)
    if all(isinstance(u, EmbeddingWeight) for u in uses):
        return grouped_squared_norms(uses, uses[0].batch_size)
    embedding = [u for u in uses if isinstance(u, EmbeddingWeight)]
    linear = [u for u in uses if isinstance(u, LinearWeight)]
    kept = [u for u in uses if isinstance(u, Materialised)]
    if embedding and len(embedding) + len(linear) + len(kept) == len(uses) and not (linear and kept):
        # one (V, d) table used as an Embedding and as a Linear weight (a language model's tied input and
        # output embeddings): |E_i + W_i|^2 from the index norms, the Linear uses' norms and the cross terms,
        # without forming the Embedding's (N, V, d) per-sample gradient E
        table = (embedding[0].num_rows, embedding[0].g.shape[-1])
        total = grouped_squared_norms(embedding, embedding[0].batch_size)
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


def _linear_uses_dot(uses: List[LinearWeight]) -> torch.Tensor:
    """``|sum_k G^k_i^T A^k_i|^2`` per sample: each use's own ghost norm (from the Gram blocks of G formed as
    it was delivered, when it was) plus twice the cross terms."""
    total = sum(u.squared_norms() if u.method == "ghost" else gram_dot(u.a, u.a, u.g, u.g) * u.scale ** 2
                for u in uses)
    for i, k in enumerate(uses):
        for l in uses[i + 1:]:
            total = total + 2 * gram_dot(k.a, l.a, k.g, l.g) * (k.scale * l.scale)
    return total


def _linear_embedding_dot(linear: LinearWeight, embedding: EmbeddingWeight) -> torch.Tensor:
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


def _rows_dot(w: torch.Tensor, embedding: EmbeddingWeight) -> torch.Tensor:
    """``<W_i, E_i>`` per sample for per-sample gradients ``w`` (N, V, d) of a table also used as an
    Embedding: ``sum_t W_i[idx_t] . g_t`` over the looked-up positions that are not padding."""
    idx, g = embedding.idx, embedding.g.to(w.dtype)
    rows = torch.gather(w, 1, idx.unsqueeze(-1).expand(*idx.shape, w.shape[-1]))  # (N, T, d): W_i[idx_t]
    if embedding.padding_idx is not None:
        rows = rows * (idx != embedding.padding_idx).unsqueeze(-1).to(rows.dtype)
    return (rows * g).sum((1, 2))
