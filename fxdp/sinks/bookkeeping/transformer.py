"""Book-keeping of stock transformer blocks (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` /
``DecoderLayer`` and their stacks): the block runs as torch runs it, each of its projections, feed-forward
layers and norms a DP-aware call of its own (:mod:`fxdp.grad_sample.transformer`), so backward delivers one
capture per inner layer (the packed query/key/value projection as a Linear layer, ``InProjection``), each
book-kept as the layer it is. For the compile report the block is planned as those layers, from static
shapes."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from fxdp.grad_sample.transformer import (batch_at, bind_block_call, in_projection, inputs_fit,
                                          transformer_rule_applies)
from fxdp.layout import BATCHED, BROADCAST, BatchLayout
from fxdp.sinks.bookkeeping.plans import fake_shape, plan_layer
from fxdp.sinks.bookkeeping.registry import LayerBookkeeping, LayerPlan


def _attention(m: nn.MultiheadAttention, name: str, n: int, length: int, rows: int, prefer) -> list:
    """``rows``: the positions the packed projection runs over (the query's alone in self-attention; the
    query's and the key's and value's one after another otherwise)."""
    e = m.embed_dim
    return [(f"{name}in_proj", plan_layer(in_projection(m), [(n, rows, e)], (n, rows, 3 * e), prefer)),
            (f"{name}out_proj", plan_layer(m.out_proj, [(n, length, e)], (n, length, e), prefer))]


def _layer(m: nn.Module, name: str, n: int, length: int, source: int, prefer) -> list:
    e, f = m.linear1.in_features, m.linear1.out_features
    plans = _attention(m.self_attn, f"{name}self_attn.", n, length, length, prefer)
    norms = 2
    if isinstance(m, nn.TransformerDecoderLayer):
        plans += _attention(m.multihead_attn, f"{name}multihead_attn.", n, length, length + source, prefer)
        norms = 3
    plans.append((f"{name}linear1", plan_layer(m.linear1, [(n, length, e)], (n, length, f), prefer)))
    if isinstance(m.activation, nn.Module) and any(True for _ in m.activation.parameters()):
        plans.append((f"{name}activation", plan_layer(m.activation, [(n, length, f)], (n, length, f), prefer)))
    plans.append((f"{name}linear2", plan_layer(m.linear2, [(n, length, f)], (n, length, e), prefer)))
    for k in range(1, norms + 1):
        norm = getattr(m, f"norm{k}")
        if any(True for _ in norm.parameters()):
            plans.append((f"{name}norm{k}", plan_layer(norm, [(n, length, e)], (n, length, e), prefer)))
    return plans


def plan_transformer(module: nn.Module, n: int, length: int, source: int, rows: int,
                     prefer) -> List[Tuple[str, LayerPlan]]:
    """``(layer name inside the block, plan)`` for each layer of ``module`` with parameters, for a batch of
    ``n`` sequences of ``length`` positions (``source``: the memory's or the key's; ``rows``: the positions a
    lone attention's packed projection runs over)."""
    if isinstance(module, nn.MultiheadAttention):
        return _attention(module, "", n, length, rows, prefer)
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return _layer(module, "", n, length, source, prefer)
    plans = []
    for i, layer in enumerate(module.layers):
        plans += _layer(layer, f"layers.{i}.", n, length, source, prefer)
    if module.norm is not None and any(True for _ in module.norm.parameters()):
        e = module.layers[0].linear1.in_features
        plans.append(("norm", plan_layer(module.norm, [(n, length, e)], (n, length, e), prefer)))
    return plans


class TransformerBlockBookkeeping(LayerBookkeeping):
    def applies(self, module):
        return transformer_rule_applies(module)

    def graph_plans(self, module, gm, node, site, n, prefer):
        """The plans of the block's layers, when the block will be decomposed (its inputs as
        :func:`~fxdp.grad_sample.transformer.inputs_fit` asks); else None."""
        args, kwargs = node.args[3:], node.kwargs
        given = bind_block_call(module, args, kwargs)
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if fake_shape(a) is not None]
        try:
            layouts = {a: site.in_layout(k) for k, a in enumerate(tensors)}
        except Exception:  # layouts not recorded: the sink decides on the first batch
            return None
        # inputs broadcast over the batch are expanded to it before the block runs
        layouts = {a: BatchLayout.at(lay.dim) if lay.kind == BROADCAST else lay for a, lay in layouts.items()}
        shapes = {a: tuple(n if layouts[a].kind == BATCHED and d == layouts[a].dim else size
                           for d, size in enumerate(fake_shape(a))) for a in tensors}
        if given is None or not inputs_fit(module, given, shapes.get, layouts.__getitem__, n):
            return None
        seq = 1 - batch_at(module)
        first = next(given[k] for k in ("query", "src", "tgt") if k in given)
        other = next((given[k] for k in ("key", "memory") if k in given), first)
        length, source = shapes[first][seq], shapes[other][seq]
        rows = length if given.get("key", first) is first and given.get("value", first) is first else (
            length + source if given.get("key") is given.get("value") else length + 2 * source)
        return plan_transformer(module, n, length, source, rows, prefer)
