"""Per-graph gradients by segment: the rules of the graphs engine.

When no edge crosses graphs and the loss adds up per-graph losses, the output gradient of a layer applied row by
row (node rows or graph rows) is, at each row, that row's graph's own: so a graph's gradient of the layer's weight
is the sum, over its rows, of the per-row contributions ``g_r a_rᵀ``. Rows of one graph are contiguous (the batch
vector is sorted, checked by :mod:`fxdp.graphs.layout`), so the sums are one batched product over rows padded per
graph, ``(G, out, L) @ (G, L, in)``, with no ``(rows, out, in)`` tensor formed.
"""

from __future__ import annotations

import torch


def segment_offsets(graph_of_row: torch.Tensor, num_graphs: int) -> torch.Tensor:
    counts = torch.bincount(graph_of_row, minlength=num_graphs)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def padded_by_segment(rows: torch.Tensor, graph_of_row: torch.Tensor, num_graphs: int) -> torch.Tensor:
    """``rows`` (R, d), their graphs sorted, as (G, L, d): graph k's rows first, zeros after (L: the most rows, at
    least 1, so that a batch of no graph or of graphs without rows still has a row length)."""
    ptr = segment_offsets(graph_of_row, num_graphs)
    if num_graphs == 0 or rows.shape[0] == 0:
        return rows.new_zeros((num_graphs, 1, rows.shape[1]))
    counts = (ptr[1:] - ptr[:-1]).tolist()
    return torch.nn.utils.rnn.pad_sequence(list(torch.split(rows, counts)), batch_first=True)


def segment_sum(rows: torch.Tensor, graph_of_row: torch.Tensor, num_graphs: int) -> torch.Tensor:
    """Per graph, the sum of its rows (sorted by graph): (G, *rows.shape[1:])."""
    return padded_by_segment(rows.reshape(rows.shape[0], -1), graph_of_row, num_graphs).sum(1).reshape(
        num_graphs, *rows.shape[1:])
