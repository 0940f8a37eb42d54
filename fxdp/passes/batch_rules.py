"""Batch rules: for one op, where the batch dimension of its output is, and whether it mixes samples.

One registry, keyed by the op the graph calls:

- torch functions (``torch.sum``, ``F.softmax``), ``operator.*`` functions and ``getattr`` (``x.T``);
- Tensor method names, as strings (``"transpose"``), the way ``call_method`` nodes name them;
- ``nn.Module`` types for the layers the graph calls whole; lookup walks the class's MRO, so a
  subclass of ``nn.Linear`` uses the Linear rule.

Every rule has one signature, ``rule(call: OpCall) -> Verdict``: it looks at the op's fake inputs,
their layouts (:class:`fxdp.layout.BatchLayout`) and its fake output, and says where the batch is
in the output, whether the op lets samples influence each other (``mixes``) and whether it moved
the batch (``moves``). Nothing real is computed. A missing rule is not a guess: the pass reports
the op as unverified (or raises in strict mode).

Ops come in families, each registered in one line near the end of this file: elementwise and
broadcasting, reductions, ops along a dimension (softmax, cumsum, sort, ...), views and reshapes
(described declaratively by dimension maps, so "did the batch move, merge or split?" is a lookup),
contractions (matmul, einsum, linear, attention), indexing, concatenation and splitting,
convolution, pooling and normalisation, losses, and layers treated whole.

Register your own rule with :func:`register_batch_rule`::

    @register_batch_rule(MyLayer)            # or a list of ops, a torch function, a method name
    def my_layer_rule(call):
        return batch_rules.keeps_layout(call)   # "treats samples independently, batch stays put"
"""

from __future__ import annotations

import builtins
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxdp.passes import inplace as _inplace
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.layout import (
    BATCHED,
    BROADCAST,
    MERGED,
    UNBATCHED_LAYOUT,
    UNKNOWN,
    UNKNOWN_LAYOUT,
    BatchLayout,
)

# --------------------------------------------------------------------------------------------
# What a rule sees and what it returns
# --------------------------------------------------------------------------------------------


@dataclass
class Facts:
    """What the pass knows about values that carry no layout themselves (ints, sizes)."""

    batch_size: Set[torch.fx.Node] = field(default_factory=set)  # ints equal to N, from x.size(b)
    sample_index: Set[torch.fx.Node] = field(default_factory=set)  # torch.arange(N) and its views
    shapes: Dict[torch.fx.Node, BatchLayout] = field(default_factory=dict)  # x.shape -> x's layout


@dataclass
class OpCall:
    """One call of an op, on fake tensors: everything a rule may look at."""

    op: Any  # torch function, Tensor method name, operator function, or the module instance
    args: tuple  # fake values; for methods args[0] is the tensor, for modules the module is not here
    kwargs: dict
    arg_layouts: tuple  # like args, with a BatchLayout where args holds a tensor, None elsewhere
    kwarg_layouts: dict
    out: Any  # the fake output
    batch_size: int  # N
    home: BatchLayout  # where the batch sits in the model's inputs
    node: Optional[torch.fx.Node] = None
    facts: Facts = field(default_factory=Facts)

    @property
    def name(self) -> str:
        return op_name(self.op)

    @property
    def module(self) -> Optional[nn.Module]:
        return self.op if isinstance(self.op, nn.Module) else None

    def arg(self, index: Optional[int], *names: str, default: Any = None) -> Any:
        """Argument by position or keyword name."""
        if index is not None and index < len(self.args):
            return self.args[index]
        for name in names:
            if name in self.kwargs:
                return self.kwargs[name]
        return default

    def layout(self, index: Optional[int], *names: str) -> Any:
        """Layout of the argument at ``index`` (or keyword ``names``)."""
        if index is not None and index < len(self.arg_layouts):
            return self.arg_layouts[index]
        for name in names:
            if name in self.kwarg_layouts:
                return self.kwarg_layouts[name]
        return None

    def arg_node(self, index: Optional[int], *names: str) -> Any:
        """The graph node (or constant) passed at ``index`` / ``names``, for facts lookups."""
        if self.node is None:
            return None
        if index is not None and index < len(self.node.args):
            return self.node.args[index]
        for name in names:
            if name in self.node.kwargs:
                return self.node.kwargs[name]
        return None

    def operands(self) -> List[Tuple[torch.Tensor, BatchLayout]]:
        """Every tensor argument (nested lists included) with its layout; ``out=`` excluded."""
        pairs = list(_tensor_pairs(self.args, self.arg_layouts))
        for key, value in self.kwargs.items():
            if key != "out":
                pairs.extend(_tensor_pairs(value, self.kwarg_layouts.get(key)))
        return pairs

    def is_batch_size(self, node: Any) -> bool:
        return isinstance(node, torch.fx.Node) and node in self.facts.batch_size

    def is_sample_index(self, node: Any) -> bool:
        return isinstance(node, torch.fx.Node) and node in self.facts.sample_index


@dataclass(frozen=True)
class Verdict:
    """What a rule concludes about one call."""

    layout: Any  # BatchLayout, a tuple of them for tuple outputs, None for non-tensors
    mixes: str = ""  # plain words: how the op lets samples influence each other ("" if it does not)
    moves: str = ""  # plain words: how the op moved the batch ("" if it stayed put)
    fix: str = ""
    updates_input: Any = None  # for writes (x[i] = v): the written tensor's layout afterwards


BatchRule = Callable[[OpCall], Verdict]

# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

_RULES: Dict[Any, BatchRule] = {}
_NAMES: Dict[Any, str] = {}  # display names of registered torch functions ("torch.sum", "F.softmax")


def register_batch_rule(ops):
    """Decorator: register ``rule(call) -> Verdict`` for one op or a list of ops (the last wins).

    An op is a torch function, an ``operator`` function, a Tensor method name (``"transpose"``),
    or an ``nn.Module`` type (lookup walks the MRO, so subclasses share it).
    """
    targets = list(ops) if isinstance(ops, (list, tuple, set, frozenset)) else [ops]

    def decorator(rule: BatchRule) -> BatchRule:
        for op in targets:
            _RULES[op] = rule
        return rule

    return decorator


def find_batch_rule(op) -> Optional[BatchRule]:
    """The rule for an op (a module instance or type walks its MRO); ``None`` if there is none."""
    if isinstance(op, nn.Module):
        op = type(op)
    if isinstance(op, type):
        for klass in op.__mro__:
            rule = _RULES.get(klass)
            if rule is not None:
                return rule
        if find_grad_sampler(op) is not None:
            return _registered_layer
        return None
    try:
        return _RULES.get(op)
    except TypeError:  # an unhashable target cannot have a rule
        return None


def op_name(op) -> str:
    """How findings name an op: ``transpose``, ``torch.sum``, ``F.softmax``, ``nn.BatchNorm1d``."""
    if isinstance(op, nn.Module):
        op = type(op)
    if isinstance(op, type):
        return f"nn.{op.__name__}" if op.__module__.startswith("torch.nn") else op.__name__
    if isinstance(op, str):
        return op
    try:
        known = _NAMES.get(op)
    except TypeError:
        known = None
    if known:
        return known
    name = getattr(op, "__name__", None) or repr(op)
    module = getattr(op, "__module__", None) or ""
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch.nn.functional") or module == "torch._C._nn":
        return f"F.{name}"
    if module.startswith("torch._C._"):  # torch._C._special.special_erf -> torch.special.erf
        sub = module[len("torch._C._"):]
        return f"torch.{sub}.{name[len(sub) + 1:] if name.startswith(sub + '_') else name}"
    if module.startswith("torch"):
        return f"torch.{name}"
    if module == "builtins":
        return name
    return f"{module}.{name}" if module else name


def _keys(*names: str, methods: bool = True, functional: bool = False, namespaces=(torch,)) -> list:
    """Registry keys for ops by name: the torch function(s), the Tensor method, F.<name>."""
    keys = []
    for name in names:
        if methods and hasattr(torch.Tensor, name):
            keys.append(name)  # call_method target
            keys.append(getattr(torch.Tensor, name))  # torch.Tensor.add(x, y) as a function
        for ns in namespaces:
            fn = getattr(ns, name, None)
            if fn is not None and callable(fn):
                keys.append(fn)
                _name_once(fn, f"{ns.__name__}.{name}")
        if functional and getattr(F, name, None) is not None:
            keys.append(getattr(F, name))
            _name_once(getattr(F, name), f"F.{name}")
    return keys


