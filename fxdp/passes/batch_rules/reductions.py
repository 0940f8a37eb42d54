"""Reductions (sum, mean, max, norm, ...) and ops along a dimension (softmax, cumsum, sort, flip, ...).

Reducing over the batch dimension, or working along it, makes each result depend on every sample:
that is mixing. Reducing other dimensions moves the batch left by the number of reduced dims before
it (unless ``keepdim``).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from fxdp.layout import BATCHED, BROADCAST, MERGED, UNBATCHED_LAYOUT, BatchLayout
from fxdp.passes.batch_rules.core import (
    _FIX_ALONG, _FIX_PAIR, _FIX_REDUCE, BatchRule, OpCall, Verdict, _at, _dims, _first_tensor, _fn, _keys,
    nn_layers, _where, mirror, carries_batch, register_batch_rule,
)
from fxdp.passes.batch_rules.elementwise import _combine, elementwise


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
        if carries_batch(lay):
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
    if carries_batch(lay) and lay.dim in tuple(dims):
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
# Registration
# --------------------------------------------------------------------------------------------

_REDUCTIONS = (
    "sum mean nansum nanmean prod amax amin all any logsumexp argmax argmin max min median nanmedian mode "
    "std var std_mean var_mean count_nonzero"
).split()
_LINALG = (torch.linalg,)

# reductions (the dim is argument 1, except where noted)
register_batch_rule(_keys(*_REDUCTIONS))(reduction(1))
register_batch_rule(_keys("norm", "quantile", "nanquantile"))(reduction(2))
register_batch_rule(_keys("norm", "vector_norm", methods=False, namespaces=_LINALG))(reduction(2))
register_batch_rule(_keys("matrix_norm", methods=False, namespaces=_LINALG))(reduction(2, default=(-2, -1)))
register_batch_rule(_keys("aminmax"))(reduction(None))
register_batch_rule(_keys("kthvalue"))(reduction(2))
register_batch_rule(_keys("trace", "dist"))(reduction(None))
register_batch_rule(_fn("cosine_similarity") + [torch.cosine_similarity])(_binary_reduction(2, 1))
register_batch_rule(_fn("pairwise_distance") + [torch.pairwise_distance])(_binary_reduction(None, -1))
register_batch_rule(nn_layers("CosineSimilarity", "PairwiseDistance"))(_module_reduction)
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
register_batch_rule(nn_layers("Softmax", "LogSoftmax", "Softmin"))(_module_along("dim", None))
register_batch_rule(nn_layers("Softmax2d"))(_module_along("", -3))
register_batch_rule(nn_layers("GLU"))(_module_along("dim", -1))
register_batch_rule(nn_layers("LocalResponseNorm"))(_module_along("", 1))
