"""Rules for the functions torchvision's classification models call (EfficientNet, ConvNeXt, Swin).

torchvision marks them with ``torch.fx.wrap``, so the graph calls them whole; fxdp does not import
torchvision, so they are registered by their dotted names (:func:`register_batch_rule` accepts them).

- ``stochastic_depth(x, p, mode, training)``: ``x`` times a random mask, one entry per row of dim 0
  (``mode="row"``) or one for the whole batch (``"batch"``), scaled by ``1/(1-p)``; the identity when
  ``p == 0`` or not training. Elementwise, so samples stay apart whatever the mask; the per-sample
  gradients come from the one backward that used this mask (random ops are only a problem where a
  sample is re-run alone, in the generic rule, which says so).
- ``shifted_window_attention(x, qkv_weight, proj_weight, relative_position_bias, ...)``: Swin's
  attention inside windows of one image; ``x`` is ``(B, H, W, C)`` and dim 0 is the batch.
- ``_patch_merging_pad(x)``: pads and regroups the last three dims ``(H, W, C)`` of each image.
- ``_get_relative_position_bias(table, index, window_size)``: indexes a parameter table by a constant
  buffer; no per-sample data flows in (the per_sample pass folds it into the attention's site).
"""

from __future__ import annotations

from fxdp.diagnostics.naming import name_op
from fxdp.layout import BATCHED, UNBATCHED_LAYOUT, UNKNOWN_LAYOUT
from fxdp.passes.batch_rules.core import (
    OpCall, Verdict, _FIX_LAYER, keeps_layout, mirror, carries_batch, register_batch_rule,
)

_STOCHASTIC_DEPTH = "torchvision.ops.stochastic_depth.stochastic_depth"
_WINDOW_ATTENTION = "torchvision.models.swin_transformer.shifted_window_attention"
_PATCH_MERGING_PAD = "torchvision.models.swin_transformer._patch_merging_pad"
_RELATIVE_POSITION_BIAS = "torchvision.models.swin_transformer._get_relative_position_bias"

name_op(_STOCHASTIC_DEPTH, "torchvision.ops.stochastic_depth")
for _path in (_WINDOW_ATTENTION, _PATCH_MERGING_PAD, _RELATIVE_POSITION_BIAS):
    name_op(_path, _path)


def _stochastic_depth(call: OpCall) -> Verdict:
    # the mask is per row of dim 0 or shared: multiplying by it never combines two samples
    return keeps_layout(call)


def _images_first(what: str, image_dims: int):
    """Ops that treat dim 0 as the batch and mix the last ``image_dims`` dims of each image."""

    def rule(call: OpCall) -> Verdict:
        x, lay = call.args[0], call.arg_layouts[0]
        if not carries_batch(lay):
            return Verdict(mirror(call.out, UNBATCHED_LAYOUT))
        others = [o for _, o in call.operands()[1:] if carries_batch(o)]
        if others:
            return Verdict(mirror(call.out, UNKNOWN_LAYOUT))  # per-sample weights or biases: no rule
        if lay.kind == BATCHED and lay.dim == 0 and x.dim() > image_dims:
            return Verdict(mirror(call.out, lay))
        return Verdict(mirror(call.out, lay), fix=_FIX_LAYER,
                       mixes=f"{what} treats dim 0 as the batch and combines the last {image_dims} dims, "
                             f"but the batch sits in {lay}: samples are combined with each other")

    return rule


register_batch_rule(_STOCHASTIC_DEPTH)(_stochastic_depth)
register_batch_rule(_WINDOW_ATTENTION)(_images_first("Swin's window attention", 3))
register_batch_rule(_PATCH_MERGING_PAD)(_images_first("Swin's patch merging", 3))
register_batch_rule(_RELATIVE_POSITION_BIAS)(keeps_layout)
