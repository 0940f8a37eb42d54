"""Contractions: matmul, einsum, linear, bilinear, attention — labelled like einsum, checked in one place.

Each op's labeller names every operand dimension and the output's; :func:`contraction` then checks
that the batch label of every per-sample operand survives in the output (otherwise the op sums over
samples) and is the same label for all of them (otherwise it pairs every sample with every other).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from fxdp.layout import UNBATCHED_LAYOUT, UNKNOWN_LAYOUT, BatchLayout
from fxdp.passes.batch_rules.core import (
    _FIX_CONTRACT, _FIX_PAIR, BatchRule, OpCall, Verdict, _at, _dims, _fn, _keys, nn_layers, _norm_dim, _ordinal,
    mirror, carries_batch, register_batch_rule,
)


Labels = Tuple[Any, ...]
# call -> ([(operand, its layout, its labels), ...], output labels), or None when it cannot tell
Labeller = Callable[[OpCall], Optional[Tuple[List[Tuple[torch.Tensor, Any, Labels]], Labels]]]


def contraction(labeller: Labeller) -> BatchRule:
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
            if not carries_batch(lay):
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
# Registration
# --------------------------------------------------------------------------------------------

register_batch_rule(_keys("matmul", "mm", "bmm", "mv", "dot", "vdot")
                    + [operator.matmul, operator.imatmul])(contraction(_label_matmul))
register_batch_rule(_keys("addmm", "baddbmm", "addmv", "addbmm", "addr"))(contraction(_label_addmm))
register_batch_rule(_keys("outer", "ger"))(contraction(_label_outer))
register_batch_rule(_keys("inner"))(contraction(_label_inner))
register_batch_rule(_keys("einsum", methods=False))(contraction(_label_einsum))
register_batch_rule(_keys("tensordot", methods=False))(contraction(_label_tensordot))
register_batch_rule(_keys("cdist", methods=False))(contraction(_label_cdist))
# F.linear's rule, and nn.Linear's and transformers' Conv1D's (x @ weight + bias over the last dimension), which
# fxdp/layers/linear.py and fxdp/layers/transformers_conv1d.py register for those classes
linear_rule = contraction(_label_linear)
register_batch_rule(_fn("linear"))(linear_rule)
register_batch_rule(_fn("bilinear") + nn_layers("Bilinear"))(contraction(_label_bilinear))
register_batch_rule(_fn("scaled_dot_product_attention"))(contraction(_label_sdpa))
