"""Per-graph gradients by segment: the rules of the graphs engine.

When no edge crosses graphs and the loss adds up per-graph losses, the output gradient of a layer applied row by
row (node rows or graph rows) is, at each row, that row's graph's own: so a graph's gradient of the layer's weight
is the sum, over its rows, of the per-row contributions ``g_r a_rᵀ``. Rows of one graph are contiguous (the batch
vector is sorted, checked by :mod:`fxdp.graphs.layout`), so the sums are one batched product over rows padded per
graph, ``(G, out, L) @ (G, L, in)``, with no ``(rows, out, in)`` tensor formed.
"""

from __future__ import annotations

from typing import Tuple

import torch


def segment_offsets(graph_of_row: torch.Tensor, num_graphs: int) -> torch.Tensor:
    counts = torch.bincount(graph_of_row, minlength=num_graphs)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def padded_by_segment(rows: torch.Tensor, graph_of_row: torch.Tensor, num_graphs: int) -> torch.Tensor:
    """``rows`` (R, d), their graphs sorted, as (G, L, d): graph k's rows first, zeros after (L: the most rows)."""
    ptr = segment_offsets(graph_of_row, num_graphs)
    longest = int((ptr[1:] - ptr[:-1]).max()) if num_graphs else 0
    out = rows.new_zeros((num_graphs, longest, rows.shape[1]))
    if rows.shape[0]:
        position = torch.arange(rows.shape[0], device=rows.device) - ptr[graph_of_row]
        out[graph_of_row, position] = rows
    return out


def segment_sum(rows: torch.Tensor, graph_of_row: torch.Tensor, num_graphs: int) -> torch.Tensor:
    """Per graph, the sum of its rows: (G, *rows.shape[1:])."""
    out = rows.new_zeros((num_graphs, *rows.shape[1:]))
    return out.index_add_(0, graph_of_row, rows)


def segment_linear(activations: torch.Tensor, backprops: torch.Tensor, graph_of_row: torch.Tensor,
                   num_graphs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-graph gradients of ``y = x Wᵀ + b`` applied row by row: ``(G, out, in)`` and ``(G, out)``."""
    a = padded_by_segment(activations, graph_of_row, num_graphs)
    g = padded_by_segment(backprops, graph_of_row, num_graphs)
    return torch.bmm(g.transpose(1, 2), a), segment_sum(backprops, graph_of_row, num_graphs)
