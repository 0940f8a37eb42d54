"""Which way each layer's per-sample norms are computed, chosen from static shapes (see the package)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import nn

from fxdp import meta
from fxdp.grad_sample.broadcast import added_parameter_sign, summed_dims
from fxdp.grad_sample.conv import conv_grad_sample
from fxdp.grad_sample.embedding import embedding_grad_sample
from fxdp.grad_sample.linear import is_transformers_conv1d, linear_grad_sample
from fxdp.grad_sample.recurrent import recurrent_rule_applies
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.grad_sample.transformer import batch_at, bind_block_call, inputs_fit, transformer_rule_applies
from fxdp.layout import BATCHED, BROADCAST, BatchLayout, parse_layout
from fxdp.sinks.bookkeeping.recurrent import plan_recurrent
from fxdp.sinks.bookkeeping.transformer import plan_transformer

METHODS = ("outer", "ghost", "per_sample", "index", "summed", "materialise")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's per-sample norms are computed, and why (costs are multiply-adds per sample)."""

    layer: str  # "Linear", "Conv2d", "Embedding", "LayerNorm", "generic", ...
    method: str  # one of METHODS
    reason: str
    ghost_cost: Optional[int] = None
    per_sample_cost: Optional[int] = None


def _own_rule(module: nn.Module, bases, rule) -> bool:
    """The built-in rule applies: the module is one of ``bases`` and keeps its forward, and nobody
    registered another rule for its type (then the book-keeping formulas may not describe it)."""
    bases = bases if isinstance(bases, tuple) else (bases,)
    return (
        isinstance(module, bases)
        and any(type(module).forward is b.forward for b in bases)
        and find_grad_sampler(module) is rule
    )


def _pick(layer: str, ghost: int, per_sample: int, prefer: Optional[str], what: str) -> LayerPlan:
    if prefer in ("ghost", "per_sample"):
        method, reason = prefer, f"{prefer} forced by the sink's method argument"
    elif ghost <= per_sample:
        method, reason = "ghost", f"{what}: ghost norm {ghost:,} <= per-sample gradient {per_sample:,} mult-adds/sample"
    else:
        method, reason = "per_sample", f"{what}: per-sample gradient {per_sample:,} < ghost norm {ghost:,} mult-adds/sample"
    return LayerPlan(layer, method, reason, ghost, per_sample)


