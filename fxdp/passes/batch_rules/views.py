"""Views and reshapes (described declaratively by dimension maps), attribute views (``x.T``), repeats,
and concatenation and splitting.

A dimension map (:class:`InputDim`, :class:`Flatten`, :class:`Split`, :class:`Singleton`,
:class:`Broadcast`) says, for each output dimension, which input dimensions it is made of, so "did
the batch move, merge or split?" is a lookup on the map (:func:`layout_through`), not a special case
per op. These ops only rearrange values: their rules are marked :func:`rearranging`, so a move that
is undone before anything computes with the values is not reported.
"""

from __future__ import annotations

import builtins
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fxdp.layout import BROADCAST, UNBATCHED_LAYOUT, UNKNOWN, UNKNOWN_LAYOUT, BatchLayout
from fxdp.passes.batch_rules.core import (
    _FIX_CAT, _FIX_INDEX, _FIX_PAIR, BatchRule, OpCall, Verdict, _at, _dims, _first_tensor, _inner, _keys,
    nn_layers, _moved, _norm_dim, _ordinal, _where, keeps_layout, mirror, carries_batch, rearranging,
    register_batch_rule,
)
from fxdp.passes.batch_rules.elementwise import _batch_size_position


# --------------------------------------------------------------------------------------------
# Views and reshapes, described by dimension maps
# --------------------------------------------------------------------------------------------
# A dimension map says, for each output dimension, which input dimensions it is made of. "Where is
# the batch after this view?" is then a lookup: the output dimension whose spec contains the batch.


class DimSpec:
    """What one output dimension of a view is made of."""


@dataclass(frozen=True)
class InputDim(DimSpec):
    dim: int


@dataclass(frozen=True)
class Singleton(DimSpec):
    """A new dimension of size 1."""


@dataclass(frozen=True)
class Broadcast(DimSpec):
    spec: DimSpec  # a size-1 dimension (or Singleton) expanded to ``size``
    size: int


@dataclass(frozen=True)
class Flatten(DimSpec):
    specs: Tuple[DimSpec, ...]  # input dimensions merged, outermost first


@dataclass(frozen=True)
class Split(DimSpec):
    spec: DimSpec  # a dimension (or a Flatten) split into ``group``; this is piece ``index``
    group: Tuple[int, ...]
    index: int


DimMap = Tuple[DimSpec, ...]


def _permutation(perm: Sequence[int]) -> DimMap:
    return tuple(InputDim(p) for p in perm)


def _swap(ndim: int, a: int, b: int) -> DimMap:
    perm = list(range(ndim))
    if ndim:
        a, b = _norm_dim(a, ndim), _norm_dim(b, ndim)
        perm[a], perm[b] = perm[b], perm[a]
    return _permutation(perm)


def reshape_map(src: Sequence[int], dst: Sequence[int]) -> Optional[DimMap]:
    """The dimension map of a row-major reshape from ``src`` to ``dst`` (None when sizes are 0)."""
    src, dst = list(src), list(dst)
    if 0 in src or 0 in dst or math.prod(src) != math.prod(dst):
        return None
    out: List[DimSpec] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            out.append(Singleton())
            j += 1
            continue
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            i += 1  # a size-1 input dimension that disappears
            continue
        ins, outs = [i], [dst[j]]
        have, want = src[i], dst[j]
        i, j = i + 1, j + 1
        while have != want:  # grow the smaller side until both groups hold the same elements
            if have < want:
                ins.append(i)
                have *= src[i]
                i += 1
            else:
                outs.append(dst[j])
                want *= dst[j]
                j += 1
        spec = InputDim(ins[0]) if len(ins) == 1 else Flatten(tuple(InputDim(k) for k in ins))
        if len(outs) == 1:
            out.append(spec)
        else:
            out.extend(Split(spec, tuple(outs), k) for k in range(len(outs)))
    return tuple(out)


def _expand_map(src: Sequence[int], dst: Sequence[int]) -> DimMap:
    shift = len(dst) - len(src)
    specs: List[DimSpec] = [Broadcast(Singleton(), dst[j]) for j in range(shift)]
    for i, size in enumerate(src):
        target = dst[i + shift]
        specs.append(InputDim(i) if size == target else Broadcast(InputDim(i), target))
    return tuple(specs)


