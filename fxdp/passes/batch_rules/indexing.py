"""Indexing and gathering: ``x[index]``, ``x[index] = v``, select, narrow, index_select, gather,
scatter, take, embeddings.

Indexing a per-sample dimension keeps samples apart; picking entries along the batch dimension
(``x[0]``, ``x[idx]``, gather along it) hands one sample's values to another, unless the index is
each sample's own (``x[torch.arange(N), idx]``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from fxdp.runtime import inplace_ops as out_of_place
from fxdp.layout import BROADCAST, PACKED, UNBATCHED, UNBATCHED_LAYOUT, UNKNOWN_LAYOUT, BatchLayout
from fxdp.passes.batch_rules.core import (
    _FIX_INDEX, _FIX_LAYER, _FIX_PAIR, OpCall, Verdict, _at, _fn, _inner, _keys, _moved, _norm_dim,
    _where, mirror, carries_batch, rearranging, register_batch_rule,
)


@dataclass
class _Indexed:
    layout: Any
    mixes: str = ""
    ndim: int = 0  # dimensions of the indexed region
    region_dims: Tuple[Optional[int], ...] = ()  # basic indexing: region dim -> input dim (None: new)


def _is_full(s: slice, size: int) -> bool:
    start, stop, step = s.indices(size)
    return start == 0 and stop == size and step == 1


def _as_list(value, n: int) -> list:
    return list(value) + [None] * (n - len(value))


def index_layout(call: OpCall, x: torch.Tensor, lay, index, index_layouts, index_nodes) -> _Indexed:
    """Where the batch goes in ``x[index]``, and whether the indexing picks samples by position."""
    tup = isinstance(index, tuple)
    items = list(index) if tup else [index]
    lays = _as_list(index_layouts if tup and isinstance(index_layouts, (list, tuple)) else [index_layouts], len(items))
    nodes = _as_list(index_nodes if tup and isinstance(index_nodes, (list, tuple)) else [index_nodes], len(items))

    def consumes(it) -> int:
        if it is None or it is Ellipsis or isinstance(it, bool):
            return 0
        if isinstance(it, torch.Tensor) and it.dtype == torch.bool:
            return it.dim()
        return 1

    fill = x.dim() - sum(consumes(it) for it in items)
    k = next((i for i, it in enumerate(items) if it is Ellipsis), len(items))
    items[k:k + 1] = [slice(None)] * fill
    lays[k:k + 1] = [None] * fill
    nodes[k:k + 1] = [None] * fill

    batch = lay if carries_batch(lay) else None
    kept = batch
    entries: List[Tuple[str, Optional[int]]] = []  # ("in", input dim) | ("new", None) | ("adv", None)
    advanced = []  # (input dim, index tensor, its layout, its node)
    d = 0
    for it, it_lay, it_node in zip(items, lays, nodes):
        if it is None or isinstance(it, bool):
            entries.append(("new", None))
        elif isinstance(it, int):
            if batch is not None and d == batch.dim:
                return _Indexed(UNBATCHED_LAYOUT,
                                f"picks sample {it} along the batch dimension ({_where(batch)}): whatever uses "
                                "the result reads one sample's data for every sample")
            d += 1
        elif isinstance(it, slice):
            if batch is not None and d == batch.dim and not _is_full(it, x.shape[d]):
                start, stop, step = it.indices(x.shape[d])
                block = call.batch_size * _inner(batch)
                if not (step == 1 and stop > start and start % block == 0 and (stop - start) % block == 0):
                    return _Indexed(UNBATCHED_LAYOUT,
                                    f"selects entries {start}:{stop}:{step} along the batch dimension "
                                    f"({_where(batch)}): the result no longer has one entry per sample")
                whole = (stop - start) == call.batch_size and _inner(batch) == 1
                kept = BatchLayout.at(batch.dim) if whole else BatchLayout.merged(batch.dim, _inner(batch))
            entries.append(("in", d))
            d += 1
        elif isinstance(it, (list, range, torch.Tensor)):
            if not isinstance(it, torch.Tensor):
                it, it_lay = torch.empty(len(it), dtype=torch.long, device="meta"), UNBATCHED_LAYOUT
            advanced.append((d, it, it_lay, it_node))
            entries.append(("adv", None))
            d += it.dim() if it.dtype == torch.bool else 1
        else:
            return _Indexed(UNKNOWN_LAYOUT)

    rest = [e for e in entries if e[0] != "adv"]
    rest_dims = [e[1] if e[0] == "in" else None for e in rest]
    if not advanced:
        if batch is None:
            return _Indexed(_broadcast_after(lay, rest_dims), ndim=len(rest), region_dims=tuple(rest_dims))
        return _Indexed(_at(kept, rest_dims.index(batch.dim)), ndim=len(rest), region_dims=tuple(rest_dims))

    # advanced indexing: the index tensors broadcast into one block of dimensions, placed where the
    # first of them was if they are adjacent, else in front
    positions = [i for i, e in enumerate(entries) if e[0] == "adv"]
    block_at = positions[0] if positions == list(range(positions[0], positions[-1] + 1)) else 0
    block = max(t.dim() for _, t, _, _ in advanced)
    ndim = len(rest) + block
    in_block = None
    batch_taken = batch is not None and any(in_dim == batch.dim for in_dim, _, _, _ in advanced)
    for in_dim, t, t_lay, t_node in advanced:
        takes_batch = batch is not None and in_dim == batch.dim
        if takes_batch and not (carries_batch(t_lay) and call.is_sample_index(t_node)):
            return _Indexed(UNBATCHED_LAYOUT, "gathers along the batch dimension with an index tensor: sample i "
                                              "receives the values of whichever sample the index names")
        if carries_batch(t_lay):
            if batch is not None and not batch_taken:
                return _Indexed(UNBATCHED_LAYOUT, f"indexes dim {in_dim} of a per-sample tensor with per-sample "
                                                  "indices: each sample's values are read with every sample's indices")
            here = _at(t_lay, block_at + block - t.dim() + t_lay.dim)
            if in_block is not None and here != in_block:
                return _Indexed(UNBATCHED_LAYOUT, "combines per-sample index tensors whose batches do not line up")
            in_block = here
    if batch is not None and in_block is None:  # the batch dim was kept by a slice
        j = rest_dims.index(batch.dim)
        return _Indexed(_at(kept, j if j < block_at else j + block), ndim=ndim)
    if in_block is not None:
        return _Indexed(_at(batch, in_block.dim) if batch is not None else in_block, ndim=ndim)
    return _Indexed(UNBATCHED_LAYOUT, ndim=ndim)


def _broadcast_after(lay, out_dims) -> BatchLayout:
    if isinstance(lay, BatchLayout) and lay.kind == BROADCAST and lay.dim in out_dims:
        return BatchLayout.broadcast(out_dims.index(lay.dim))
    return UNBATCHED_LAYOUT


@rearranging
def _getitem(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    if not isinstance(x, torch.Tensor):
        return Verdict(None)
    got = index_layout(call, x, lay, call.args[1], call.arg_layouts[1], call.arg_node(1))
    if got.mixes:
        return Verdict(mirror(call.out, got.layout), mixes=got.mixes, fix=_FIX_INDEX)
    after = got.layout
    # a None inserted in front of the batch moves it (like unsqueeze); dropping leading dims does not
    if carries_batch(lay) and carries_batch(after) and after.dim > lay.dim:
        return _moved(call, lay, after, x.shape, call.out.shape)
    return Verdict(mirror(call.out, after))


def _setitem(call: OpCall) -> Verdict:
    """x[index] = v: writing per-sample values into entries picked along the batch mixes samples."""
    x, lay = call.args[0], call.arg_layouts[0]
    v, v_lay = call.args[2], call.arg_layouts[2]
    if not (isinstance(v, torch.Tensor) and carries_batch(v_lay)):
        return Verdict(None)  # writing constants never mixes samples
    got = index_layout(call, x, lay, call.args[1], call.arg_layouts[1], call.arg_node(1))
    if got.mixes:
        return Verdict(None, fix=_FIX_INDEX,
                       mixes="writes per-sample values into entries picked along the batch dimension: "
                             "samples land in each other's places")
    pos = v_lay.dim + got.ndim - v.dim()  # v broadcasts into the region, right-aligned
    if carries_batch(got.layout):
        if _at(v_lay, pos) != got.layout:
            return Verdict(None, fix=_FIX_PAIR,
                           mixes=f"writes values with the batch at dim {pos} of the written region into a "
                                 f"region with the batch at dim {got.layout.dim}: sample i's slot gets sample j's "
                                 "values")
        return Verdict(None)
    # x held no per-sample data; after the write it does, where the region maps back to x
    xd = got.region_dims[pos] if 0 <= pos < len(got.region_dims) else None
    if xd is not None and x.shape[xd] == v.shape[v_lay.dim]:
        return Verdict(None, updates_input=_at(v_lay, xd))
    return Verdict(None, updates_input=UNKNOWN_LAYOUT)


@rearranging
def _select(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    d = _norm_dim(call.arg(1, "dim"), x.dim())
    index = (slice(None),) * d + (int(call.arg(2, "index")),)
    got = index_layout(call, x, lay, index, None, None)
    return Verdict(mirror(call.out, got.layout), mixes=got.mixes, fix=_FIX_INDEX if got.mixes else "")


@rearranging
def _narrow(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    d = _norm_dim(call.arg(1, "dim"), x.dim())
    start, length = call.arg(2, "start"), call.arg(3, "length")
    if isinstance(start, torch.Tensor):
        return Verdict(UNKNOWN_LAYOUT)
    start = start + x.shape[d] if start < 0 else start
    index = (slice(None),) * d + (slice(start, start + length),)
    got = index_layout(call, x, lay, index, None, None)
    return Verdict(mirror(call.out, got.layout), mixes=got.mixes, fix=_FIX_INDEX if got.mixes else "")


def _index_select(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    d = _norm_dim(call.arg(1, "dim"), x.dim())
    index, index_lay = call.arg(2, "index"), call.layout(2, "index")
    idx = (slice(None),) * d + (index,)
    got = index_layout(call, x, lay, idx, (None,) * d + (index_lay,), (None,) * d + (call.arg_node(2, "index"),))
    return Verdict(mirror(call.out, got.layout), mixes=got.mixes, fix=_FIX_INDEX if got.mixes else "")


def _gather(call: OpCall) -> Verdict:
    """gather(x, dim, index) / take_along_dim(x, index, dim): out[i][j] = x[i][index[i][j]] for dim=1."""
    x, lay = call.args[0], call.arg_layouts[0]
    if call.op in (torch.take_along_dim, "take_along_dim"):
        index, index_lay, d = call.arg(1, "indices"), call.layout(1, "indices"), call.arg(2, "dim")
    else:
        d, index, index_lay = call.arg(1, "dim"), call.arg(2, "index"), call.layout(2, "index")
    if d is None:
        return Verdict(UNKNOWN_LAYOUT) if carries_batch(lay) else Verdict(UNBATCHED_LAYOUT)
    d = _norm_dim(d, x.dim())
    if carries_batch(lay):
        if lay.dim == d:
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT), fix=_FIX_INDEX,
                           mixes=f"gathers along the batch dimension (dim {d}): sample i receives the values "
                                 "of whichever sample the index names")
        if carries_batch(index_lay) and index_lay != lay:
            return Verdict(lay, fix=_FIX_PAIR, mixes="gathers with per-sample indices whose batch does not line up "
                                                     "with the data's: samples read each other's indices")
        if index.shape[lay.dim] != x.shape[lay.dim]:
            return Verdict(UNBATCHED_LAYOUT, fix=_FIX_INDEX,
                           mixes="gathers with an index that covers only some samples")
        return Verdict(lay)
    if carries_batch(index_lay):
        return Verdict(index_lay)
    return Verdict(UNBATCHED_LAYOUT)


def _scatter(call: OpCall) -> Verdict:
    """scatter/index_add/index_copy(x, dim, index, src): writing along the batch mixes samples."""
    x = call.args[0]
    d = _norm_dim(call.arg(1, "dim"), x.dim())
    tensors = call.operands()
    for t, tl in tensors:
        if carries_batch(tl) and tl.dim == d and t.dim() == x.dim():
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT), fix=_FIX_INDEX,
                           mixes=f"scatters along the batch dimension (dim {d}): samples are written into "
                                 "each other's places")
    found = {tl for t, tl in tensors if carries_batch(tl) and t.dim() == x.dim()}
    if len(found) > 1:
        return Verdict(UNKNOWN_LAYOUT, fix=_FIX_PAIR, mixes="scatters between tensors whose batches do not line up")
    return Verdict(mirror(call.out, next(iter(found)) if found else UNBATCHED_LAYOUT))


def _take(call: OpCall) -> Verdict:
    lay = call.arg_layouts[0]
    if carries_batch(lay):
        return Verdict(UNBATCHED_LAYOUT, fix=_FIX_INDEX,
                       mixes="indexes the flattened tensor, batch included: samples are read by position")
    index_lay = call.layout(1, "index")
    return Verdict(mirror(call.out, index_lay if carries_batch(index_lay) else UNBATCHED_LAYOUT))


def embedding_rule(call: OpCall) -> Verdict:
    """F.embedding(indices, weight) / nn.Embedding: one row per index, the batch stays with the indices."""
    lay = call.arg_layouts[0]
    if call.module is None and carries_batch(call.layout(1, "weight")):
        return Verdict(UNKNOWN_LAYOUT)
    return Verdict(mirror(call.out, lay if isinstance(lay, BatchLayout) else UNBATCHED_LAYOUT))


def embedding_bag_rule(call: OpCall) -> Verdict:
    """nn.EmbeddingBag: a 2-D input holds one bag per row; a 1-D one (packed) the bags one after another,
    each starting at its offset: one offset per sample, so the offsets carry the batch, and the output has
    one row per bag."""
    x, lay = call.args[0], call.arg_layouts[0]
    if isinstance(lay, BatchLayout) and lay.kind == PACKED:
        offsets, weights = call.layout(1, "offsets"), call.layout(2, "per_sample_weights")
        if call.module.include_last_offset:  # N + 1 offsets: no input has the N rows the graph would read
            return Verdict(UNKNOWN_LAYOUT)
        if (isinstance(offsets, BatchLayout) and offsets == BatchLayout.at(0)
                and (weights is None or weights == lay or weights.kind == UNBATCHED)):
            return Verdict(BatchLayout.at(0))
        return Verdict(UNKNOWN_LAYOUT)
    if x.dim() == 2:
        if carries_batch(lay) and lay.dim == 1:
            return Verdict(lay, fix=_FIX_LAYER, mixes="pools the bag dimension (dim 1), which is the batch dimension")
        return Verdict(lay if isinstance(lay, BatchLayout) else UNBATCHED_LAYOUT)
    return Verdict(UNKNOWN_LAYOUT) if carries_batch(lay) else Verdict(UNBATCHED_LAYOUT)


def _index_assign(call: OpCall) -> Verdict:
    """index_assign(x, index, value): ``x[index] = value`` out of place."""
    verdict = _setitem(call)
    lay = verdict.updates_input if verdict.updates_input is not None else call.arg_layouts[0]
    if not isinstance(lay, BatchLayout):
        lay = UNBATCHED_LAYOUT
    return Verdict(mirror(call.out, lay), mixes=verdict.mixes, fix=verdict.fix)


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------

register_batch_rule([operator.getitem])(_getitem)
register_batch_rule([operator.setitem])(_setitem)
register_batch_rule(_keys("select"))(_select)
register_batch_rule(_keys("narrow"))(_narrow)
register_batch_rule(_keys("index_select"))(_index_select)
register_batch_rule(_keys("gather", "take_along_dim"))(_gather)
register_batch_rule(_keys("scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill",
                          "scatter_", "scatter_add_", "scatter_reduce_", "index_add_", "index_copy_",
                          "index_fill_"))(_scatter)
register_batch_rule(_keys("take"))(_take)
register_batch_rule(_fn("embedding"))(embedding_rule)  # nn.Embedding's too: fxdp/layers/embedding.py
embedding_bag_rule.reads_packed = True  # see fxdp.layout.PACKED; nn.EmbeddingBag's rule (fxdp/layers/embedding.py)
# x[index] = value, as the inplace pass rewrites it
register_batch_rule([out_of_place.index_assign])(_index_assign)
