"""Attention and transformer blocks: ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` /
``nn.TransformerDecoderLayer``, their stacks ``nn.TransformerEncoder`` / ``nn.TransformerDecoder``, and
``nn.Transformer`` (batch rule only: the graph engine traces into it, down to the blocks).

- per-sample rule: none of the block's own. The graph engine runs a stock block as torch runs it
  (:mod:`fxdp.grad_sample.transformer`), each projection, feed-forward layer and norm a DP-aware call with its own
  layer's rule (the packed query/key/value projection a Linear view, ``InProjection``); the hooks engine gives the
  block the generic rule;
- book-keeping: :class:`fxdp.sinks.bookkeeping.transformer.TransformerBlockBookkeeping` (the block planned, for the
  report, as its inner layers);
- batch rules: :data:`fxdp.passes.batch_rules.layers.multihead_attention_rule` and
  :data:`~fxdp.passes.batch_rules.layers.transformer_layer_rule` (attention along the sequence: the batch must be
  where ``batch_first`` says).

``DPMultiheadAttention`` (:mod:`fxdp.layers.attention`) is ``nn.MultiheadAttention`` and is served by these.
"""

from torch import nn

from fxdp.grad_sample.transformer import BLOCKS
from fxdp.layers.registration import register_layer
from fxdp.passes.batch_rules.layers import multihead_attention_rule, transformer_layer_rule
from fxdp.sinks.bookkeeping.transformer import TransformerBlockBookkeeping

_BLOCKS = TransformerBlockBookkeeping()  # one registration for every block

register_layer(nn.MultiheadAttention, bookkeeping=_BLOCKS, batch_rule=multihead_attention_rule)
register_layer([b for b in BLOCKS if b is not nn.MultiheadAttention], bookkeeping=_BLOCKS,
               batch_rule=transformer_layer_rule)
register_layer(nn.Transformer, batch_rule=transformer_layer_rule)
