"""Embeddings: ``nn.Embedding`` and ``nn.EmbeddingBag``.

- per-sample rules: :func:`fxdp.grad_sample.embedding.embedding_grad_sample` and
  :func:`~fxdp.grad_sample.embedding.embedding_bag_grad_sample` (each sample's output gradients summed into the
  rows it indexed);
- book-keeping: :class:`fxdp.sinks.bookkeeping.embedding.EmbeddingBookkeeping` for ``nn.Embedding`` (norms from
  index equality, no ``(N, V, D)`` tensor); ``nn.EmbeddingBag`` is materialised through its rule;
- batch rules: :data:`fxdp.passes.batch_rules.indexing.embedding_rule` and
  :data:`~fxdp.passes.batch_rules.indexing.embedding_bag_rule` (the batch of the indices is the output's).
"""

from torch import nn

from fxdp.grad_sample.embedding import embedding_bag_grad_sample, embedding_grad_sample
from fxdp.layers.registration import register_layer
from fxdp.passes.batch_rules.indexing import embedding_bag_rule, embedding_rule
from fxdp.sinks.bookkeeping.embedding import EmbeddingBookkeeping

register_layer(nn.Embedding, grad_sampler=embedding_grad_sample, bookkeeping=EmbeddingBookkeeping,
               batch_rule=embedding_rule)
register_layer(nn.EmbeddingBag, grad_sampler=embedding_bag_grad_sample, batch_rule=embedding_bag_rule)