def _spec_size(spec: DimSpec, shape) -> int:
    if isinstance(spec, InputDim):
        return shape[spec.dim]
    if isinstance(spec, Broadcast):
        return spec.size
    if isinstance(spec, Flatten):
        return math.prod(_spec_size(s, shape) for s in spec.specs)
    if isinstance(spec, Split):
        return spec.group[spec.index]
    return 1


def _locate(spec: DimSpec, shape, batch_dim: int, outer: int, inner: int, n: int):
    """If output dim ``spec`` holds the whole batch factor: its (outer, inner) there, else None.

    The batch factor of input dim ``batch_dim`` has stride ``inner`` and extent ``inner * n``
    within that dimension; a dimension built from it holds the whole factor when its stride range
    covers it exactly.
    """
    if isinstance(spec, InputDim):
        return (outer, inner) if spec.dim == batch_dim else None
    if isinstance(spec, Flatten):
        for k, sub in enumerate(spec.specs):
            found = _locate(sub, shape, batch_dim, outer, inner, n)
            if found is not None:
                left = math.prod(_spec_size(s, shape) for s in spec.specs[:k])
                right = math.prod(_spec_size(s, shape) for s in spec.specs[k + 1:])
                return found[0] * left, found[1] * right
        return None
    if isinstance(spec, Split):
        found = _locate(spec.spec, shape, batch_dim, outer, inner, n)
        if found is None:
            return None
        stride = math.prod(spec.group[spec.index + 1:])
        extent = stride * spec.group[spec.index]
        _, inn = found
        if inn % stride == 0 and extent % (inn * n) == 0:
            return extent // (inn * n), inn // stride
        return None
    return None  # Singleton, Broadcast: new or expanded size-1 dims never hold the batch


def layout_through(dim_map: Optional[DimMap], in_shape, lay, n: int):
    """The layout after a view described by ``dim_map``; UNKNOWN when the batch is split apart."""
    if not isinstance(lay, BatchLayout):
        return lay
    if lay.kind == BROADCAST:
        for j, spec in enumerate(dim_map or ()):
            if spec == InputDim(lay.dim):
                return BatchLayout.broadcast(j)
        return UNBATCHED_LAYOUT
    if not carries_batch(lay):
        return lay
    if dim_map is None:
        return UNKNOWN_LAYOUT
    inner = _inner(lay)
    outer = in_shape[lay.dim] // (n * inner)
    for j, spec in enumerate(dim_map):
        found = _locate(spec, in_shape, lay.dim, outer, inner, n)
        if found is not None:
            o, i = found
            return BatchLayout.at(j) if o == 1 and i == 1 else BatchLayout.merged(j, i)
    return UNKNOWN_LAYOUT


def _int_list(call: OpCall, start: int, name: str):
    """x.permute(0, 2, 1) / x.permute((0, 2, 1)) / torch.permute(x, dims=...)."""
    if len(call.args) > start and isinstance(call.args[start], (list, tuple, torch.Size)):
        return list(call.args[start])
    if len(call.args) > start:
        return list(call.args[start:])
    return list(call.kwargs.get(name, ()))


def _movedim_map(ndim: int, src, dst) -> DimMap:
    src = _dims(src, ndim)
    dst = _dims(dst, ndim)
    order = [-1] * ndim
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(i for i in range(ndim) if i not in src)
    return _permutation([o if o >= 0 else next(rest) for o in order])


def _squeeze_map(shape, dims) -> DimMap:
    drop = set(range(len(shape))) if dims is None else set(_dims(dims, len(shape)))
    return tuple(InputDim(i) for i, s in enumerate(shape) if not (i in drop and s == 1))


def _unsqueeze_map(ndim: int, d: int) -> DimMap:
    d = _norm_dim(d, ndim + 1)
    specs: List[DimSpec] = [InputDim(i) for i in range(ndim)]
    specs.insert(d, Singleton())
    return tuple(specs)


