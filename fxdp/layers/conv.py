"""Convolutions: ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d``, and the batch rule of every torch convolution layer.

- per-sample rule: :func:`fxdp.grad_sample.conv.conv_grad_sample` (the convolution backward kernel with the batch
  folded into the groups);
- book-keeping: :class:`fxdp.sinks.bookkeeping.conv.ConvBookkeeping` (the weight as a Linear layer on the unfolded
  input: ghost norm or per-sample gradient, whichever costs less; the bias as G summed over the positions);
- batch rule: :data:`fxdp.passes.batch_rules.layers.conv_rule` (mixes channels and space, keeps the batch in
  front), also for the transposed and lazy convolutions, which have no per-sample rule of their own (the graph
  engine gives them the generic rule).
"""

from torch import nn

from fxdp.grad_sample.conv import conv_grad_sample
from fxdp.layers.registration import register_layer
from fxdp.passes.batch_rules.core import nn_family
from fxdp.passes.batch_rules.layers import conv_rule
from fxdp.sinks.bookkeeping.conv import ConvBookkeeping

register_layer([nn.Conv1d, nn.Conv2d, nn.Conv3d], grad_sampler=conv_grad_sample, bookkeeping=ConvBookkeeping,
               batch_rule=conv_rule)
register_layer(nn_family(nn.modules.conv._ConvNd), batch_rule=conv_rule)  # ConvTranspose*, LazyConv*, ...