def plan_layer(
    module: Optional[nn.Module],
    activation_shapes: Sequence[Sequence[int]],
    backprop_shape: Optional[Sequence[int]],
    prefer: Optional[str] = None,
) -> LayerPlan:
    """The norm method for ``module`` seeing batch-first inputs and output gradient of these shapes.

    Only shapes are read, so the compiler can call it with the shapes its batch_dim pass found.
    ``prefer`` ("ghost" / "per_sample") overrides the cost comparison for Linear and Conv layers.
    """
    if module is None:
        return LayerPlan("generic", "materialise", "functional use of parameters: the generic rule materialises")
    name = type(module).__name__
    if backprop_shape is None or not activation_shapes:
        return LayerPlan(name, "materialise", "no (A, G) pair delivered: the layer's rule materialises")
    a, g = list(activation_shapes[0]), list(backprop_shape)
    if recurrent_rule_applies(module):  # its projections, each a Linear layer on a sequence
        return LayerPlan(name, *plan_recurrent(module, a, prefer, plan_layer))
    linear = _own_rule(module, nn.Linear, linear_grad_sample)
    if linear or is_transformers_conv1d(module):  # Conv1D: a Linear layer with its weight stored (in, out)
        d_in, d_out = (module.in_features, module.out_features) if linear else tuple(module.weight.shape)
        if len(a) < 2 or a[:-1] != g[:-1] or a[-1] != d_in or g[-1] != d_out:
            return LayerPlan(name, "materialise", f"input {tuple(a)} / output gradient {tuple(g)} not (N, *, d) -> (N, *, p)")
        t = math.prod(a[1:-1])
        if t == 1:
            return LayerPlan(name, "outer", "input (N, d): ||a_i|| * ||g_i||")
        d, p = a[-1], g[-1]
        return _pick(name, t * t * (d + p), t * d * p, prefer, f"sequence T={t}, d={d}, p={p}")
    if _own_rule(module, _CONVS, conv_grad_sample):
        nd = len(module.kernel_size)
        if len(a) != nd + 2 or len(g) != nd + 2 or a[0] != g[0]:
            return LayerPlan(name, "materialise", f"input {tuple(a)} is not batched (N, C, *spatial)")
        length, k = math.prod(g[2:]), math.prod(module.kernel_size)
        groups = module.groups
        cin_g, cout_g = module.in_channels // groups, module.out_channels // groups
        ghost = length * cin_g * groups * k + groups * length * length * (cin_g * k + cout_g)  # unfold + grams
        per_sample = length * groups * cin_g * k * cout_g
        return _pick(name, ghost, per_sample, prefer, f"L={length}, C_in*k={cin_g * k}, C_out={cout_g}, groups={groups}")
    if _own_rule(module, nn.Embedding, embedding_grad_sample):
        if module.max_norm is not None:
            return LayerPlan(name, "materialise", "max_norm is set: the per-sample rule decides")
        if module.scale_grad_by_freq:
            return LayerPlan(name, "materialise", "scale_grad_by_freq: per-sample frequencies")
        if a + [module.embedding_dim] != g:
            return LayerPlan(name, "materialise", f"output gradient {tuple(g)} is not indices {tuple(a)} + (D,)")
        return LayerPlan(name, "index", "rows of equal index summed per sample (no dense per-sample gradient)")
    return LayerPlan(name, "materialise", "no book-keeping form: per-sample gradients from its rule (norm layers "
                                          "and the generic rule; their parameters are small)")