def _name_once(fn, display: str) -> None:
    try:
        _NAMES.setdefault(fn, display)
    except TypeError:
        pass


def _fn(*names: str) -> list:
    """torch.nn.functional functions by name (the ones this torch version has)."""
    return _keys(*names, methods=False, functional=True, namespaces=())


def _modules(*names: str) -> list:
    """torch.nn layer types by name (the ones this torch version has)."""
    return [getattr(nn, n) for n in names if isinstance(getattr(nn, n, None), type)]


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def per_sample(layout) -> bool:
    """True for a layout that carries per-sample data (batched or merged)."""
    return isinstance(layout, BatchLayout) and layout.is_batched


def _tensor_pairs(value, layout) -> Iterator[Tuple[torch.Tensor, Any]]:
    if isinstance(value, torch.Tensor):
        yield value, layout
    elif isinstance(value, (list, tuple)):
        layouts = layout if isinstance(layout, (list, tuple)) else [None] * len(value)
        for v, lay in zip(value, layouts):
            yield from _tensor_pairs(v, lay)
    elif isinstance(value, dict):
        layouts = layout if isinstance(layout, dict) else {}
        for k, v in value.items():
            yield from _tensor_pairs(v, layouts.get(k))


def mirror(out, layout):
    """``layout`` for every tensor in ``out`` (tuples mirrored), None for everything else."""
    if isinstance(out, torch.Tensor):
        return layout
    if isinstance(out, (list, tuple)):
        return tuple(mirror(o, layout) for o in out)
    return None


def _first_tensor(value) -> Optional[torch.Tensor]:
    for t, _ in _tensor_pairs(value, None):
        return t
    return None


def _norm_dim(d: int, ndim: int) -> int:
    n = max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"dimension {d} out of range for a tensor with {ndim} dimensions")
    return d + n if d < 0 else d


def _dims(value, ndim: int) -> Tuple[int, ...]:
    if isinstance(value, (list, tuple, torch.Size)):
        return tuple(_norm_dim(int(d), ndim) for d in value)
    return (_norm_dim(int(value), ndim),)


def _at(kind_of: BatchLayout, dim: int) -> BatchLayout:
    """``kind_of``'s kind (and merged factor) at another dimension."""
    return BatchLayout(kind_of.kind, dim, kind_of.inner)


def _inner(layout: BatchLayout) -> int:
    return layout.inner if layout.kind == MERGED else 1


def _where(layout: BatchLayout) -> str:
    if layout.kind == MERGED:
        return f"dim {layout.dim}, where the batch is merged with other dimensions"
    return f"dim {layout.dim}"


def _ordinal(i: int) -> str:
    return ["first", "second", "third", "fourth", "fifth"][i] if i < 5 else f"#{i + 1}"


def rearranging(rule: BatchRule) -> BatchRule:
    """Mark a rule whose op only rearranges values (views, indexing, concatenation, copies).

    A batch move is reported when a value whose batch was moved reaches an op that computes with it;
    a move that is undone by further rearranging before that (permute, then permute back) is not.
    """
    rule.rearranges = True  # type: ignore[attr-defined]
    return rule


def keeps_layout(call: OpCall) -> Verdict:
    """The output has the batch where the first tensor argument has it (samples stay apart)."""
    for t, lay in call.operands():
        return Verdict(mirror(call.out, lay if isinstance(lay, BatchLayout) else UNBATCHED_LAYOUT))
    return Verdict(mirror(call.out, UNBATCHED_LAYOUT))


def _moved(call: OpCall, before: BatchLayout, after: BatchLayout, in_shape, out_shape, fix: str = "") -> Verdict:
    """A verdict for a layout change: a finding only when the batch changed place and is not home."""
    layout = mirror(call.out, after)
    if not (per_sample(before) and per_sample(after)) or after == before or after == call.home:
        return Verdict(layout)
    shapes = f"(shape {tuple(in_shape)} -> {tuple(out_shape)})"
    if before.kind == BATCHED and after.kind == BATCHED:
        how = f"moves the batch from dim {before.dim} to dim {after.dim} {shapes}"
    elif after.kind == MERGED and before.kind == BATCHED:
        how = (f"merges the batch (dim {before.dim}) with other dimensions into dim {after.dim} "
               f"{shapes}; each sample now spans {after.inner} consecutive entries there")
    elif before.kind == MERGED and after.kind == BATCHED:
        how = f"splits the batch out of merged dim {before.dim} into dim {after.dim} {shapes}"
    else:
        how = f"regroups the batch: {before} -> {after} {shapes}"
    return Verdict(layout, moves=how, fix=fix or _FIX_MOVE.format(home=call.home.dim))


# --------------------------------------------------------------------------------------------
# Fix texts (shown to the user next to each finding)
# --------------------------------------------------------------------------------------------

_FIX_MOVE = (
    "Nothing to do for fxdp: it follows the batch and computes per-sample gradients from the "
    "recorded layout. Code that assumes the batch at dim {home} (hook-based per-sample gradients) "
    "would be wrong after this op; move the batch back before layers with parameters if you use it."
)
_FIX_REDUCE = (
    "Reduce over a per-sample dimension (e.g. dim=-1). If this is the loss, return per-sample "
    "outputs and compute the loss outside the model. Batch statistics cannot be private: use "
    "per-sample ones (LayerNorm, GroupNorm)."
)
_FIX_ALONG = "Apply it along a per-sample dimension (e.g. dim=-1), never across the batch."
_FIX_CONTRACT = (
    "Contract a per-sample dimension instead: keep the batch index in the output of matmul/einsum "
    "(e.g. 'nd,de->ne'), and move the batch out of a layer's feature dimension before the layer."
)
_FIX_PAIR = (
    "Combine each sample only with itself or with tensors that are not per-sample (parameters, "
    "constants); align the batch dimensions of both operands."
)
_FIX_INDEX = (
    "Index a per-sample dimension (x[:, i]); to pick an entry per sample use "
    "x[torch.arange(N), idx] or torch.gather along a per-sample dimension."
)
_FIX_CAT = (
    "Concatenate along a feature dimension, or expand the shared tensor to every sample first "
    "(t.expand(N, ...)) and concatenate along dim 1."
)
_FIX_BATCHNORM = (
    "Replace BatchNorm with GroupNorm or LayerNorm (fxdp.validators.ModuleValidator.fix does "
    "it), or use running statistics only (model.eval())."
)
_FIX_LAYER = "Move the batch back to the dimension the layer treats as the batch (dim 0) before it."
_FIX_LOSS = "Compute the loss outside the model, or use reduction='none' inside it."

# --------------------------------------------------------------------------------------------
# Elementwise and broadcasting
# --------------------------------------------------------------------------------------------


def _combine(operands, ndim: int):
    """Layouts of broadcasting operands aligned to an ``ndim`` output: (layout, conflict message)."""
    found: Dict[BatchLayout, int] = {}
    broadcast = None
    for i, (t, lay) in enumerate(operands):
        if not isinstance(lay, BatchLayout):
            continue
        shift = ndim - t.dim()
        if per_sample(lay):
            found.setdefault(_at(lay, lay.dim + shift), i)
        elif lay.kind == BROADCAST and broadcast is None:
            broadcast = lay.dim + shift
    if len(found) > 1:
        (a, i), (b, j) = list(found.items())[:2]
        return a, (f"combines its {_ordinal(i)} operand, with the batch at output dim {a.dim}, and its "
                   f"{_ordinal(j)}, with the batch at output dim {b.dim}: sample i meets sample j's values")
    if found:
        return next(iter(found)), ""
    if broadcast is not None:
        return BatchLayout.broadcast(broadcast), ""
    return UNBATCHED_LAYOUT, ""


def elementwise(call: OpCall) -> Verdict:
    """Elementwise ops with broadcasting: the batch keeps its (right-aligned) place."""
    out = _first_tensor(call.out)
    if out is None:
        return Verdict(None)
    layout, conflict = _combine(call.operands(), out.dim())
    if layout.kind == BROADCAST and not (layout.dim < out.dim() and out.shape[layout.dim] == 1):
        layout = UNBATCHED_LAYOUT
    if conflict:
        return Verdict(mirror(call.out, layout), mixes=conflict, fix=_FIX_PAIR)
    return Verdict(mirror(call.out, layout))


