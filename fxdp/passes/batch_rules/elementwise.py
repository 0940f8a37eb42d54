"""Elementwise and broadcasting ops, tensors made from sizes (factories), and the out-of-place
helpers the inplace pass writes into graphs.

Broadcasting keeps each operand's batch at its right-aligned place; two operands whose batches land
on different output dims pair sample i with sample j (mixing). A factory's output is batched where
one of its sizes is the batch size ``x.size(b)``.
"""

from __future__ import annotations

import operator
from typing import Dict, Optional

import torch
import torch.fx

from fxdp.runtime import inplace_ops as out_of_place
from fxdp.layout import BROADCAST, UNBATCHED_LAYOUT, UNKNOWN_LAYOUT, BatchLayout
from fxdp.passes.batch_rules.core import (
    _FIX_PAIR, OpCall, Verdict, _at, _first_tensor, _fn, _keys, nn_layers, _ordinal, find_batch_rule,
    keeps_layout, mirror, carries_batch, rearranging, register_batch_rule,
)


def _combine(operands, ndim: int):
    """Layouts of broadcasting operands aligned to an ``ndim`` output: (layout, conflict message)."""
    found: Dict[BatchLayout, int] = {}
    broadcast = None
    for i, (t, lay) in enumerate(operands):
        if not isinstance(lay, BatchLayout):
            continue
        shift = ndim - t.dim()
        if carries_batch(lay):
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
            return Verdict(mirror(call.out, like if carries_batch(like) else UNBATCHED_LAYOUT))
    position = _batch_size_position(call, start)
    return Verdict(mirror(call.out, UNBATCHED_LAYOUT if position is None else BatchLayout.at(position)))


def _arange(call: OpCall) -> Verdict:
    """torch.arange(N) with N = x.size(b) is each sample's own index: batched, and an identity index."""
    if call.node is not None and call.node in call.facts.sample_index:
        return Verdict(BatchLayout.at(0))
    return Verdict(UNBATCHED_LAYOUT)


def _constant(call: OpCall) -> Verdict:
    return Verdict(mirror(call.out, UNBATCHED_LAYOUT))


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
# Registration
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
_INPLACE = [n + "_" for n in _UNARY + _BINARY] + (
    "copy_ fill_ zero_ normal_ uniform_ exponential_ random_ masked_fill_ requires_grad_ detach_ clamp_ clip_"
).split()
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

register_batch_rule(_keys(*_UNARY, *_BINARY, *_INPLACE) + _fn(*_F_ELEMENTWISE) + _OPERATORS
                    + _keys(*_SPECIAL, methods=False, namespaces=(torch.special,)))(elementwise)
register_batch_rule(_keys(*_IDENTITY))(rearranging(lambda call: keeps_layout(call)))
register_batch_rule(nn_layers(*_ACTIVATION_LAYERS))(elementwise)
register_batch_rule(_fn("one_hot"))(keeps_layout)  # appends a class dimension
# tensors made from sizes, not from data
register_batch_rule(_keys(*_FACTORIES, methods=False) + ["new_zeros", "new_ones", "new_empty", "new_full"]
                    + _NEW_METHODS)(_factory)
register_batch_rule(["new_tensor", torch.Tensor.new_tensor, torch.tril_indices, torch.triu_indices])(_constant)
register_batch_rule([torch.arange])(_arange)
# the out-of-place helpers the inplace pass writes into graphs (index_assign: with indexing)
register_batch_rule([out_of_place.copy_into])(elementwise)
register_batch_rule([out_of_place.random_like, torch.fill])(keeps_layout)
register_batch_rule([out_of_place.apply_out_of_place])(_apply_out_of_place)
