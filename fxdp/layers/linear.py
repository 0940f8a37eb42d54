"""``nn.Linear``: ``x @ W^T + b`` over the last dimension, any leading dimensions.

- per-sample rule: :func:`fxdp.grad_sample.linear.linear_grad_sample` (``g_i a_i^T``, summed over the positions);
- book-keeping: :class:`fxdp.sinks.bookkeeping.linear.LinearBookkeeping` (``outer`` on ``(N, d)``, ghost norm or
  per-sample gradient on sequences, whichever costs less);
- batch rule: :data:`fxdp.passes.batch_rules.contractions.linear_rule` (a contraction over the last dimension;
  ``nn.LazyLinear`` too, which becomes an ``nn.Linear`` at its first call).
"""

from torch import nn

from fxdp.grad_sample.linear import linear_grad_sample
from fxdp.layers.registration import register_layer
from fxdp.passes.batch_rules.contractions import linear_rule
from fxdp.sinks.bookkeeping.linear import LinearBookkeeping

register_layer(nn.Linear, grad_sampler=linear_grad_sample, bookkeeping=LinearBookkeeping, batch_rule=linear_rule)
register_layer(nn.LazyLinear, batch_rule=linear_rule)
