"""Book-keeping of the normalisation layers with per-sample statistics (LayerNorm, RMSNorm, GroupNorm,
InstanceNorm): their per-sample gradients, ``(N, C)`` sums of ``g * x_hat`` and of ``g``
(:mod:`fxdp.grad_sample.norms`), are as small as their parameters, so they are formed by the layer's rule in
backward and read as they are. Small LayerNorms alike (shape, ``eps``) have them formed together, by one
``layer_norm`` over their stacked inputs (:class:`~fxdp.sinks.bookkeeping.lanes.LayerNormLane`)."""

from __future__ import annotations

import torch.nn.functional as F

from fxdp.grad_sample.norms import layer_norm_grad_sample
from fxdp.sinks.bookkeeping.lanes import LaneGradSamples, LayerNormLane, small
from fxdp.sinks.bookkeeping.registry import LayerBookkeeping, LayerPlan


class NormBookkeeping(LayerBookkeeping):
    def plan(self, module, a, g, prefer):
        return LayerPlan(type(module).__name__, "materialise",
                         "a norm layer: per-sample gradients from its rule, as small as its parameters")


class LayerNormBookkeeping(NormBookkeeping):
    rule = layer_norm_grad_sample
    forms_small_together = True

    def uses(self, captured, sink):
        module, a, g, scale = captured.module, captured.a, captured.g, captured.scale
        shape = tuple(module.normalized_shape)
        if not small(a, g) or a.shape != g.shape or a.dim() <= len(shape) or tuple(a.shape[-len(shape):]) != shape:
            return None  # its rule, alone
        given = {id(q) for q in captured.params}
        params = [p if p is not None and id(p) in given else None for p in (module.weight, module.bias)]
        # every member of a lane has the same parameters trainable: row k of the batched result is member k's
        key = ("layer_norm", a.shape, a.dtype, g.dtype, g.device, shape, module.eps, scale,
               tuple(p is not None for p in params))
        group = sink.lane(key, lambda: LayerNormLane(shape, module.eps, scale))
        index = group.add(a, g)
        lanes = (group.weights, group.biases)
        return {p: LaneGradSamples(lanes[k], a.shape[0], p.shape, row=group.row(k, index))
                for k, p in enumerate(params) if p is not None}

    def functional_forward(self, module, x):
        shape, eps = module.normalized_shape, module.eps
        return (lambda x, weight, bias: F.layer_norm(x, shape, weight, bias, eps)), (module.weight, module.bias)