def plan_graph(gm: torch.fx.GraphModule, prefer: Optional[str] = None) -> List[Tuple[str, LayerPlan]]:
    """``(layer name, plan)`` for every layer call the per_sample pass made a DP-aware op, from the shapes
    the batch_dim pass recorded (compiled with example_inputs; ``[]`` without them). A layer called twice
    is listed twice; a functional use of parameters (the generic rule) is listed by its site's name."""
    source = getattr(gm, "fxdp_batch", None)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    if source is None or source.input_index >= len(placeholders):
        return []
    batch = placeholders[source.input_index].meta.get(meta.FAKE_VALUE)
    if not isinstance(batch, torch.Tensor):
        return []
    n = batch.shape[source.dim]
    plans = []
    for node in gm.graph.nodes:
        if meta.PER_SAMPLE_RULE not in node.meta or len(node.args) < 3 or node.args[0].op != "get_attr":
            continue  # functional uses of parameters: the generic rule, which always materialises
        try:
            module = gm.get_submodule(node.args[0].target)
        except AttributeError:  # a functional use (its first argument is its site, not a layer): generic rule
            site = getattr(gm, node.args[0].target, None)
            plan = _added_parameter_plan(gm, node, site, n) or plan_layer(None, [], None, prefer)
            if getattr(site, "description", ""):
                plan = dataclasses.replace(plan, reason=f"{site.description}: {plan.reason}")
            plans.append((str(getattr(site, "target", node.args[0].target)), plan))
            continue
        site = getattr(gm, node.args[1].target)
        if transformer_rule_applies(module):  # one plan per projection, feed-forward layer and norm
            parts = _transformer_plans(module, node, site, n, prefer)
            if parts is not None:
                plans += [(f"{node.args[0].target}.{name}", plan) for name, plan in parts]
                continue
        fakes = [a.meta.get(meta.FAKE_VALUE) if isinstance(a, torch.fx.Node) else None for a in node.args[3:]]
        out = node.meta.get(meta.FAKE_VALUE)
        if isinstance(out, (tuple, list)):  # (output, state) of a recurrent layer: the output's shape
            out = next(iter(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        try:
            ins = [site.in_layout(i).to_batch_first(torch.empty(t.shape, device="meta"), n).shape
                   for i, t in enumerate(t for t in fakes if isinstance(t, torch.Tensor))]
            g = parse_layout(site.out_layouts[0]).to_batch_first(torch.empty(out.shape, device="meta"), n).shape
        except Exception:  # shapes not recorded: the sink decides on the first batch (BookkeepingSink.plans)
            continue
        plans.append((node.args[0].target, plan_layer(module, ins, g, prefer)))
    return plans


def _fake_shape(value) -> Optional[tuple]:
    fake = value.meta.get(meta.FAKE_VALUE) if isinstance(value, torch.fx.Node) else None
    return tuple(fake.shape) if isinstance(fake, torch.Tensor) else None


def _transformer_plans(module: nn.Module, node: torch.fx.Node, site, n: int, prefer):
    """The plans of a stock transformer block's layers, when the block will be decomposed (its inputs as
    :func:`~fxdp.grad_sample.transformer.inputs_fit` asks); else None."""
    args, kwargs = node.args[3:], node.kwargs
    given = bind_block_call(module, args, kwargs)
    tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if _fake_shape(a) is not None]
    try:
        layouts = {a: site.in_layout(k) for k, a in enumerate(tensors)}
    except Exception:  # layouts not recorded: the sink decides on the first batch
        return None
    # inputs broadcast over the batch are expanded to it before the block runs
    layouts = {a: BatchLayout.at(lay.dim) if lay.kind == BROADCAST else lay for a, lay in layouts.items()}
    shapes = {a: tuple(n if layouts[a].kind == BATCHED and d == layouts[a].dim else size
                       for d, size in enumerate(_fake_shape(a))) for a in tensors}
    if given is None or not inputs_fit(module, given, shapes.get, layouts.__getitem__, n):
        return None
    seq = 1 - batch_at(module)
    first = next(given[k] for k in ("query", "src", "tgt") if k in given)
    other = next((given[k] for k in ("key", "memory") if k in given), first)
    length, source = shapes[first][seq], shapes[other][seq]
    rows = length if given.get("key", first) is first and given.get("value", first) is first else (
        length + source if given.get("key") is given.get("value") else length + 2 * source)
    return plan_transformer(module, n, length, source, rows, prefer, plan_layer)


def _added_parameter_plan(gm: torch.fx.GraphModule, node: torch.fx.Node, site, n: int) -> Optional[LayerPlan]:
    """``x + p`` / ``x - p`` for one trainable parameter ``p`` broadcast against per-sample data: its per-sample
    gradient is the output gradient summed over p's broadcast dimensions (as the runtime forms it)."""
    operands = node.args[2:]
    params = []
    for i, a in enumerate(operands):
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            try:
                params.append((i, gm.get_parameter(a.target)))
            except AttributeError:
                pass
    params = [(i, p) for i, p in params if p.requires_grad]
    out, lay = _fake_shape(node), parse_layout(site.out_layouts[0]) if getattr(site, "out_layouts", None) else None
    if len(params) != 1 or out is None or lay is None or lay.kind != BATCHED or out[lay.dim] != n:
        return None
    position, param = params[0]
    sign = added_parameter_sign(site.fn, position, len(operands), bool(node.kwargs))
    if sign is None or _fake_shape(operands[1 - position]) is None or summed_dims(out, lay.dim, param.shape) is None:
        return None
    what = "subtracted from" if sign < 0 else "added to"
    return LayerPlan("parameter", "summed", f"{what} per-sample data: its per-sample gradient is the output "
                                            "gradient summed over the dimensions it is broadcast along")


def describe_plans(plans: Iterable[Tuple[str, LayerPlan]]) -> List[str]:
    """One line per layer for a report: ``"book-keeping: 'fc1' (Linear): outer (input (N, d): ...)"``."""
    return [f"book-keeping: '{name}' ({plan.layer}): {plan.method} ({plan.reason})" for name, plan in plans]