def _flatten_map(ndim: int, start: int, end: int) -> DimMap:
    if ndim == 0:
        return (Singleton(),)
    start, end = _norm_dim(start, ndim), _norm_dim(end, ndim)
    merged = tuple(InputDim(i) for i in range(start, end + 1))
    middle = [merged[0]] if len(merged) == 1 else [Flatten(merged)]
    return tuple([InputDim(i) for i in range(start)] + middle + [InputDim(i) for i in range(end + 1, ndim)])


def _out_shape(call):
    return tuple(_first_tensor(call.out).shape)


# op name -> (call, input shape) -> DimMap. One declarative table for every view op.
_VIEW_MAPS: Dict[str, Callable[[OpCall, tuple], Optional[DimMap]]] = {
    "transpose": lambda c, s: _swap(len(s), c.arg(1, "dim0"), c.arg(2, "dim1")),
    "swapaxes": lambda c, s: _swap(len(s), c.arg(1, "axis0", "dim0"), c.arg(2, "axis1", "dim1")),
    "swapdims": lambda c, s: _swap(len(s), c.arg(1, "dim0"), c.arg(2, "dim1")),
    "t": lambda c, s: _swap(len(s), 0, -1) if len(s) == 2 else _permutation(range(len(s))),
    "T": lambda c, s: _permutation(reversed(range(len(s)))),
    "H": lambda c, s: _permutation(reversed(range(len(s)))),
    "mT": lambda c, s: _swap(len(s), -2, -1),
    "mH": lambda c, s: _swap(len(s), -2, -1),
    "adjoint": lambda c, s: _swap(len(s), -2, -1),
    "permute": lambda c, s: _permutation([_norm_dim(d, len(s)) for d in _int_list(c, 1, "dims")]),
    "movedim": lambda c, s: _movedim_map(len(s), c.arg(1, "source"), c.arg(2, "destination")),
    "moveaxis": lambda c, s: _movedim_map(len(s), c.arg(1, "source"), c.arg(2, "destination")),
    "unsqueeze": lambda c, s: _unsqueeze_map(len(s), c.arg(1, "dim")),
    "squeeze": lambda c, s: _squeeze_map(s, c.arg(1, "dim")),
    "flatten": lambda c, s: _flatten_map(len(s), c.arg(1, "start_dim", default=0), c.arg(2, "end_dim", default=-1)),
    "ravel": lambda c, s: _flatten_map(len(s), 0, -1),
    "unflatten": lambda c, s: reshape_map(s, _out_shape(c)),
    "view": lambda c, s: reshape_map(s, _out_shape(c)),
    "reshape": lambda c, s: reshape_map(s, _out_shape(c)),
    "view_as": lambda c, s: reshape_map(s, _out_shape(c)),
    "reshape_as": lambda c, s: reshape_map(s, _out_shape(c)),
    "expand": lambda c, s: _expand_map(s, _out_shape(c)),
    "expand_as": lambda c, s: _expand_map(s, _out_shape(c)),
    "broadcast_to": lambda c, s: _expand_map(s, _out_shape(c)),
}


def view(kind: str) -> BatchRule:
    """The rule of one view op: look the batch up in the op's dimension map."""
    build = _VIEW_MAPS[kind]

    def rule(call: OpCall) -> Verdict:
        x, lay = call.args[0], call.arg_layouts[0]
        out = _first_tensor(call.out)
        if out is None:
            return Verdict(None)
        in_shape = tuple(x.shape)
        if kind in ("expand", "broadcast_to") and not carries_batch(lay):
            # shared values given to every sample (`cls.expand(x.size(0), -1, -1)`,
            # `arange(T).expand(N, T)`): each sample gets its own copy, so later ops keep them apart
            position = _batch_size_position(call, 1)
            if position is not None:
                return Verdict(mirror(call.out, BatchLayout.at(position)))
        after = layout_through(build(call, in_shape), in_shape, lay, call.batch_size)
        if carries_batch(lay) and after.kind == UNKNOWN:
            return Verdict(UNKNOWN_LAYOUT, fix=_FIX_SPLIT,
                           moves=f"splits the batch dimension ({_where(lay)}) across several "
                                 f"dimensions (shape {in_shape} -> {tuple(out.shape)}); fxdp cannot follow "
                                 "the batch after it")
        return _moved(call, lay, after, in_shape, out.shape)

    return rearranging(rule)


