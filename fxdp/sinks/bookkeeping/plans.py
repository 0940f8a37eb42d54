"""Which way each layer's per-sample norms are computed, chosen from static shapes by the layer type's
registration (:mod:`~fxdp.sinks.bookkeeping.registry`): per capture (:func:`plan_layer`, what the sink does)
and per call of a compiled graph (:func:`plan_graph`, what the compile report shows)."""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import nn

from fxdp import meta
from fxdp.sinks.bookkeeping.registry import (NO_FORM, LayerBookkeeping, LayerPlan, find_bookkeeping,
                                             find_function_bookkeeping)


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
    return plan_with(find_bookkeeping(module), module, activation_shapes, backprop_shape, prefer)


def plan_with(registration: Optional[LayerBookkeeping], module: Optional[nn.Module],
              activation_shapes: Sequence[Sequence[int]], backprop_shape: Optional[Sequence[int]],
              prefer: Optional[str]) -> LayerPlan:
    """:func:`plan_layer` with the layer's registration looked up already (``None``: it has none)."""
    if module is None:
        return LayerPlan("generic", "materialise", "functional use of parameters: the generic rule materialises")
    name = type(module).__name__
    if backprop_shape is None or not activation_shapes:
        return LayerPlan(name, "materialise", "no (A, G) pair delivered: the layer's rule materialises")
    if registration is None:
        return LayerPlan(name, "materialise", NO_FORM)
    return registration.plan(module, list(activation_shapes[0]), list(backprop_shape), prefer)


def plan_graph(gm: torch.fx.GraphModule, prefer: Optional[str] = None) -> List[Tuple[str, LayerPlan]]:
    """``(layer name, plan)`` for every layer call the per_sample pass made a DP-aware op, from the shapes
    the batch_dim pass recorded (compiled with example_inputs; ``[]`` without them). A layer called twice
    is listed twice; a functional use of parameters (the generic rule) is listed by its site's name; a block
    whose registration plans its inner layers lists them (``"encoder.self_attn.in_proj"``)."""
    guard = getattr(gm, "fxdp_batch_guard", None)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    if guard is None or guard.input_index >= len(placeholders):
        return []
    batch = placeholders[guard.input_index].meta.get(meta.FAKE_VALUE)
    if not isinstance(batch, torch.Tensor):
        return []
    n = batch.shape[guard.dim]
    plans = []
    for node in gm.graph.nodes:
        if meta.PER_SAMPLE_RULE not in node.meta or len(node.args) < 3 or node.args[0].op != "get_attr":
            continue  # functional uses of parameters: the generic rule, which always materialises
        try:
            module = gm.get_submodule(node.args[0].target)
        except AttributeError:  # a functional use (its first argument is its site, not a layer)
            plans += _function_plans(gm, node, n, prefer)
            continue
        plans += _layer_plans(gm, node, module, n, prefer)
    return plans


def _function_plans(gm: torch.fx.GraphModule, node: torch.fx.Node, n: int, prefer) -> List[Tuple[str, LayerPlan]]:
    """The plans of a function using parameters directly: its registration's (``x + self.pos``), else the
    generic rule's."""
    site = getattr(gm, node.args[0].target, None)
    registration = find_function_bookkeeping(getattr(site, "fn", None))
    parts = registration.graph_plans(None, gm, node, site, n, prefer) if registration is not None else None
    name = str(getattr(site, "target", node.args[0].target))
    out = []
    for inner, plan in parts or [("", plan_layer(None, [], None, prefer))]:
        if getattr(site, "description", ""):
            plan = dataclasses.replace(plan, reason=f"{site.description}: {plan.reason}")
        out.append((f"{name}.{inner}" if inner else name, plan))
    return out


def _layer_plans(gm: torch.fx.GraphModule, node: torch.fx.Node, module: nn.Module, n: int,
                 prefer) -> List[Tuple[str, LayerPlan]]:
    """The plans of a layer call: its registration's for the call (a block's inner layers), else one plan
    from the shapes of its A and G; none where the shapes were not recorded (the sink decides on the first
    batch, :attr:`BookkeepingSink.plans`)."""
    site = getattr(gm, node.args[1].target)
    name = node.args[0].target
    registration = find_bookkeeping(module)
    parts = registration.graph_plans(module, gm, node, site, n, prefer) if registration is not None else None
    if parts is not None:
        return [(f"{name}.{inner}" if inner else name, plan) for inner, plan in parts]
    fakes = [a.meta.get(meta.FAKE_VALUE) if isinstance(a, torch.fx.Node) else None for a in node.args[3:]]
    out = node.meta.get(meta.FAKE_VALUE)
    if isinstance(out, (tuple, list)):  # (output, state) of a recurrent layer: the output's shape
        out = next(iter(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    try:
        ins = [site.in_layout(i).to_batch_first(torch.empty(t.shape, device="meta"), n).shape
               for i, t in enumerate(t for t in fakes if isinstance(t, torch.Tensor))]
        g = site.out_layouts[0].to_batch_first(torch.empty(out.shape, device="meta"), n).shape
    except Exception:  # shapes not recorded
        return []
    return [(name, plan_with(registration, module, ins, g, prefer))]


def fake_shape(value) -> Optional[tuple]:
    """The shape the batch_dim pass recorded for a graph value, or None."""
    fake = value.meta.get(meta.FAKE_VALUE) if isinstance(value, torch.fx.Node) else None
    return tuple(fake.shape) if isinstance(fake, torch.Tensor) else None


def describe_plans(plans: Iterable[Tuple[str, LayerPlan]]) -> List[str]:
    """One line per layer for a report: ``"book-keeping: 'fc1' (Linear): outer (input (N, d): ...)"``."""
    return [f"book-keeping: '{name}' ({plan.layer}): {plan.method} ({plan.reason})" for name, plan in plans]