def _batch_size_position(call: OpCall, start: int) -> Optional[int]:
    """Where the size arguments (``op(..., N, d)`` or ``op(..., (N, d))``) name the batch size ``x.size(b)``."""
    node_args = call.node.args[start:] if call.node is not None else ()
    sizes = next((list(a) for a in node_args if isinstance(a, (list, tuple))), None)
    if sizes is None:
        sizes = [a for a in node_args if isinstance(a, (int, torch.fx.Node))]
    hits = [j for j, s in enumerate(sizes) if call.is_batch_size(s)]
    return hits[0] if len(hits) == 1 else None


def _factory(call: OpCall) -> Verdict:
    """torch.zeros(N, d), x.new_zeros(x.size(0), d), ...: batched where a size is the batch size."""
    start = 1 if isinstance(call.op, str) or call.op in _NEW_METHODS else 0
    for a in (call.node.args[start:] if call.node is not None else ()):
        if isinstance(a, torch.fx.Node) and a in call.facts.shapes:  # x.new_zeros(x.shape)
            like = call.facts.shapes[a]
            return Verdict(mirror(call.out, like if per_sample(like) else UNBATCHED_LAYOUT))
    position = _batch_size_position(call, start)
    return Verdict(mirror(call.out, UNBATCHED_LAYOUT if position is None else BatchLayout.at(position)))


def _arange(call: OpCall) -> Verdict:
    """torch.arange(N) with N = x.size(b) is each sample's own index: batched, and an identity index."""
    if call.node is not None and call.node in call.facts.sample_index:
        return Verdict(BatchLayout.at(0))
    return Verdict(UNBATCHED_LAYOUT)


def _constant(call: OpCall) -> Verdict:
    return Verdict(mirror(call.out, UNBATCHED_LAYOUT))


# --------------------------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------------------------


def reduction(dim_pos: Optional[int] = 1, names: Sequence[str] = ("dim", "axis"), default=None) -> BatchRule:
    """Ops that reduce ``dim`` (all dims when it is None): reducing the batch mixes samples."""

    def rule(call: OpCall) -> Verdict:
        x, lay = call.args[0], call.arg_layouts[0]
        d = call.arg(dim_pos, *names, default=default)
        if isinstance(d, torch.Tensor):  # torch.max(a, b): elementwise
            return elementwise(call)
        if isinstance(d, bool):  # legacy x.std(True): unbiased, not a dim
            d = default
        out = _first_tensor(call.out)
        return _reduce(call, x, lay, None if d is None else _dims(d, x.dim()), out)

    return rule


def _reduce(call: OpCall, x: torch.Tensor, lay, dims, out) -> Verdict:
    ndim = x.dim()
    reduced = tuple(range(ndim)) if dims is None or (len(dims) == 0 and ndim > 0) else dims
    keepdim = out is not None and out.dim() == ndim
    if not isinstance(lay, BatchLayout) or lay.kind not in (BATCHED, MERGED, BROADCAST):
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    if lay.dim in reduced:
        if per_sample(lay):
            what = ("reduces over every dimension, the batch included" if set(reduced) == set(range(ndim))
                    else f"reduces over the batch dimension ({_where(lay)})")
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT),
                           mixes=f"{what}: the result combines all samples", fix=_FIX_REDUCE)
        if not keepdim:
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    new = lay.dim if keepdim else lay.dim - sum(1 for r in set(reduced) if r < lay.dim)
    return Verdict(mirror(call.out, _at(lay, new)))


def _binary_reduction(dim_pos: Optional[int], default) -> BatchRule:
    """cosine_similarity(x1, x2, dim), pairwise_distance, dist: broadcast, then reduce ``dim``."""

    def rule(call: OpCall) -> Verdict:
        pairs = call.operands()[:2]
        ndim = max(t.dim() for t, _ in pairs)
        lay, conflict = _combine(pairs, ndim)
        if conflict:
            return Verdict(mirror(call.out, lay), mixes=conflict, fix=_FIX_PAIR)
        d = default if dim_pos is None else call.arg(dim_pos, "dim", default=default)
        shape = torch.broadcast_shapes(*(t.shape for t, _ in pairs))
        proxy = torch.empty(shape, device="meta")
        return _reduce(call, proxy, lay, None if d is None else _dims(d, ndim), _first_tensor(call.out))

    return rule


def _module_reduction(call: OpCall) -> Verdict:
    """nn.CosineSimilarity(dim), nn.PairwiseDistance (last dim)."""
    m = call.module
    dim = getattr(m, "dim", -1)
    pairs = call.operands()[:2]
    ndim = max(t.dim() for t, _ in pairs)
    lay, conflict = _combine(pairs, ndim)
    if conflict:
        return Verdict(mirror(call.out, lay), mixes=conflict, fix=_FIX_PAIR)
    proxy = torch.empty(torch.broadcast_shapes(*(t.shape for t, _ in pairs)), device="meta")
    return _reduce(call, proxy, lay, _dims(dim, ndim), _first_tensor(call.out))


# --------------------------------------------------------------------------------------------
# Ops along a dimension (softmax, cumsum, sort, topk, roll, flip, normalize, ...)
# --------------------------------------------------------------------------------------------


def _softmax_default_dim(ndim: int) -> int:
    # the implicit dim of F.softmax(x) without dim= (deprecated, still accepted)
    return 0 if ndim in (0, 1, 3) else 1


def along(dim_pos: Optional[int], names: Sequence[str] = ("dim",), default: Any = -1,
          varargs: bool = False, fix: str = _FIX_ALONG) -> BatchRule:
    """Ops that work along ``dim`` (one or several) and keep the others apart.

    ``default`` may be a callable ``ndim -> dims``; ``"all"`` means the op works on the flattened
    tensor (``roll`` without dims). ``varargs``: ``x.flip(0, 1)`` passes the dims as *args.
    """

    def rule(call: OpCall) -> Verdict:
        x, lay = call.args[0], call.arg_layouts[0]
        if varargs and dim_pos is not None and len(call.args) > dim_pos + 1:
            d = tuple(call.args[dim_pos:])
        else:
            d = call.arg(dim_pos, *names, default=None)
        if d is None:  # F.softmax(x, dim=None) means the implicit dim, not every dim
            d = default
        if callable(d):
            d = d(x.dim())
        dims = tuple(range(x.dim())) if d is None or d == "all" else _dims(d, x.dim())
        return along_dims(call, lay, dims, fix)

    return rule


def along_dims(call: OpCall, lay, dims: Iterable[int], fix: str = _FIX_ALONG) -> Verdict:
    if per_sample(lay) and lay.dim in tuple(dims):
        return Verdict(mirror(call.out, lay), fix=fix,
                       mixes=f"works along the batch dimension ({_where(lay)}): each sample's result "
                             "depends on the other samples")
    if isinstance(lay, BatchLayout) and lay.kind in (BATCHED, MERGED, BROADCAST):
        return Verdict(mirror(call.out, lay))
    return Verdict(mirror(call.out, UNBATCHED_LAYOUT))


def _module_along(attr: str, default) -> BatchRule:
    """nn.Softmax(dim), nn.GLU(dim), nn.Softmax2d (dim -3)."""

    def rule(call: OpCall) -> Verdict:
        x, lay = call.args[0], call.arg_layouts[0]
        d = getattr(call.module, attr, default) if attr else default
        if d is None:
            d = _softmax_default_dim(x.dim())
        return along_dims(call, lay, _dims(d, x.dim()))

    return rule


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
    if not per_sample(lay):
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
        if kind in ("expand", "broadcast_to") and not per_sample(lay):
            # shared values given to every sample (`cls.expand(x.size(0), -1, -1)`,
            # `arange(T).expand(N, T)`): each sample gets its own copy, so later ops keep them apart
            position = _batch_size_position(call, 1)
            if position is not None:
                return Verdict(mirror(call.out, BatchLayout.at(position)))
        after = layout_through(build(call, in_shape), in_shape, lay, call.batch_size)
        if per_sample(lay) and after.kind == UNKNOWN:
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
    if not per_sample(lay):
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT if lay is None or lay.kind != BROADCAST else lay))
    pos = lay.dim + len(reps) - x.dim()
    after = _at(lay, pos) if reps[pos] == 1 else BatchLayout.merged(pos, _inner(lay))
    return _moved(call, lay, after, x.shape, call.out.shape)


