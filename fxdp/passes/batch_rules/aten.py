"""ATen ops, as the graphs torch.export captures call them (:mod:`fxdp.frontends.export`).

Most ATen ops take their arguments in the order of the torch function or Tensor method of the same
name (``aten.transpose.int(x, 1, 2)`` is ``x.transpose(1, 2)``): :func:`aten_rule` looks the rule up by
that name, so each of those ops has the rule the fx graphs use, and a rule registered later for the
name applies to the ATen op too. A few ATen names differ from the Python ones (:data:`ALIASES`), and
the ops whose arguments differ have rules here: ``embedding(weight, indices)``, ``slice.Tensor``,
``index.Tensor`` (a list of index tensors, ``None`` meaning a full slice), ``batch_norm`` (weight before
the running statistics). An ATen op with no rule either way stays without one: the pass reports it
as unverified, it never guesses.

:func:`canonical_target` gives the interpreter's fact-keeping (:mod:`.nodes`) the same view: an
``aten.sym_size.int`` is ``x.size(d)``, an ``aten.arange`` is ``torch.arange``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from fxdp.layout import UNBATCHED_LAYOUT, UNKNOWN_LAYOUT, BatchLayout
from fxdp.passes.batch_rules.core import (
    _FIX_INDEX, BatchRule, OpCall, Verdict, _moved, _norm_dim, add_rule_resolver, find_batch_rule, mirror,
    carries_batch, rearranging, register_batch_rule,
)
from fxdp.passes.batch_rules.indexing import index_layout
from fxdp.passes.batch_rules.layers import _batch_norm, _loss
from fxdp.passes.batch_rules.views import view

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload

#: ATen names whose Python equivalent has another name (same arguments).
ALIASES: Dict[str, str] = {
    "__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor",
    "__lshift__": "bitwise_left_shift", "__rshift__": "bitwise_right_shift",
    "__iand__": "bitwise_and_", "__ior__": "bitwise_or_", "__ixor__": "bitwise_xor_",
    "_to_copy": "to", "_unsafe_view": "view", "lift_fresh_copy": "clone", "_softmax": "softmax",
    "_log_softmax": "log_softmax", "native_layer_norm": "layer_norm", "native_dropout": "dropout",
    "constant_pad_nd": "pad", "unsafe_split": "split", "unsafe_chunk": "chunk", "_unsafe_index": "index",
    "sym_size": "size",
}


def aten_name(op) -> Optional[str]:
    """``"transpose"`` for ``aten.transpose.int`` (after :data:`ALIASES`); None for anything else."""
    if not isinstance(op, OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    return ALIASES.get(name, name)


def _equivalent(name: str):
    """The torch function, Tensor method name or F function of ``name`` that has a rule, if any."""
    candidates = [name if hasattr(torch.Tensor, name) else None, getattr(torch, name, None), getattr(F, name, None)]
    for key in candidates:
        if key is not None and find_batch_rule(key) is not None:
            return key
    return None


_DERIVED: Dict[Any, Optional[BatchRule]] = {}


def aten_rule(op) -> Optional[BatchRule]:
    """The rule for an ATen op no rule was registered for: the rule of its Python equivalent, called
    with the equivalent as ``call.op`` (looked up at each call, so later registrations count)."""
    name = aten_name(op)
    if name is None:
        return None
    if op not in _DERIVED:
        key = _equivalent(name)
        if key is None:
            return None  # not cached: a rule registered for the name later still applies

        def rule(call: OpCall) -> Verdict:
            return find_batch_rule(key)(dataclasses.replace(call, op=key))

        rule.rearranges = getattr(find_batch_rule(key), "rearranges", False)  # type: ignore[attr-defined]
        _DERIVED[op] = rule
    return _DERIVED[op]


add_rule_resolver(aten_rule)


# --------------------------------------------------------------------------------------------
# Ops whose arguments differ from their Python equivalents
# --------------------------------------------------------------------------------------------


def _embedding(call: OpCall) -> Verdict:
    """aten.embedding(weight, indices, ...): one row per index, the batch stays with the indices."""
    if carries_batch(call.arg_layouts[0]):
        return Verdict(mirror(call.out, UNKNOWN_LAYOUT))  # per-sample tables: no rule for them
    lay = call.arg_layouts[1]
    return Verdict(mirror(call.out, lay if isinstance(lay, BatchLayout) else UNBATCHED_LAYOUT))


def _indexed(call: OpCall, x, lay, index, index_layouts, index_nodes) -> Verdict:
    got = index_layout(call, x, lay, index, index_layouts, index_nodes)
    if got.mixes:
        return Verdict(mirror(call.out, got.layout), mixes=got.mixes, fix=_FIX_INDEX)
    after = got.layout
    if carries_batch(lay) and carries_batch(after) and after.dim > lay.dim:
        return _moved(call, lay, after, x.shape, call.out.shape)
    return Verdict(mirror(call.out, after))


@rearranging
def _slice(call: OpCall) -> Verdict:
    """aten.slice.Tensor(x, dim=0, start=None, end=None, step=1): ``x[:, start:end:step]``."""
    x, lay = call.args[0], call.arg_layouts[0]
    d = _norm_dim(call.arg(1, "dim", default=0), x.dim())
    start, end, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", default=1)
    index = (slice(None),) * d + (slice(start, end, step),)
    return _indexed(call, x, lay, index, None, None)


@rearranging
def _index(call: OpCall) -> Verdict:
    """aten.index.Tensor(x, [i0, None, i2]): ``x[i0, :, i2]`` (advanced indexing; None is a full slice)."""
    x, lay = call.args[0], call.arg_layouts[0]
    indices = list(call.arg(1, "indices"))
    layouts = list(call.layout(1, "indices") or [None] * len(indices))
    node_list = call.arg_node(1, "indices")
    nodes = list(node_list) if isinstance(node_list, (list, tuple)) else [None] * len(indices)
    index = tuple(slice(None) if i is None else i for i in indices)
    return _indexed(call, x, lay, index, tuple(layouts), tuple(nodes))


def _aten_batch_norm(call: OpCall) -> Verdict:
    """aten.batch_norm(x, weight, bias, running_mean, running_var, training, ...)."""
    as_functional = (call.args[0], call.arg(3, "running_mean"), call.arg(4, "running_var"), call.arg(1, "weight"),
                     call.arg(2, "bias"), call.arg(5, "training", default=False))
    return _batch_norm(dataclasses.replace(call, op=F.batch_norm, args=as_functional, kwargs={},
                                           arg_layouts=(call.arg_layouts[0],) + (None,) * 5, kwarg_layouts={}))


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # ATen's losses take their reduction as an int


def _aten_loss(call: OpCall) -> Verdict:
    """aten.cross_entropy_loss, nll_loss, mse_loss, ...: the loss rule, with the reduction as a word."""
    position = next(i for i, a in enumerate(call.op._schema.arguments) if a.name == "reduction")
    reduction = _REDUCTIONS.get(call.arg(position, "reduction", default=1), "mean")
    return _loss(dataclasses.replace(call, kwargs={**call.kwargs, "reduction": reduction}))


_LOSSES = ("cross_entropy_loss nll_loss nll_loss_nd nll_loss2d mse_loss l1_loss smooth_l1_loss huber_loss "
           "binary_cross_entropy binary_cross_entropy_with_logits kl_div soft_margin_loss margin_ranking_loss "
           "hinge_embedding_loss cosine_embedding_loss multilabel_margin_loss multi_margin_loss poisson_nll_loss").split()
register_batch_rule([getattr(aten, name).default for name in _LOSSES if hasattr(aten, name)])(_aten_loss)
register_batch_rule([aten.embedding.default])(_embedding)
register_batch_rule([aten.slice.Tensor])(_slice)
register_batch_rule([aten.index.Tensor, aten._unsafe_index.Tensor])(_index)
register_batch_rule([aten.batch_norm.default])(_aten_batch_norm)
register_batch_rule([aten.numpy_T.default])(rearranging(view("T")))  # x.T, as torch.export records it


# --------------------------------------------------------------------------------------------
# What the interpreter's facts see (x.size(d), torch.arange) in ATen graphs
# --------------------------------------------------------------------------------------------

_CANONICAL_FUNCTIONS = {"arange": torch.arange, "getitem": operator.getitem, "slice": operator.getitem}


def canonical_target(node: torch.fx.Node):
    """``(op, target)`` of the fx node an ATen node stands for, for the interpreter's facts:
    ``("call_method", "size")`` for ``aten.sym_size.int``, ``("call_function", torch.arange)`` for
    ``aten.arange.*``, ``("call_method", "<name>")`` for the other ATen ops; ``node``'s own otherwise."""
    name = aten_name(node.target) if node.op == "call_function" else None
    if name is None:
        return node.op, node.target
    if name in _CANONICAL_FUNCTIONS:
        return "call_function", _CANONICAL_FUNCTIONS[name]
    return "call_method", name