_FIX_SPLIT = ("Keep each sample's values together: reshape only per-sample dimensions "
              "(e.g. x.view(N, -1) with N = x.size(0)).")


@rearranging
def _flatten_module(call: OpCall) -> Verdict:
    m = call.module
    x, lay = call.args[0], call.arg_layouts[0]
    dim_map = _flatten_map(x.dim(), m.start_dim, m.end_dim)
    after = layout_through(dim_map, tuple(x.shape), lay, call.batch_size)
    return _moved(call, lay, after, x.shape, call.out.shape)


@rearranging
def _unflatten_module(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    after = layout_through(reshape_map(x.shape, call.out.shape), tuple(x.shape), lay, call.batch_size)
    return _moved(call, lay, after, x.shape, call.out.shape)


@rearranging
def _repeat(call: OpCall) -> Verdict:
    """x.repeat(r0, r1, ...) / torch.tile: repeating along the batch merges copies into it."""
    x, lay = call.args[0], call.arg_layouts[0]
    reps = _int_list(call, 1, "dims" if call.op is torch.tile else "repeats")
    if call.op in (torch.tile, "tile") and len(reps) < x.dim():
        reps = [1] * (x.dim() - len(reps)) + reps
    if not carries_batch(lay):
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT if lay is None or lay.kind != BROADCAST else lay))
    pos = lay.dim + len(reps) - x.dim()
    after = _at(lay, pos) if reps[pos] == 1 else BatchLayout.merged(pos, _inner(lay))
    return _moved(call, lay, after, x.shape, call.out.shape)


