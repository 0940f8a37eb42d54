"""Hugging Face transformers' ``Conv1D`` (GPT-2's projections): ``x @ weight + bias`` with the weight stored
``(in, out)``, a Linear layer with its weight transposed. Registered by class path: the registrations take effect
once ``transformers.pytorch_utils`` is imported, and fxdp never imports transformers.

- per-sample rule: :func:`fxdp.grad_sample.linear.transformers_conv1d_grad_sample`;
- book-keeping: :class:`fxdp.sinks.bookkeeping.transformers_conv1d.TransformersConv1DBookkeeping` (a Linear
  layer's, with A and G swapped);
- batch rule: :data:`fxdp.passes.batch_rules.contractions.linear_rule`, as ``nn.Linear``.
"""

from fxdp.grad_sample.linear import transformers_conv1d_grad_sample
from fxdp.layers.registration import register_layer
from fxdp.passes.batch_rules.contractions import linear_rule
from fxdp.sinks.bookkeeping.transformers_conv1d import TransformersConv1DBookkeeping

register_layer(by_path="transformers.pytorch_utils.Conv1D", grad_sampler=transformers_conv1d_grad_sample,
               bookkeeping=TransformersConv1DBookkeeping, batch_rule=linear_rule)
