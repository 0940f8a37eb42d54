"""The core of the batch rules: what a rule sees (:class:`OpCall`), what it returns (:class:`Verdict`),
the registry, and the helpers every family of rules shares.

Every rule has one signature, ``rule(call: OpCall) -> Verdict``: it looks at the op's fake inputs,
their layouts (:class:`fxdp.layout.BatchLayout`) and its fake output, and says where the batch is
in the output, whether the op lets samples influence each other (``mixes``) and whether it moved
the batch (``moves``). Nothing real is computed.

The registry is keyed by the op the graph calls. Ops that are classes (``nn.Module`` types for the
layers the graph calls whole) live in a :class:`fxdp.registry.TypeRegistry`, so lookup walks the
MRO and a subclass of ``nn.Linear`` uses the Linear rule unless it overrides ``forward``; every other
op (torch and ``operator`` functions, ``getattr``, Tensor method names as strings) is a key of a plain
dict. A function of a library fxdp does not import (torchvision) is registered by its dotted name,
``"torchvision.ops.stochastic_depth.stochastic_depth"``; method names never contain a dot. A layer class of
such a library is registered by its dotted path with :func:`register_batch_rule_by_path`
(:meth:`fxdp.registry.TypeRegistry.register_by_path`, as for per-sample rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxdp.diagnostics.naming import dotted_name, name_op, op_name
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.layout import BATCHED, BROADCAST, MERGED, UNBATCHED_LAYOUT, UNKNOWN_LAYOUT, BatchLayout
from fxdp.registry import TypeRegistry, as_types

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
        pairs = list(tensor_pairs(self.args, self.arg_layouts))
        for key, value in self.kwargs.items():
            if key != "out":
                pairs.extend(tensor_pairs(value, self.kwarg_layouts.get(key)))
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

_OP_RULES: Dict[Any, BatchRule] = {}  # functions, getattr, Tensor method names
# classes (nn.Module types): MRO lookup, not for subclasses that override forward
LAYER_RULES: TypeRegistry[BatchRule] = TypeRegistry(unless_overridden="forward")
# rules derived for ops nobody registered (an ATen op gets the rule of its torch equivalent, .aten)
_RESOLVERS: List[Callable[[Any], Optional[BatchRule]]] = []


def register_batch_rule(ops, *, subclasses: bool = False):
    """Decorator: register ``rule(call) -> Verdict`` for one op or a list of ops (the last wins).

    An op is a torch function, an ``operator`` function, a Tensor method name (``"transpose"``), the
    dotted name of a function in another library, or an ``nn.Module`` type (lookup walks the MRO: a
    subclass shares the rule unless it overrides ``forward``, or always with ``subclasses=True``).
    """
    targets = as_types(ops)
    layers = [op for op in targets if isinstance(op, type)]

    def decorator(rule: BatchRule) -> BatchRule:
        for op in targets:
            if not isinstance(op, type):
                _OP_RULES[op] = rule
        if layers:
            LAYER_RULES.register(layers, subclasses=subclasses)(rule)
        return rule

    return decorator


def find_batch_rule(op) -> Optional[BatchRule]:
    """The rule for an op (a module instance or type walks its MRO); ``None`` if there is none."""
    if isinstance(op, (nn.Module, type)):
        rule = LAYER_RULES.find(op)
        if rule is None and find_grad_sampler(op) is not None:
            return _registered_layer
        return rule
    try:
        rule = _OP_RULES.get(op)
    except TypeError:  # an unhashable target cannot have a rule
        return None
    if rule is None and callable(op) and not isinstance(op, str):
        rule = _OP_RULES.get(dotted_name(op))
    for resolve in _RESOLVERS if rule is None else ():
        rule = resolve(op)
        if rule is not None:
            break
    return rule


def register_batch_rule_by_path(path: str, *, subclasses: bool = False):
    """Decorator: register ``rule`` for the layer class ``path`` ("module.ClassName") of a library fxdp does
    not import, as soon as that module has been imported (:meth:`TypeRegistry.register_by_path`)."""
    return LAYER_RULES.register_by_path(path, subclasses=subclasses)


def add_rule_resolver(resolve: Callable[[Any], Optional[BatchRule]]) -> None:
    """``resolve(op) -> rule or None`` is asked for ops that have no registered rule (after them)."""
    _RESOLVERS.append(resolve)


def snapshot_batch_rules():
    """The registrations as they are now, for :func:`restore_batch_rules` (tests undo what they add)."""
    return dict(_OP_RULES), LAYER_RULES.snapshot()


def restore_batch_rules(snapshot) -> None:
    ops, layers = snapshot
    _OP_RULES.clear()
    _OP_RULES.update(ops)
    LAYER_RULES.restore(layers)


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
                name_op(fn, f"{ns.__name__}.{name}")
        if functional and getattr(F, name, None) is not None:
            keys.append(getattr(F, name))
            name_op(getattr(F, name), f"F.{name}")
    return keys


def _fn(*names: str) -> list:
    """torch.nn.functional functions by name (the ones this torch version has)."""
    return _keys(*names, methods=False, functional=True, namespaces=())


def nn_layers(*names: str) -> list:
    """torch.nn layer types by name (the ones this torch version has)."""
    return [getattr(nn, n) for n in names if isinstance(getattr(nn, n, None), type)]


def nn_family(base: type) -> list:
    """``base`` and the torch.nn layers derived from it (torch's LSTM overrides RNNBase's forward, so
    each is registered by name rather than the base with ``subclasses=True``, which would also cover
    a user's subclass that computes something else)."""
    return [base] + [c for c in vars(nn).values() if isinstance(c, type) and issubclass(c, base) and c is not base]


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def carries_batch(layout) -> bool:
    """True for a layout that carries per-sample data (batched or merged)."""
    return isinstance(layout, BatchLayout) and layout.is_batched


def tensor_pairs(value, layout) -> Iterator[Tuple[torch.Tensor, Any]]:
    """Every tensor in ``value`` (nested lists, tuples and dicts) with its layout from ``layout``."""
    if isinstance(value, torch.Tensor):
        yield value, layout
    elif isinstance(value, (list, tuple)):
        layouts = layout if isinstance(layout, (list, tuple)) else [None] * len(value)
        for v, lay in zip(value, layouts):
            yield from tensor_pairs(v, lay)
    elif isinstance(value, dict):
        layouts = layout if isinstance(layout, dict) else {}
        for k, v in value.items():
            yield from tensor_pairs(v, layouts.get(k))


def mirror(out, layout):
    """``layout`` for every tensor in ``out`` (tuples mirrored), None for everything else."""
    if isinstance(out, torch.Tensor):
        return layout
    if isinstance(out, (list, tuple)):
        return tuple(mirror(o, layout) for o in out)
    return None


def _first_tensor(value) -> Optional[torch.Tensor]:
    for t, _ in tensor_pairs(value, None):
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
    if not (carries_batch(before) and carries_batch(after)) or after == before or after == call.home:
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
# Rules shared by layers: keep the leading dims apart, mix the rest
# --------------------------------------------------------------------------------------------


def mixes_from(first_mixed: Callable[[OpCall, torch.Tensor], int], what: str, fix: str = _FIX_LAYER) -> BatchRule:
    """Ops that keep dims ``< k`` apart and mix dims ``>= k`` (``k = first_mixed(call, x)``)."""

    def rule(call: OpCall) -> Verdict:
        x, lay = call.args[0], call.arg_layouts[0]
        k = first_mixed(call, x)
        others = [lay2 for _, lay2 in call.operands()[1:] if carries_batch(lay2)]
        if carries_batch(lay) and lay.dim >= k:
            return Verdict(mirror(call.out, lay), fix=fix,
                           mixes=f"{what} (dims {k} to {x.dim() - 1}), and the batch sits in {_where(lay)}: "
                                 "samples are combined with each other")
        if others and any(o != lay for o in others):
            return Verdict(mirror(call.out, UNKNOWN_LAYOUT))  # per-sample weights: no rule for them
        if isinstance(lay, BatchLayout) and lay.kind == BROADCAST and lay.dim < k:
            return Verdict(mirror(call.out, lay))
        return Verdict(mirror(call.out, lay if carries_batch(lay) else UNBATCHED_LAYOUT))

    return rule


# A layer with a user-registered per-sample rule and no batch rule: the grad-sampler contract says it
# takes and returns the batch in dimension 0, and may combine everything else.
_registered_layer = mixes_from(
    lambda call, x: 1, "a layer with a registered per-sample rule combines every dimension but the first")
