"""Normalisation layers that keep samples apart: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``,
``nn.InstanceNorm1d`` / ``2d`` / ``3d`` (BatchNorm, which mixes samples in training, has a batch rule only: the
one that refuses it, in :mod:`fxdp.passes.batch_rules.layers`).

- per-sample rules: :mod:`fxdp.grad_sample.norms` (the normalised input times the output gradient, summed);
- book-keeping: :class:`fxdp.sinks.bookkeeping.norms.LayerNormBookkeeping` (small layers' per-sample gradients
  formed together) and :class:`~fxdp.sinks.bookkeeping.norms.NormBookkeeping` (materialised through the rule: the
  parameters are small);
- batch rules: :mod:`fxdp.passes.batch_rules.layers` (``layer_norm_rule``, ``group_norm_rule``,
  ``instance_norm_rule``: each normalises within a sample; the lazy instance norms too).
"""

from torch import nn

from fxdp.grad_sample.norms import (group_norm_grad_sample, instance_norm_grad_sample, layer_norm_grad_sample,
                                    rms_norm_grad_sample)
from fxdp.layers.registration import register_layer
from fxdp.passes.batch_rules.layers import group_norm_rule, instance_norm_rule, layer_norm_rule
from fxdp.sinks.bookkeeping.norms import LayerNormBookkeeping, NormBookkeeping

_INSTANCE_NORMS = [nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d]
_MATERIALISED = NormBookkeeping()  # one registration for the norm layers materialised through their rule

register_layer(nn.LayerNorm, grad_sampler=layer_norm_grad_sample, bookkeeping=LayerNormBookkeeping,
               batch_rule=layer_norm_rule)
register_layer(nn.RMSNorm, grad_sampler=rms_norm_grad_sample, bookkeeping=_MATERIALISED, batch_rule=layer_norm_rule)
register_layer(nn.GroupNorm, grad_sampler=group_norm_grad_sample, bookkeeping=_MATERIALISED,
               batch_rule=group_norm_rule)
register_layer(_INSTANCE_NORMS, grad_sampler=instance_norm_grad_sample, bookkeeping=_MATERIALISED,
               batch_rule=instance_norm_rule)
register_layer([nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d], batch_rule=instance_norm_rule)