@rearranging
def _repeat_interleave(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    repeats = call.arg(1, "repeats")
    d = call.arg(2, "dim")
    if not per_sample(lay):
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
# Contractions: matmul, einsum, linear, attention — labelled like einsum, checked in one place
# --------------------------------------------------------------------------------------------

Labels = Tuple[Any, ...]


def contraction(labeller: Callable[[OpCall], Optional[Tuple[List[Tuple[torch.Tensor, Any, Labels]], Labels]]]) -> BatchRule:
    """Ops that multiply and sum like einsum. ``labeller`` gives each operand's and the output's labels.

    The batch label of every per-sample operand must survive in the output (otherwise the op sums
    over samples) and be the same label for all of them (otherwise it pairs every sample with every
    other).
    """

    def rule(call: OpCall) -> Verdict:
        spec = labeller(call)
        if spec is None:
            return Verdict(mirror(call.out, UNKNOWN_LAYOUT))
        operands, out_labels = spec
        batch = None
        for k, (t, lay, labels) in enumerate(operands):
            if not per_sample(lay):
                continue
            label = labels[lay.dim]
            if label not in out_labels:
                return Verdict(mirror(call.out, UNBATCHED_LAYOUT), fix=_FIX_CONTRACT,
                               mixes=f"sums over dim {lay.dim} of its {_ordinal(k)} operand, which is the "
                                     "batch dimension: every output entry combines all samples")
            here = (label, lay.kind, lay.inner, k, lay.dim)
            if batch is None:
                batch = here
            elif batch[:3] != here[:3]:
                first = out_labels.index(batch[0])
                return Verdict(mirror(call.out, _at(lay, first)), fix=_FIX_PAIR,
                               mixes=f"pairs the batch of its {_ordinal(batch[3])} operand (dim {batch[4]}) "
                                     f"with the batch of its {_ordinal(k)} operand (dim {lay.dim}): "
                                     "the output combines every sample with every other")
        if batch is None:
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
        return Verdict(mirror(call.out, BatchLayout(batch[1], out_labels.index(batch[0]), batch[2])))

    return rule


def _lead(ndim: int, total: int) -> Labels:
    """Labels of right-aligned broadcast (leading) dimensions."""
    return tuple(("batch", total - ndim + i) for i in range(ndim))


def _matmul_labels(a: torch.Tensor, b: torch.Tensor):
    if a.dim() == 1 and b.dim() == 1:
        return ("k",), ("k",), ()
    if a.dim() == 1:
        lead = _lead(b.dim() - 2, b.dim() - 2)
        return ("k",), lead + ("k", "m"), lead + ("m",)
    if b.dim() == 1:
        lead = _lead(a.dim() - 2, a.dim() - 2)
        return lead + ("n", "k"), ("k",), lead + ("n",)
    total = max(a.dim(), b.dim()) - 2
    return (_lead(a.dim() - 2, total) + ("n", "k"), _lead(b.dim() - 2, total) + ("k", "m"),
            _lead(total, total) + ("n", "m"))


def _pairs(call: OpCall, *indices_names):
    out = []
    for index, name in indices_names:
        t = call.arg(index, name)
        if isinstance(t, torch.Tensor):
            out.append((t, call.layout(index, name)))
        else:
            out.append((None, None))
    return out


def _label_matmul(call: OpCall):
    (a, la), (b, lb) = _pairs(call, (0, "input"), (1, "other"))
    if a is None or b is None:
        return None
    ka, kb, ko = _matmul_labels(a, b)
    return [(a, la, ka), (b, lb, kb)], ko


def _label_addmm(call: OpCall):
    """addmm(input, m1, m2), baddbmm, addmv, addbmm, addr: bias + a product."""
    (bias, lbias), (a, la), (b, lb) = _pairs(call, (0, "input"), (1, "mat1"), (2, "mat2"))
    if a is None or b is None:
        return None
    name = call.name.split(".")[-1]
    if name in ("addbmm",):
        ka, kb, ko = ("s", "n", "k"), ("s", "k", "m"), ("n", "m")  # sums over the batch of matrices
    elif name in ("addr",):
        ka, kb, ko = ("n",), ("m",), ("n", "m")
    else:
        ka, kb, ko = _matmul_labels(a, b)
    operands = [(a, la, ka), (b, lb, kb)]
    if bias is not None:
        operands.append((bias, lbias, ko[len(ko) - bias.dim():] if bias.dim() else ()))
    return operands, ko


def _label_outer(call: OpCall):
    (a, la), (b, lb) = _pairs(call, (0, "input"), (1, "vec2"))
    return [(a, la, ("n",)), (b, lb, ("m",))], ("n", "m")


def _label_inner(call: OpCall):
    (a, la), (b, lb) = _pairs(call, (0, "input"), (1, "other"))
    ka = tuple(("a", i) for i in range(a.dim() - 1)) + ("k",)
    kb = tuple(("b", i) for i in range(b.dim() - 1)) + ("k",)
    return [(a, la, ka), (b, lb, kb)], ka[:-1] + kb[:-1]


def _label_linear(call: OpCall):
    """F.linear(x, w, b) and nn.Linear: out[..., o] = sum_i x[..., i] w[o, i] + b[o]."""
    m = call.module
    x, lx = call.args[0], call.arg_layouts[0]
    lead = _lead(x.dim() - 1, x.dim() - 1)
    operands = [(x, lx, lead + ("i",))]
    if m is None:
        (w, lw), (b, lb) = _pairs(call, (1, "weight"), (2, "bias"))
        if w is None or w.dim() != 2:
            return None
        operands.append((w, lw, ("o", "i")))
        if b is not None:
            operands.append((b, lb, ("o",)))
    return operands, lead + ("o",)


def _label_bilinear(call: OpCall):
    m = call.module
    (x1, l1), (x2, l2) = _pairs(call, (0, "input1"), (1, "input2"))
    lead = _lead(x1.dim() - 1, x1.dim() - 1)
    operands = [(x1, l1, lead + ("i",)), (x2, l2, lead + ("j",))]
    if m is None:
        (w, lw), = _pairs(call, (2, "weight"))
        operands.append((w, lw, ("o", "i", "j")))
    return operands, lead + ("o",)


def _label_sdpa(call: OpCall):
    """scaled_dot_product_attention(q, k, v, attn_mask): softmax(q k^T) v over the key positions."""
    (q, lq), (k, lk), (v, lv), (mask, lm) = _pairs(call, (0, "query"), (1, "key"), (2, "value"), (3, "attn_mask"))
    total = max(q.dim(), k.dim(), v.dim()) - 2
    operands = [(q, lq, _lead(q.dim() - 2, total) + ("l", "e")),
                (k, lk, _lead(k.dim() - 2, total) + ("s", "e")),
                (v, lv, _lead(v.dim() - 2, total) + ("s", "f"))]
    if mask is not None:
        full = _lead(total, total) + ("l", "s")
        operands.append((mask, lm, full[len(full) - mask.dim():]))
    return operands, _lead(total, total) + ("l", "f")


def _label_cdist(call: OpCall):
    (a, la), (b, lb) = _pairs(call, (0, "x1"), (1, "x2"))
    total = max(a.dim(), b.dim()) - 2
    return ([(a, la, _lead(a.dim() - 2, total) + ("p", "m")), (b, lb, _lead(b.dim() - 2, total) + ("r", "m"))],
            _lead(total, total) + ("p", "r"))


def _label_tensordot(call: OpCall):
    (a, la), (b, lb) = _pairs(call, (0, "a"), (1, "b"))
    dims = call.arg(2, "dims", default=2)
    if isinstance(dims, int):
        da, db = list(range(a.dim() - dims, a.dim())), list(range(dims))
    elif isinstance(dims, torch.Tensor):
        return None
    else:
        da, db = [_dims(x, a.dim()) for x in dims] if isinstance(dims[0], (list, tuple)) else ([dims[0]], [dims[1]])
        da, db = [_norm_dim(d, a.dim()) for d in da], [_norm_dim(d, b.dim()) for d in db]
    ka = [("a", i) for i in range(a.dim())]
    kb: List[Any] = [("b", i) for i in range(b.dim())]
    for i, j in zip(da, db):
        kb[j] = ka[i]
    out = tuple(ka[i] for i in range(a.dim()) if i not in da) + tuple(kb[j] for j in range(b.dim()) if j not in db)
    return [(a, la, tuple(ka)), (b, lb, tuple(kb))], out


def parse_einsum(equation: str, shapes: Sequence[Sequence[int]]):
    """Per-operand label tuples and the output's, with '...' expanded (implicit output supported)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        return None
    ell = max((len(s) - len(t.replace("...", "")) for t, s in zip(terms, shapes) if "..." in t), default=0)
    ell_labels = tuple(("...", i) for i in range(ell))

    def expand(term: str, ndim: int) -> Labels:
        if "..." not in term:
            return tuple(term)
        before, after = term.split("...")
        count = ndim - len(before) - len(after)
        return tuple(before) + ell_labels[ell - count:] + tuple(after)

    labels = [expand(t, len(s)) for t, s in zip(terms, shapes)]
    if arrow:
        out = expand(rhs, len(rhs.replace("...", "")) + ell) if "..." in rhs else tuple(rhs)
    else:
        letters = [c for t in terms for c in t.replace("...", "")]
        out = ell_labels + tuple(sorted(c for c in set(letters) if letters.count(c) == 1))
    return labels, out


def _label_einsum(call: OpCall):
    equation = call.args[0]
    if not isinstance(equation, str):
        return None  # sublist format
    if len(call.args) == 2 and isinstance(call.args[1], (list, tuple)):
        tensors, layouts = list(call.args[1]), list(call.arg_layouts[1])
    else:
        tensors, layouts = list(call.args[1:]), list(call.arg_layouts[1:])
    parsed = parse_einsum(equation, [t.shape for t in tensors])
    if parsed is None:
        return None
    labels, out = parsed
    return list(zip(tensors, layouts, labels)), out


# --------------------------------------------------------------------------------------------
# Layers that treat leading dims as independent and mix the rest (conv, pooling, norms)
# --------------------------------------------------------------------------------------------


def mixes_from(first_mixed: Callable[[OpCall, torch.Tensor], int], what: str, fix: str = _FIX_LAYER) -> BatchRule:
    """Ops that keep dims ``< k`` apart and mix dims ``>= k`` (``k = first_mixed(call, x)``)."""

    def rule(call: OpCall) -> Verdict:
        x, lay = call.args[0], call.arg_layouts[0]
        k = first_mixed(call, x)
        others = [lay2 for _, lay2 in call.operands()[1:] if per_sample(lay2)]
        if per_sample(lay) and lay.dim >= k:
            return Verdict(mirror(call.out, lay), fix=fix,
                           mixes=f"{what} (dims {k} to {x.dim() - 1}), and the batch sits in {_where(lay)}: "
                                 "samples are combined with each other")
        if others and any(o != lay for o in others):
            return Verdict(mirror(call.out, UNKNOWN_LAYOUT))  # per-sample weights: no rule for them
        if isinstance(lay, BatchLayout) and lay.kind == BROADCAST and lay.dim < k:
            return Verdict(mirror(call.out, lay))
        return Verdict(mirror(call.out, lay if per_sample(lay) else UNBATCHED_LAYOUT))

    return rule


def _spatial_from_name(obj) -> int:
    name = obj.__name__ if isinstance(obj, type) else getattr(obj, "__name__", "")
    m = re.search(r"(\d)d", name)
    return int(m.group(1)) if m else 2


def _conv_k(call: OpCall, x: torch.Tensor) -> int:
    m = call.module
    spatial = len(m.kernel_size) if m is not None else call.arg(1, "weight").dim() - 2
    return x.dim() - spatial - 1  # 1 for (N, C, *spatial), 0 for an unbatched (C, *spatial)


def _pool_k(call: OpCall, x: torch.Tensor) -> int:
    spatial = _spatial_from_name(type(call.module) if call.module is not None else call.op)
    return x.dim() - spatial


def _layer_norm_k(call: OpCall, x: torch.Tensor) -> int:
    shape = call.module.normalized_shape if call.module is not None else call.arg(1, "normalized_shape")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return x.dim() - len(shape)


def _instance_norm_k(call: OpCall, x: torch.Tensor) -> int:
    m = call.module
    if m is not None and hasattr(m, "_get_no_batch_dim") and x.dim() == m._get_no_batch_dim():
        return 1
    return 2


_CONV = mixes_from(_conv_k, "mixes its channel and spatial dimensions")
_POOL = mixes_from(_pool_k, "pools over its spatial dimensions")
_SPATIAL = mixes_from(lambda c, x: 2, "resamples its spatial dimensions")
_LAYER_NORM = mixes_from(_layer_norm_k, "normalises over its last dimensions", fix=_FIX_ALONG)
_GROUP_NORM = mixes_from(lambda c, x: 1, "normalises over channels and space per sample", fix=_FIX_LAYER)
_INSTANCE_NORM = mixes_from(_instance_norm_k, "normalises over its spatial dimensions", fix=_FIX_LAYER)
_PIXEL = mixes_from(lambda c, x: x.dim() - 3, "rearranges channels and space")
_FEATURES = mixes_from(lambda c, x: x.dim() - 1, "mixes its last dimension")
_PER_SAMPLE_ROWS = mixes_from(lambda c, x: 1, "treats dim 0 as the batch and mixes the other dimensions")


def _batch_norm(call: OpCall) -> Verdict:
    """Batch statistics (training, or no running stats) mix samples; running statistics do not."""
    lay = call.arg_layouts[0]
    m = call.module
    if m is not None:
        batch_stats = m.training or m.running_mean is None
    else:
        batch_stats = bool(call.arg(5, "training", default=False)) or call.arg(1, "running_mean") is None
    if batch_stats and per_sample(lay) and lay.dim != 1:  # statistics are over every dim but dim 1
        return Verdict(mirror(call.out, lay), fix=_FIX_BATCHNORM,
                       mixes="batch norm in training mode normalises with the mean and variance of the "
                             "whole batch: each sample's output depends on all the others")
    return keeps_layout(call)


def _pad(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    pad = tuple(call.module.padding) if call.module is not None else tuple(call.arg(1, "pad"))
    padded = {x.dim() - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}
    if per_sample(lay) and any(padded.get(lay.dim, (0, 0))):
        return Verdict(mirror(call.out, UNKNOWN_LAYOUT), fix=_FIX_CAT,
                       mixes=f"pads the batch dimension ({_where(lay)}) with {padded[lay.dim]} rows "
                             "that are not samples")
    return keeps_layout(call)


# --------------------------------------------------------------------------------------------
# Concatenation and splitting
# --------------------------------------------------------------------------------------------


@rearranging
def _cat(call: OpCall) -> Verdict:
    tensors = list(call.arg(0, "tensors", default=()))
    layouts = list(call.layout(0, "tensors") or [None] * len(tensors))
    out = call.out
    d = _norm_dim(call.arg(1, "dim", "axis", default=0), out.dim())
    batched = [(i, lay) for i, lay in enumerate(layouts) if per_sample(lay)]
    if not batched:
        return Verdict(UNBATCHED_LAYOUT)
    along = [(i, lay) for i, lay in batched if lay.dim == d]
    if along:
        for i, (t, lay) in enumerate(zip(tensors, layouts)):
            if t.numel() == 0:
                continue
            if not per_sample(lay):
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
    batched = [lay for lay in layouts if per_sample(lay)]
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
        if not per_sample(lay):
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
        after = tuple(BatchLayout.at(d) if s == call.batch_size and _inner(lay) == 1 else BatchLayout.merged(d, _inner(lay))
                      for s in sizes)
        verdict = _moved(call, lay, after[0], x.shape, pieces[0].shape)
        return Verdict(after, moves=verdict.moves, fix=verdict.fix)

    return rearranging(rule)


# --------------------------------------------------------------------------------------------
# Indexing and gathering
# --------------------------------------------------------------------------------------------


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

    batch = lay if per_sample(lay) else None
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
        if takes_batch and not (per_sample(t_lay) and call.is_sample_index(t_node)):
            return _Indexed(UNBATCHED_LAYOUT, "gathers along the batch dimension with an index tensor: sample i "
                                              "receives the values of whichever sample the index names")
        if per_sample(t_lay):
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
    if per_sample(lay) and per_sample(after) and after.dim > lay.dim:
        return _moved(call, lay, after, x.shape, call.out.shape)
    return Verdict(mirror(call.out, after))


def _setitem(call: OpCall) -> Verdict:
    """x[index] = v: writing per-sample values into entries picked along the batch mixes samples."""
    x, lay = call.args[0], call.arg_layouts[0]
    v, v_lay = call.args[2], call.arg_layouts[2]
    if not (isinstance(v, torch.Tensor) and per_sample(v_lay)):
        return Verdict(None)  # writing constants never mixes samples
    got = index_layout(call, x, lay, call.args[1], call.arg_layouts[1], call.arg_node(1))
    if got.mixes:
        return Verdict(None, fix=_FIX_INDEX,
                       mixes="writes per-sample values into entries picked along the batch dimension: "
                             "samples land in each other's places")
    pos = v_lay.dim + got.ndim - v.dim()  # v broadcasts into the region, right-aligned
    if per_sample(got.layout):
        if _at(v_lay, pos) != got.layout:
            return Verdict(None, fix=_FIX_PAIR,
                           mixes=f"writes values with the batch at dim {pos} of the written region into a "
                                 f"region with the batch at dim {got.layout.dim}: sample i's slot gets sample j's values")
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
        return Verdict(UNKNOWN_LAYOUT) if per_sample(lay) else Verdict(UNBATCHED_LAYOUT)
    d = _norm_dim(d, x.dim())
    if per_sample(lay):
        if lay.dim == d:
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT), fix=_FIX_INDEX,
                           mixes=f"gathers along the batch dimension (dim {d}): sample i receives the values "
                                 "of whichever sample the index names")
        if per_sample(index_lay) and index_lay != lay:
            return Verdict(lay, fix=_FIX_PAIR, mixes="gathers with per-sample indices whose batch does not line up "
                                                     "with the data's: samples read each other's indices")
        if index.shape[lay.dim] != x.shape[lay.dim]:
            return Verdict(UNBATCHED_LAYOUT, fix=_FIX_INDEX,
                           mixes="gathers with an index that covers only some samples")
        return Verdict(lay)
    if per_sample(index_lay):
        return Verdict(index_lay)
    return Verdict(UNBATCHED_LAYOUT)


def _scatter(call: OpCall) -> Verdict:
    """scatter/index_add/index_copy(x, dim, index, src): writing along the batch mixes samples."""
    x = call.args[0]
    d = _norm_dim(call.arg(1, "dim"), x.dim())
    tensors = call.operands()
    for t, tl in tensors:
        if per_sample(tl) and tl.dim == d and t.dim() == x.dim():
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT), fix=_FIX_INDEX,
                           mixes=f"scatters along the batch dimension (dim {d}): samples are written into "
                                 "each other's places")
    found = {tl for t, tl in tensors if per_sample(tl) and t.dim() == x.dim()}
    if len(found) > 1:
        return Verdict(UNKNOWN_LAYOUT, fix=_FIX_PAIR, mixes="scatters between tensors whose batches do not line up")
    return Verdict(mirror(call.out, next(iter(found)) if found else UNBATCHED_LAYOUT))


def _take(call: OpCall) -> Verdict:
    lay = call.arg_layouts[0]
    if per_sample(lay):
        return Verdict(UNBATCHED_LAYOUT, fix=_FIX_INDEX,
                       mixes="indexes the flattened tensor, batch included: samples are read by position")
    return Verdict(mirror(call.out, call.layout(1, "index") if per_sample(call.layout(1, "index")) else UNBATCHED_LAYOUT))


def _embedding(call: OpCall) -> Verdict:
    """F.embedding(indices, weight) / nn.Embedding: one row per index, the batch stays with the indices."""
    lay = call.arg_layouts[0]
    if call.module is None and per_sample(call.layout(1, "weight")):
        return Verdict(UNKNOWN_LAYOUT)
    return Verdict(mirror(call.out, lay if isinstance(lay, BatchLayout) else UNBATCHED_LAYOUT))


def _embedding_bag(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    if x.dim() == 2:
        if per_sample(lay) and lay.dim == 1:
            return Verdict(lay, fix=_FIX_LAYER, mixes="pools the bag dimension (dim 1), which is the batch dimension")
        return Verdict(lay if isinstance(lay, BatchLayout) else UNBATCHED_LAYOUT)
    return Verdict(UNKNOWN_LAYOUT) if per_sample(lay) else Verdict(UNBATCHED_LAYOUT)


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
# Losses, sequence layers, attention layers
# --------------------------------------------------------------------------------------------


def _loss(call: OpCall) -> Verdict:
    reduction = call.module.reduction if call.module is not None else call.kwargs.get("reduction", "mean")
    pairs = [(t, lay) for t, lay in call.operands() if per_sample(lay)]
    if not pairs:
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    if reduction != "none":
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT), fix=_FIX_LOSS,
                       mixes=f"computes the loss with reduction='{reduction}' inside the model: the result "
                             "combines all samples")
    out = _first_tensor(call.out)
    for t, lay in pairs:
        if t.dim() == out.dim():
            return Verdict(mirror(call.out, lay))
    t, lay = pairs[0]
    return Verdict(mirror(call.out, lay if lay.dim == 0 else UNKNOWN_LAYOUT))


def _batch_first(m: nn.Module) -> bool:
    if getattr(m, "batch_first", None) is not None:
        return bool(m.batch_first)
    for sub in m.modules():
        if isinstance(sub, nn.MultiheadAttention):
            return bool(sub.batch_first)
    return False


def _sequence_check(call: OpCall, name: str, t: Optional[torch.Tensor], lay, batch_at: Optional[int],
                    seq_at: Optional[int]) -> str:
    if t is None or not per_sample(lay):
        return ""
    if batch_at is None or lay.dim != batch_at:
        role = "sequence" if lay.dim == seq_at else "feature"
        where = "an unbatched input" if batch_at is None else f"dim {batch_at}"
        return (f"receives its {name} with the batch in dim {lay.dim}, which the layer treats as the {role} "
                f"dimension (it expects the batch in {where}): samples are combined with each other")
    return ""


def _rnn(call: OpCall) -> Verdict:
    """nn.LSTM / nn.GRU / nn.RNN: the recurrence runs along the time dimension."""
    m = call.module
    x, lay = call.args[0], call.arg_layouts[0]
    if not isinstance(x, torch.Tensor):
        return Verdict(mirror(call.out, UNKNOWN_LAYOUT))  # PackedSequence
    batch_at, seq_at = ((0, 1) if m.batch_first else (1, 0)) if x.dim() == 3 else (None, 0)
    why = _sequence_check(call, "input", x, lay, batch_at, seq_at)
    hx, hx_lay = call.arg(1, "hx"), call.layout(1, "hx")
    for t, tl in _tensor_pairs(hx, hx_lay):
        why = why or _sequence_check(call, "initial state", t, tl, 1 if t.dim() == 3 else None, None)
    fix = "Pass batch_first=True for batch-first inputs (or transpose the input to (T, N, ...))."
    per = per_sample(lay) or any(per_sample(tl) for _, tl in _tensor_pairs(hx, hx_lay))
    if not per:
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    kind = lay if per_sample(lay) else BatchLayout.at(batch_at or 0)
    out, state = call.out
    layout = (_at(kind, batch_at) if batch_at is not None else kind,
              mirror(state, BatchLayout.at(1) if batch_at is not None else UNBATCHED_LAYOUT))
    return Verdict(layout, mixes=why, fix=fix if why else "")


def _rnn_cell(call: OpCall) -> Verdict:
    return _FEATURES(call)


def _multihead_attention(call: OpCall) -> Verdict:
    m = call.module
    batch_at, seq_at = (0, 1) if m.batch_first else (1, 0)
    why = ""
    kind = None
    for i, name in enumerate(("query", "key", "value")):
        t, lay = call.arg(i, name), call.layout(i, name)
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            why = why or _sequence_check(call, name, t, lay, None, 0)
        else:
            why = why or _sequence_check(call, name, t, lay, batch_at, seq_at)
        if per_sample(lay) and kind is None:
            kind = lay
    fix = "Pass batch_first=True for batch-first inputs (or transpose them to (T, N, E))."
    if kind is None:
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    q = call.arg(0, "query")
    main = _at(kind, batch_at) if q.dim() == 3 else kind
    weights = call.out[1]
    layout = (main, BatchLayout.at(0) if isinstance(weights, torch.Tensor) else None)
    return Verdict(layout, mixes=why, fix=fix if why else "")


def _transformer_layer(call: OpCall) -> Verdict:
    """nn.TransformerEncoderLayer & co.: attention along the sequence dimension."""
    m = call.module
    batch_at, seq_at = (0, 1) if _batch_first(m) else (1, 0)
    # the sequences: the first two positional arguments (src/tgt, memory/tgt) or their keywords
    pairs = list(_tensor_pairs(call.args[:2], call.arg_layouts[:2]))
    for name in ("src", "tgt", "memory"):
        if name in call.kwargs:
            pairs.extend(_tensor_pairs(call.kwargs[name], call.kwarg_layouts.get(name)))
    why = ""
    kind = None
    for t, lay in pairs:
        b = batch_at if t.dim() == 3 else None
        why = why or _sequence_check(call, "input", t, lay, b, seq_at if t.dim() == 3 else 0)
        if per_sample(lay) and kind is None:
            kind = lay
    if kind is None:
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    main = _at(kind, batch_at) if _first_tensor(call.out).dim() == 3 else kind
    return Verdict(mirror(call.out, main), mixes=why,
                   fix="Pass batch_first=True for batch-first inputs (or transpose them to (T, N, E))." if why else "")


# --------------------------------------------------------------------------------------------
# The out-of-place helpers the inplace pass writes into the graph
# --------------------------------------------------------------------------------------------


def _index_assign(call: OpCall) -> Verdict:
    """index_assign(x, index, value): ``x[index] = value`` out of place."""
    verdict = _setitem(call)
    lay = verdict.updates_input if verdict.updates_input is not None else call.arg_layouts[0]
    if not isinstance(lay, BatchLayout):
        lay = UNBATCHED_LAYOUT
    return Verdict(mirror(call.out, lay), mixes=verdict.mixes, fix=verdict.fix)


def _apply_out_of_place(call: OpCall) -> Verdict:
    """apply_out_of_place(x, "method_", *args): the in-place method's own rule decides."""
    method = call.args[1]
    rule = find_batch_rule(method)
    if rule is None:
        return Verdict(mirror(call.out, UNKNOWN_LAYOUT))
    inner = OpCall(method, (call.args[0],) + tuple(call.args[2:]), call.kwargs,
                   (call.arg_layouts[0],) + tuple(call.arg_layouts[2:]), call.kwarg_layouts, call.out,
                   call.batch_size, call.home, None, call.facts)
    return rule(inner)


# --------------------------------------------------------------------------------------------
# The families, registered one line each
# --------------------------------------------------------------------------------------------

_UNARY = (
    "abs absolute acos arccos acosh arccosh asin arcsin asinh arcsinh atan arctan atanh arctanh ceil clamp "
    "clip clamp_min clamp_max cos cosh deg2rad rad2deg digamma erf erfc erfinv exp exp2 expm1 fix floor frac "
    "lgamma log log10 log1p log2 logit i0 isnan isinf isfinite isneginf isposinf isreal nan_to_num neg "
    "negative positive reciprocal round rsqrt sigmoid sign sgn signbit sin sinc sinh sqrt square tan tanh trunc "
    "relu logical_not bitwise_not angle conj conj_physical resolve_conj resolve_neg polygamma mvlgamma "
    "bernoulli hardshrink"
).split()
_BINARY = (
    "add sub subtract rsub mul multiply div divide true_divide floor_divide remainder fmod pow float_power "
    "atan2 arctan2 hypot maximum minimum fmax fmin eq ne lt le gt ge greater greater_equal less less_equal "
    "not_equal logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor bitwise_left_shift "
    "bitwise_right_shift copysign nextafter ldexp xlogy heaviside lerp addcmul addcdiv where masked_fill "
    "isclose igamma igammac"
).split()
_INPLACE = [n + "_" for n in _UNARY + _BINARY] + "copy_ fill_ zero_ normal_ uniform_ exponential_ random_ masked_fill_ requires_grad_ detach_ clamp_ clip_".split()
_IDENTITY = (
    "to type type_as float double half bfloat16 int long short bool byte char cpu cuda contiguous clone "
    "detach pin_memory retain_grad rand_like randn_like zeros_like ones_like full_like empty_like "
    "randint_like bucketize alias"
).split()
_F_ELEMENTWISE = (
    "relu relu_ relu6 elu elu_ selu selu_ celu celu_ gelu silu mish hardswish hardsigmoid hardtanh hardtanh_ "
    "leaky_relu leaky_relu_ logsigmoid softplus softshrink hardshrink tanhshrink softsign threshold "
    "threshold_ rrelu rrelu_ prelu sigmoid tanh dropout dropout1d dropout2d dropout3d alpha_dropout "
    "feature_alpha_dropout"
).split()
_SPECIAL = (
    "expit erf erfc erfcx erfinv exp2 expm1 gammaln digamma psi i0 i0e i1 i1e log1p logit ndtr ndtri "
    "log_ndtr sinc round xlogy xlog1py entr"
).split()
_OPERATORS = [operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
              operator.pow, operator.neg, operator.pos, operator.abs, operator.invert, operator.and_,
              operator.or_, operator.xor, operator.lshift, operator.rshift, operator.eq, operator.ne,
              operator.lt, operator.le, operator.gt, operator.ge, operator.iadd, operator.isub, operator.imul,
              operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
              operator.ixor, operator.ilshift, operator.irshift]
_ACTIVATION_LAYERS = (
    "ReLU ReLU6 ELU SELU CELU GELU SiLU Mish Hardswish Hardsigmoid Hardtanh LeakyReLU LogSigmoid Softplus "
    "Softshrink Hardshrink Tanhshrink Softsign Threshold RReLU PReLU Sigmoid Tanh Identity Dropout Dropout1d "
    "Dropout2d Dropout3d AlphaDropout FeatureAlphaDropout"
).split()
_NEW_METHODS = [getattr(torch.Tensor, n) for n in ("new_zeros", "new_ones", "new_empty", "new_full")]
_FACTORIES = "zeros ones empty full rand randn randint randperm tensor eye linspace logspace".split()
_REDUCTIONS = (
    "sum mean nansum nanmean prod amax amin all any logsumexp argmax argmin max min median nanmedian mode "
    "std var std_mean var_mean count_nonzero"
).split()
_POOLS = [p + s for p in ("max_pool", "avg_pool", "adaptive_max_pool", "adaptive_avg_pool", "lp_pool",
                          "fractional_max_pool", "max_unpool") for s in ("1d", "2d", "3d")]
_POOL_LAYERS = [p + s for p in ("MaxPool", "AvgPool", "AdaptiveMaxPool", "AdaptiveAvgPool", "LPPool",
                                "FractionalMaxPool", "MaxUnpool") for s in ("1d", "2d", "3d")]
_PAD_LAYERS = [p + s for p in ("ConstantPad", "ZeroPad", "ReflectionPad", "ReplicationPad", "CircularPad")
               for s in ("1d", "2d", "3d")]
_LOSSES = (
    "cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy "
    "binary_cross_entropy_with_logits kl_div poisson_nll_loss gaussian_nll_loss soft_margin_loss "
    "margin_ranking_loss hinge_embedding_loss cosine_embedding_loss triplet_margin_loss "
    "multilabel_margin_loss multilabel_soft_margin_loss multi_margin_loss"
).split()

# elementwise and broadcasting
register_batch_rule(_keys(*_UNARY, *_BINARY, *_INPLACE) + _fn(*_F_ELEMENTWISE) + _OPERATORS
                    + _keys(*_SPECIAL, methods=False, namespaces=(torch.special,)))(elementwise)
register_batch_rule(_keys(*_IDENTITY))(rearranging(lambda call: keeps_layout(call)))
register_batch_rule(_modules(*_ACTIVATION_LAYERS))(elementwise)
register_batch_rule(_fn("one_hot"))(keeps_layout)  # appends a class dimension
# tensors made from sizes, not from data
register_batch_rule(_keys(*_FACTORIES, methods=False) + ["new_zeros", "new_ones", "new_empty", "new_full"] + _NEW_METHODS)(_factory)
register_batch_rule(["new_tensor", torch.Tensor.new_tensor, torch.tril_indices, torch.triu_indices])(_constant)
register_batch_rule([torch.arange])(_arange)
# reductions (the dim is argument 1, except where noted)
register_batch_rule(_keys(*_REDUCTIONS))(reduction(1))
register_batch_rule(_keys("norm", "quantile", "nanquantile"))(reduction(2))
register_batch_rule(_keys("norm", "vector_norm", methods=False, namespaces=(torch.linalg,)))(reduction(2))
register_batch_rule(_keys("matrix_norm", methods=False, namespaces=(torch.linalg,)))(reduction(2, default=(-2, -1)))
register_batch_rule(_keys("aminmax"))(reduction(None))
register_batch_rule(_keys("kthvalue"))(reduction(2))
register_batch_rule(_keys("trace", "dist"))(reduction(None))
register_batch_rule(_fn("cosine_similarity") + [torch.cosine_similarity])(_binary_reduction(2, 1))
register_batch_rule(_fn("pairwise_distance") + [torch.pairwise_distance])(_binary_reduction(None, -1))
register_batch_rule(_modules("CosineSimilarity", "PairwiseDistance"))(_module_reduction)
# along a dimension
register_batch_rule(_keys("softmax", "log_softmax", functional=True) + _fn("softmin"))(
    along(1, default=_softmax_default_dim))
register_batch_rule(_keys("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort", "argsort"))(along(1))
register_batch_rule(_keys("topk", "diff"))(along(2))
register_batch_rule(_keys("flip"))(along(1, names=("dims",), varargs=True))
register_batch_rule(_keys("fliplr"))(along(None, default=1))
register_batch_rule(_keys("flipud", "msort"))(along(None, default=0))
register_batch_rule(_keys("roll"))(along(2, names=("dims",), default="all"))
register_batch_rule(_keys("rot90"))(along(2, names=("dims",), default=(0, 1)))
register_batch_rule(_keys("unfold", methods=True, namespaces=()))(along(1, names=("dimension",)))
register_batch_rule(_fn("normalize"))(along(2, default=1))
register_batch_rule(_fn("glu"))(along(1, default=-1))
register_batch_rule(_fn("gumbel_softmax"))(along(4, default=-1))
register_batch_rule(_fn("local_response_norm"))(along(None, default=1))
register_batch_rule(_modules("Softmax", "LogSoftmax", "Softmin"))(_module_along("dim", None))
register_batch_rule(_modules("Softmax2d"))(_module_along("", -3))
register_batch_rule(_modules("GLU"))(_module_along("dim", -1))
register_batch_rule(_modules("LocalResponseNorm"))(_module_along("", 1))
# views and reshapes: one dimension map per op
for _kind in _VIEW_MAPS:
    register_batch_rule(_keys(_kind, methods=True))(view(_kind))
register_batch_rule([builtins.getattr])(_getattr)
register_batch_rule(_modules("Flatten"))(_flatten_module)
register_batch_rule(_modules("Unflatten"))(_unflatten_module)
register_batch_rule(_keys("repeat", "tile"))(_repeat)
register_batch_rule(_keys("repeat_interleave"))(_repeat_interleave)
# contractions
register_batch_rule(_keys("matmul", "mm", "bmm", "mv", "dot", "vdot") + [operator.matmul, operator.imatmul])(contraction(_label_matmul))
register_batch_rule(_keys("addmm", "baddbmm", "addmv", "addbmm", "addr"))(contraction(_label_addmm))
register_batch_rule(_keys("outer", "ger"))(contraction(_label_outer))
register_batch_rule(_keys("inner"))(contraction(_label_inner))
register_batch_rule(_keys("einsum", methods=False))(contraction(_label_einsum))
register_batch_rule(_keys("tensordot", methods=False))(contraction(_label_tensordot))
register_batch_rule(_keys("cdist", methods=False))(contraction(_label_cdist))
register_batch_rule(_fn("linear") + _modules("Linear", "LazyLinear"))(contraction(_label_linear))
register_batch_rule(_fn("bilinear") + _modules("Bilinear"))(contraction(_label_bilinear))
register_batch_rule(_fn("scaled_dot_product_attention"))(contraction(_label_sdpa))
# convolution, pooling, resampling
register_batch_rule(_keys("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                          methods=False, functional=True) + [nn.modules.conv._ConvNd])(_CONV)
register_batch_rule(_keys(*_POOLS, methods=False, functional=True) + _fn("max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices") + _modules(*_POOL_LAYERS))(_POOL)
register_batch_rule(_fn("interpolate", "upsample", "upsample_nearest", "upsample_bilinear") + _modules("Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"))(_SPATIAL)
register_batch_rule(_keys("pixel_shuffle", "pixel_unshuffle", methods=False, functional=True) + _modules("PixelShuffle", "PixelUnshuffle"))(_PIXEL)
register_batch_rule(_fn("unfold", "fold", "grid_sample", "affine_grid", "channel_shuffle") + _modules("Unfold", "Fold", "ChannelShuffle"))(_PER_SAMPLE_ROWS)
register_batch_rule(_fn("pad") + _modules(*_PAD_LAYERS))(_pad)
# normalisation
register_batch_rule(_fn("layer_norm", "rms_norm") + _modules("LayerNorm", "RMSNorm"))(_LAYER_NORM)
register_batch_rule(_fn("group_norm") + _modules("GroupNorm"))(_GROUP_NORM)
register_batch_rule(_fn("instance_norm") + _modules("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d"))(_INSTANCE_NORM)
register_batch_rule(_fn("batch_norm") + [nn.modules.batchnorm._BatchNorm])(_batch_norm)
# concatenation and splitting
register_batch_rule(_keys("cat", "concat", "concatenate", methods=False))(_cat)
register_batch_rule(_keys("stack", methods=False))(_stack)
register_batch_rule(_keys("split", "chunk", "tensor_split", "split_with_sizes"))(_split(2))
register_batch_rule(_keys("unbind"))(_split(1, removes_dim=True))
# indexing and gathering
register_batch_rule([operator.getitem])(_getitem)
register_batch_rule([operator.setitem])(_setitem)
register_batch_rule(_keys("select"))(_select)
register_batch_rule(_keys("narrow"))(_narrow)
register_batch_rule(_keys("index_select"))(_index_select)
register_batch_rule(_keys("gather", "take_along_dim"))(_gather)
register_batch_rule(_keys("scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill",
                          "scatter_", "scatter_add_", "scatter_reduce_", "index_add_", "index_copy_", "index_fill_"))(_scatter)
register_batch_rule(_keys("take"))(_take)
register_batch_rule(_fn("embedding") + _modules("Embedding"))(_embedding)
register_batch_rule(_modules("EmbeddingBag"))(_embedding_bag)
# losses (every nn loss derives from _Loss)
register_batch_rule(_fn(*_LOSSES) + [nn.modules.loss._Loss])(_loss)
# the inplace pass's out-of-place helpers
register_batch_rule([_inplace.index_assign])(_index_assign)
register_batch_rule([_inplace.copy_into])(elementwise)
register_batch_rule([_inplace.random_like, torch.fill])(keeps_layout)
register_batch_rule([_inplace.apply_out_of_place])(_apply_out_of_place)
# sequence and attention layers
register_batch_rule([nn.RNNBase])(_rnn)
register_batch_rule([nn.RNNCellBase])(_rnn_cell)
register_batch_rule(_modules("MultiheadAttention"))(_multihead_attention)
register_batch_rule(_modules("TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
                             "TransformerDecoder", "Transformer"))(_transformer_layer)


# A layer with a user-registered per-sample rule and no batch rule: the grad-sampler contract says it
# takes and returns the batch in dimension 0, and may combine everything else.
_registered_layer = mixes_from(lambda call, x: 1, "a layer with a registered per-sample rule combines every dimension but the first")
