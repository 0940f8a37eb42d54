"""Layers and their functional forms: convolution, pooling, resampling, padding, normalisation,
losses, recurrent and attention layers.

Most treat the leading dimensions as independent and mix the rest (:func:`mixes_from`): the batch
must sit in front of the dimensions they mix. Batch norm mixes samples when it uses batch
statistics; a loss with a reduction other than ``"none"`` combines all samples; recurrent and
attention layers need the batch where ``batch_first`` says it is.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from fxdp.layout import UNBATCHED_LAYOUT, UNKNOWN_LAYOUT, BatchLayout
from fxdp.passes.batch_rules.core import (
    _FIX_ALONG, _FIX_BATCHNORM, _FIX_CAT, _FIX_LAYER, _FIX_LOSS, OpCall, Verdict, _at, _first_tensor, _fn,
    nn_family, _keys, nn_layers, _where, carries_batch, keeps_layout, mirror, mixes_from, register_batch_rule,
    tensor_pairs,
)


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


conv_rule = mixes_from(_conv_k, "mixes its channel and spatial dimensions")
_POOL = mixes_from(_pool_k, "pools over its spatial dimensions")
_SPATIAL = mixes_from(lambda c, x: 2, "resamples its spatial dimensions")
layer_norm_rule = mixes_from(_layer_norm_k, "normalises over its last dimensions", fix=_FIX_ALONG)
group_norm_rule = mixes_from(lambda c, x: 1, "normalises over channels and space per sample", fix=_FIX_LAYER)
instance_norm_rule = mixes_from(_instance_norm_k, "normalises over its spatial dimensions", fix=_FIX_LAYER)
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
    if batch_stats and carries_batch(lay) and lay.dim != 1:  # statistics are over every dim but dim 1
        return Verdict(mirror(call.out, lay), fix=_FIX_BATCHNORM,
                       mixes="batch norm in training mode normalises with the mean and variance of the "
                             "whole batch: each sample's output depends on all the others")
    return keeps_layout(call)


def _pad(call: OpCall) -> Verdict:
    x, lay = call.args[0], call.arg_layouts[0]
    pad = tuple(call.module.padding) if call.module is not None else tuple(call.arg(1, "pad"))
    padded = {x.dim() - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}
    if carries_batch(lay) and any(padded.get(lay.dim, (0, 0))):
        return Verdict(mirror(call.out, UNKNOWN_LAYOUT), fix=_FIX_CAT,
                       mixes=f"pads the batch dimension ({_where(lay)}) with {padded[lay.dim]} rows "
                             "that are not samples")
    return keeps_layout(call)


# --------------------------------------------------------------------------------------------
# Losses, sequence layers, attention layers
# --------------------------------------------------------------------------------------------


def _loss(call: OpCall) -> Verdict:
    reduction = call.module.reduction if call.module is not None else call.kwargs.get("reduction", "mean")
    pairs = [(t, lay) for t, lay in call.operands() if carries_batch(lay)]
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
    if t is None or not carries_batch(lay):
        return ""
    if batch_at is None or lay.dim != batch_at:
        role = "sequence" if lay.dim == seq_at else "feature"
        where = "an unbatched input" if batch_at is None else f"dim {batch_at}"
        return (f"receives its {name} with the batch in dim {lay.dim}, which the layer treats as the {role} "
                f"dimension (it expects the batch in {where}): samples are combined with each other")
    return ""


def rnn_rule(call: OpCall) -> Verdict:
    """nn.LSTM / nn.GRU / nn.RNN: the recurrence runs along the time dimension."""
    m = call.module
    x, lay = call.args[0], call.arg_layouts[0]
    if not isinstance(x, torch.Tensor):
        return Verdict(mirror(call.out, UNKNOWN_LAYOUT))  # PackedSequence
    batch_at, seq_at = ((0, 1) if m.batch_first else (1, 0)) if x.dim() == 3 else (None, 0)
    why = _sequence_check(call, "input", x, lay, batch_at, seq_at)
    hx, hx_lay = call.arg(1, "hx"), call.layout(1, "hx")
    for t, tl in tensor_pairs(hx, hx_lay):
        why = why or _sequence_check(call, "initial state", t, tl, 1 if t.dim() == 3 else None, None)
    fix = "Pass batch_first=True for batch-first inputs (or transpose the input to (T, N, ...))."
    per = carries_batch(lay) or any(carries_batch(tl) for _, tl in tensor_pairs(hx, hx_lay))
    if not per:
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    kind = lay if carries_batch(lay) else BatchLayout.at(batch_at or 0)
    out, state = call.out
    layout = (_at(kind, batch_at) if batch_at is not None else kind,
              mirror(state, BatchLayout.at(1) if batch_at is not None else UNBATCHED_LAYOUT))
    return Verdict(layout, mixes=why, fix=fix if why else "")


def rnn_cell_rule(call: OpCall) -> Verdict:
    return _FEATURES(call)


def multihead_attention_rule(call: OpCall) -> Verdict:
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
        if carries_batch(lay) and kind is None:
            kind = lay
    fix = "Pass batch_first=True for batch-first inputs (or transpose them to (T, N, E))."
    if kind is None:
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    q = call.arg(0, "query")
    main = _at(kind, batch_at) if q.dim() == 3 else kind
    weights = call.out[1]
    layout = (main, BatchLayout.at(0) if isinstance(weights, torch.Tensor) else None)
    return Verdict(layout, mixes=why, fix=fix if why else "")


def transformer_layer_rule(call: OpCall) -> Verdict:
    """nn.TransformerEncoderLayer & co.: attention along the sequence dimension."""
    m = call.module
    batch_at, seq_at = (0, 1) if _batch_first(m) else (1, 0)
    # the sequences: the first two positional arguments (src/tgt, memory/tgt) or their keywords
    pairs = list(tensor_pairs(call.args[:2], call.arg_layouts[:2]))
    for name in ("src", "tgt", "memory"):
        if name in call.kwargs:
            pairs.extend(tensor_pairs(call.kwargs[name], call.kwarg_layouts.get(name)))
    why = ""
    kind = None
    for t, lay in pairs:
        b = batch_at if t.dim() == 3 else None
        why = why or _sequence_check(call, "input", t, lay, b, seq_at if t.dim() == 3 else 0)
        if carries_batch(lay) and kind is None:
            kind = lay
    if kind is None:
        return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
    main = _at(kind, batch_at) if _first_tensor(call.out).dim() == 3 else kind
    return Verdict(mirror(call.out, main), mixes=why,
                   fix="Pass batch_first=True for batch-first inputs (or transpose them to (T, N, E))." if why else "")


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------

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
    "multilabel_margin_loss multilabel_soft_margin_loss multi_margin_loss ctc_loss triplet_margin_with_distance_loss"
).split()
_CONVS = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")

# convolution, pooling, resampling
register_batch_rule(_keys(*_CONVS, methods=False, functional=True))(conv_rule)
register_batch_rule(_keys(*_POOLS, methods=False, functional=True)
                    + _fn("max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices")
                    + nn_layers(*_POOL_LAYERS))(_POOL)
register_batch_rule(_fn("interpolate", "upsample", "upsample_nearest", "upsample_bilinear")
                    + nn_layers("Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"))(_SPATIAL)
register_batch_rule(_keys("pixel_shuffle", "pixel_unshuffle", methods=False, functional=True)
                    + nn_layers("PixelShuffle", "PixelUnshuffle"))(_PIXEL)
register_batch_rule(_fn("unfold", "fold", "grid_sample", "affine_grid", "channel_shuffle")
                    + nn_layers("Unfold", "Fold", "ChannelShuffle"))(_PER_SAMPLE_ROWS)
register_batch_rule(_fn("pad") + nn_layers(*_PAD_LAYERS))(_pad)
# normalisation
register_batch_rule(_fn("layer_norm", "rms_norm"))(layer_norm_rule)
register_batch_rule(_fn("group_norm"))(group_norm_rule)
register_batch_rule(_fn("instance_norm"))(instance_norm_rule)
register_batch_rule(_fn("batch_norm") + nn_family(nn.modules.batchnorm._BatchNorm))(_batch_norm)
# losses (every nn loss derives from _Loss)
register_batch_rule(_fn(*_LOSSES) + nn_family(nn.modules.loss._Loss))(_loss)
# The layer classes of the families with parameters get their rules (conv_rule, layer_norm_rule, group_norm_rule,
# instance_norm_rule, rnn_rule, rnn_cell_rule, multihead_attention_rule, transformer_layer_rule) in their family's
# module, beside their per-sample rule and book-keeping: fxdp/layers/<family>.py.