@rearranging
def _repeat_interleave(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    repeats = call.arg(1, "repeats")
    d = call.arg(2, "dim")
    if not carries_batch(lay):
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    if not isinstance(repeats, int):
        return Verdict(UNKNOWN_LAYOUT)
    if d is None:  # works on the flattened tensor
        inner = _inner(lay) * math.prod(x.shape[lay.dim + 1:]) * repeats
        return _moved(call, lay, BatchLayout.merged(0, inner), x.shape, call.out.shape)
    if _norm_dim(d, x.dim()) != lay.dim:
        return Verdict(lay)
    return _moved(call, lay, BatchLayout.merged(lay.dim, _inner(lay) * repeats), x.shape, call.out.shape)


# --------------------------------------------------------------------------------------------
# Concatenation and splitting
# --------------------------------------------------------------------------------------------


@rearranging
def _cat(call: OpCall) -> Verdict:
    tensors = list(call.arg(0, "tensors", default=()))
    layouts = list(call.layout(0, "tensors") or [None] * len(tensors))
    out = call.out
    d = _norm_dim(call.arg(1, "dim", "axis", default=0), out.dim())
    batched = [(i, lay) for i, lay in enumerate(layouts) if carries_batch(lay)]
    if not batched:
        return Verdict(UNBATCHED_LAYOUT)
    along = [(i, lay) for i, lay in batched if lay.dim == d]
    if along:
        for i, (t, lay) in enumerate(zip(tensors, layouts)):
            if t.numel() == 0:
                continue
            if not carries_batch(lay):
                return Verdict(UNKNOWN_LAYOUT, fix=_FIX_CAT,
                               mixes=f"concatenates along the batch dimension (dim {d}) with its "
                                     f"{_ordinal(i)} tensor, which is not per-sample ({lay}): the result no "
                                     "longer holds one block of rows per sample")
            if lay.dim != d or _inner(lay) != _inner(along[0][1]):
                return Verdict(UNKNOWN_LAYOUT, fix=_FIX_PAIR,
                               mixes=f"concatenates tensors whose batches sit differently ({along[0][1]} and {lay}) "
                                     "along the batch dimension: rows of different samples interleave")
        first = along[0][1]
        after = first if len(tensors) == 1 else BatchLayout.merged(d, _inner(first))
        return _moved(call, first, after, tensors[along[0][0]].shape, out.shape)
    first = batched[0][1]
    for i, lay in batched[1:]:
        if lay != first:
            return Verdict(first, fix=_FIX_PAIR,
                           mixes=f"concatenates tensors whose batches sit in different places ({first} and {lay}): "
                                 "sample i's values are joined with sample j's")
    return Verdict(first)


@rearranging
def _stack(call: OpCall) -> Verdict:
    tensors = list(call.arg(0, "tensors", default=()))
    layouts = list(call.layout(0, "tensors") or [None] * len(tensors))
    out = call.out
    d = _norm_dim(call.arg(1, "dim", default=0), out.dim())
    batched = [lay for lay in layouts if carries_batch(lay)]
    if not batched:
        return Verdict(UNBATCHED_LAYOUT)
    first = batched[0]
    for lay in batched[1:]:
        if lay != first:
            return Verdict(UNKNOWN_LAYOUT, fix=_FIX_PAIR,
                           mixes=f"stacks tensors whose batches sit in different places ({first} and {lay}): "
                                 "sample i's values are joined with sample j's")
    after = _at(first, first.dim if first.dim < d else first.dim + 1)
    return _moved(call, first, after, tensors[0].shape, out.shape)


def _split(dim_pos: int, removes_dim: bool = False) -> BatchRule:
    """split/chunk/tensor_split (pieces along ``dim``) and unbind (removes ``dim``)."""

    def rule(call: OpCall) -> Verdict:
        x, lay = call.args[0], call.arg_layouts[0]
        pieces = list(call.out)
        d = _norm_dim(call.arg(dim_pos, "dim", default=0), x.dim())
        if not carries_batch(lay):
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT if lay is None or lay.kind != BROADCAST or
                                  lay.dim == d else lay))
        if lay.dim != d:
            new = _at(lay, lay.dim - 1 if removes_dim and d < lay.dim else lay.dim)
            return Verdict(mirror(call.out, new))
        block = call.batch_size * _inner(lay)
        sizes = [] if removes_dim else [p.shape[d] for p in pieces]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        if removes_dim or any(s % block or o % block for s, o in zip(sizes, offsets)):
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT), fix=_FIX_INDEX,
                           mixes=f"splits the batch dimension ({_where(lay)}) into groups of samples by "
                                 "position: what follows can combine them")
        after = tuple(BatchLayout.at(d) if s == call.batch_size and _inner(lay) == 1
                      else BatchLayout.merged(d, _inner(lay)) for s in sizes)
        verdict = _moved(call, lay, after[0], x.shape, pieces[0].shape)
        return Verdict(after, moves=verdict.moves, fix=verdict.fix)

    return rearranging(rule)


# --------------------------------------------------------------------------------------------
# Attribute access (x.T, x.mT, x.data)
# --------------------------------------------------------------------------------------------

_VIEW_ATTRS = {name: view(name) for name in ("T", "mT", "H", "mH")}


@rearranging
def _getattr(call: OpCall) -> Verdict:
    attr = call.args[1]
    if attr in _VIEW_ATTRS:
        return _VIEW_ATTRS[attr](call)
    if attr in ("data", "real", "imag"):
        return keeps_layout(call)
    return Verdict(mirror(call.out, UNKNOWN_LAYOUT))


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------

# views and reshapes: one dimension map per op
for _kind in _VIEW_MAPS:
    register_batch_rule(_keys(_kind, methods=True))(view(_kind))
register_batch_rule([builtins.getattr])(_getattr)
register_batch_rule(nn_layers("Flatten"))(_flatten_module)
register_batch_rule(nn_layers("Unflatten"))(_unflatten_module)
register_batch_rule(_keys("repeat", "tile"))(_repeat)
register_batch_rule(_keys("repeat_interleave"))(_repeat_interleave)
# concatenation and splitting
register_batch_rule(_keys("cat", "concat", "concatenate", methods=False))(_cat)
register_batch_rule(_keys("stack", methods=False))(_stack)
register_batch_rule(_keys("split", "chunk", "tensor_split", "split_with_sizes"))(_split(2))
register_batch_rule(_keys("unbind"))(_split(1, removes_dim=True))
