"""The plans of a stock transformer block's layers (:mod:`fxdp.grad_sample.transformer`): its projections,
feed-forward layers and norms, each planned as the layer it is, from static shapes."""

from __future__ import annotations

from typing import Callable, List, Tuple

from torch import nn

from fxdp.grad_sample.transformer import in_projection


def _attention(m: nn.MultiheadAttention, name: str, n: int, length: int, rows: int, prefer, plan_layer) -> list:
    """``rows``: the positions the packed projection runs over (the query's alone in self-attention; the
    query's and the key's and value's one after another otherwise)."""
    e = m.embed_dim
    return [(f"{name}in_proj", plan_layer(in_projection(m), [(n, rows, e)], (n, rows, 3 * e), prefer)),
            (f"{name}out_proj", plan_layer(m.out_proj, [(n, length, e)], (n, length, e), prefer))]


def _layer(m: nn.Module, name: str, n: int, length: int, source: int, prefer, plan_layer) -> list:
    e, f = m.linear1.in_features, m.linear1.out_features
    plans = _attention(m.self_attn, f"{name}self_attn.", n, length, length, prefer, plan_layer)
    norms = 2
    if isinstance(m, nn.TransformerDecoderLayer):
        plans += _attention(m.multihead_attn, f"{name}multihead_attn.", n, length, length + source, prefer, plan_layer)
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


def plan_transformer(module: nn.Module, n: int, length: int, source: int, rows: int, prefer,
                     plan_layer: Callable) -> List[Tuple[str, object]]:
    """``(layer name inside the block, plan)`` for each layer of ``module`` with parameters, for a batch of
    ``n`` sequences of ``length`` positions (``source``: the memory's or the key's; ``rows``: the positions a
    lone attention's packed projection runs over)."""
    if isinstance(module, nn.MultiheadAttention):
        return _attention(module, "", n, length, rows, prefer, plan_layer)
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return _layer(module, "", n, length, source, prefer, plan_layer)
    plans = []
    for i, layer in enumerate(module.layers):
        plans += _layer(layer, f"layers.{i}.", n, length, source, prefer, plan_layer)
    if module.norm is not None and any(True for _ in module.norm.parameters()):
        e = module.layers[0].linear1.in_features
        plans.append(("norm", plan_layer(module.norm, [(n, length, e)], (n, length, e), prefer)))
    return plans
