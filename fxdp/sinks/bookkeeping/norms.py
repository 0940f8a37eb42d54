"""Book-keeping of the normalisation layers with per-sample statistics (LayerNorm, RMSNorm, GroupNorm,
InstanceNorm): their per-sample gradients, ``(N, C)`` sums of ``g * x_hat`` and of ``g``
(:mod:`fxdp.grad_sample.norms`), are as small as their parameters, so they are formed by the layer's rule in
backward and read as they are."""

from __future__ import annotations

from torch import nn

from fxdp.sinks.bookkeeping.registry import LayerBookkeeping, LayerPlan, register_bookkeeping


@register_bookkeeping([nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                       nn.InstanceNorm3d])
class NormBookkeeping(LayerBookkeeping):
    def plan(self, module, a, g, prefer):
        return LayerPlan(type(module).__name__, "materialise",
                         "a norm layer: per-sample gradients from its rule, as small as its parameters")
