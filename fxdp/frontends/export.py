"""The second front end: a graph captured by ``torch.export`` (non-strict) when torch.fx cannot trace.

torch.fx traces ``forward`` with proxies and stops at Python it cannot follow (``if mask.any():``,
the ``**kwargs`` wrappers of Hugging Face transformers 5). ``torch.export.export(..., strict=False)``
runs ``forward`` as Python on fake tensors and records the ATen ops it dispatches, so it captures
those models. What changes for the passes:

- the graph calls ATen ops (``torch.ops.aten.linear.default``), not torch functions, Tensor methods
  and layers; their batch rules are in :mod:`fxdp.passes.batch_rules.aten`;
- the batch dimension of every input tensor is dynamic (``Dim.AUTO``), so the graph runs for other
  batch sizes; the sizes it builds in (sequence lengths, image sizes) are checked at every forward by an
  :class:`~fxdp.runtime.guards.ExportShapeGuard`, which raises :class:`~fxdp.errors.ExportShapeError`
  (before a forward of inputs of other sizes, the re-analysis, :mod:`fxdp.passes.reanalyse`, captures the
  model again for them, or puts in a graph it captured for them earlier: :func:`flat_inputs` gives the
  inputs the shape guard checks);
- each node's ``stack_trace`` holds the Python frames that dispatched it: ``meta.SOURCE`` is the
  innermost one outside torch and fxdp (a line of the user's code, or of the library the model comes
  from, as for torchvision models);
- the graph is re-rooted on the user's model: its parameters, buffers and layers are the model's own;
- calls of stock layers are folded back into ``call_module`` nodes where that is exact
  (:mod:`fxdp.frontends.folding`): ``aten.linear(x, fc.weight, fc.bias)`` of an ``nn.Linear`` becomes a call of
  ``fc``, so the hand-written per-sample rules and book-keeping serve it, and an ``nn.Dropout``'s
  ``aten.dropout`` a call of the layer, which follows ``train()``/``eval()``. Other uses of parameters
  stay functional calls and the per_sample pass gives them the generic rule; functional dropout (inside
  attention) keeps the mode the model had when it was captured (evaluate with the model itself, which
  shares its parameters with the compiled one). A layer of yours with a per-sample rule registered
  (``fxdp.register_grad_sampler``) is folded back from the ops its call recorded, so its rule serves it
  too.

The model's output keeps its type (a ``ModelOutput``): export's pytree code generation rebuilds it.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from typing import Any, Dict, List, Optional, Tuple

import sympy
import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxdp import meta
from fxdp.diagnostics.source import location_from_stack_trace
from fxdp.runtime.guards import CapturedModeGuard, ExportShapeGuard, SymbolicBatch
from fxdp.frontends.folding import dotted_attribute, fold_layers, fold_registered_layers, refuse_unfolded_moe_blocks

aten = torch.ops.aten

FRONT_END = "torch.export"


def flat_inputs(gm: torch.fx.GraphModule, args: tuple, kwargs: Dict[str, Any]) -> Optional[List[Any]]:
    """The inputs of a call ``gm(*args, **kwargs)`` of a captured graph, flattened as its code flattens them (one
    per placeholder, as :class:`~fxdp.runtime.guards.ExportShapeGuard` sees them); None where the call does not
    bind to what was captured (other keywords, another structure): the graph's own code then says what is wrong."""
    from torch.fx import _pytree as fx_pytree

    info = getattr(gm.graph._codegen, "pytree_info", None)
    spec = getattr(gm, "_in_spec", None)
    if info is None or spec is None or spec.num_children != 2:
        return None
    names = [n for n in info.orig_args if n != "self"]
    try:
        bound = inspect.signature(type(gm).forward).bind(gm, *args, **kwargs).arguments
        values = [bound[n] for n in names]
        n_positional = spec.child(0).num_children
        return list(fx_pytree.tree_flatten_spec(
            (values[:n_positional], dict(zip(names[n_positional:], values[n_positional:]))), spec))
    except Exception:  # noqa: BLE001  (a call that does not fit the captured structure)
        return None


def _dropout_p(node) -> float:
    """The drop probability a captured ATen call applies (0 when none or in eval mode)."""
    if node.op != "call_function":
        return 0.0
    if node.target in _DROPOUTS:
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.0)
        return float(p) if train and isinstance(p, (int, float)) else 0.0
    if node.target is aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return float(p) if isinstance(p, (int, float)) else 0.0
    return 0.0


_DROPOUTS = (aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
             aten.alpha_dropout.default, aten.feature_alpha_dropout.default)
_MODE_GUARD = "fxdp_captured_mode"


def _guard_captured_dropout(graph: torch.fx.Graph, model_name: str) -> None:
    """Dropout left in the graph after folding (not an nn.Dropout's) gets a :class:`CapturedModeGuard`."""
    sites = []
    for node in graph.nodes:
        p = _dropout_p(node)
        if p > 0:
            where = location_from_stack_trace(node.meta.get("stack_trace"))
            sites.append(f"node '{node.name}' (p={p:g}{f', at {where}' if where else ''})")
    if not sites:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    graph.owning_module.add_module(_MODE_GUARD, CapturedModeGuard(sites, model_name))
    with graph.inserting_after(placeholders[-1] if placeholders else next(iter(graph.nodes))):
        graph.call_module(_MODE_GUARD, ())


def _positional_and_keyword(model: nn.Module, example_inputs) -> Tuple[tuple, Dict[str, Any]]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: Dict[str, Any], batch_dim: int):
    """The batch dimension of every tensor input dynamic (``Dim.AUTO``: export keeps it dynamic where the
    code allows, and finds which inputs share it). Other sizes stay as the example inputs have them:
    making them dynamic too doubles the time export takes."""
    from torch.export import Dim

    def dims(value):
        return {batch_dim: Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() > batch_dim else None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    spec = {}
    for name, value in bound.arguments.items():
        spec[name] = pytree.tree_map(dims, value)
    return spec


def capture(model: nn.Module, example_inputs, batch_dim: int = 0) -> torch.fx.GraphModule:
    """``model`` as a GraphModule of ATen ops, captured by ``torch.export`` (non-strict) on
    ``example_inputs``, re-rooted on ``model`` (its parameters and layers are the model's own), with
    source locations and stock layers folded back. Raises what torch.export raises.

    Keyword inputs that ``forward`` takes through ``**kwargs`` (a peft model passes ``token_type_ids`` on to the
    model it wraps) become inputs of the graph by their own names (:func:`keywords_named`)."""
    args, kwargs = _positional_and_keyword(model, example_inputs)
    with _quiet_export(), keywords_named(model, kwargs):
        exported = torch.export.export(model, args, kwargs, dynamic_shapes=_dynamic_shapes(model, args, kwargs, batch_dim),
                                       strict=False)
    captured = exported.module()
    graph = captured.graph
    _drop_metadata_asserts(graph)
    fold_layers(graph, model)
    fold_registered_layers(graph, model)
    refuse_unfolded_moe_blocks(graph, model)
    for node in graph.nodes:
        node.meta[meta.SOURCE] = location_from_stack_trace(node.meta.get("stack_trace"))
    _replace_export_guard(graph, args, kwargs, batch_dim, type(model).__name__)
    _guard_captured_dropout(graph, type(model).__name__)
    graph._tracer_cls, graph._tracer_extras = None, {}  # export's tracer cannot re-trace the code of a copy
    gm = torch.fx.GraphModule(_root(model, captured, graph), graph, type(model).__name__)
    for attr in ("_in_spec", "_out_spec"):  # export's generated code flattens inputs and rebuilds outputs
        if hasattr(captured, attr):
            setattr(gm, attr, getattr(captured, attr))
    gm.training = model.training
    gm.recompile()
    return gm


def passed_through(forward, kwargs: Dict[str, Any]) -> Tuple[str, ...]:
    """The keywords of ``kwargs`` that ``forward`` takes through its ``**kwargs`` (it names no parameter for them)."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return ()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return tuple(k for k in kwargs if k not in named)


@contextlib.contextmanager
def keywords_named(model: nn.Module, kwargs: Dict[str, Any]):
    """For the duration, ``model.forward`` names the keywords of ``kwargs`` it takes through ``**kwargs`` as
    keyword-only parameters of its own (and takes no others), calling the model's forward unchanged.

    torch.export binds the example inputs to ``forward``'s signature: keywords that land in ``**kwargs`` are
    bound twice (as the ``kwargs`` dict and by name, torch 2.13), which its dynamic shapes cannot match; named,
    each is one input of the graph, with its own name (the graph then takes exactly these keywords: a call with
    others is captured again for them, :func:`fxdp.passes.reanalyse._recapture`). The instance attribute is
    removed after (one of the model's own, as accelerate sets, put back)."""
    extra = passed_through(model.forward, kwargs)
    if not extra:
        yield
        return
    forward = model.forward
    signature = inspect.signature(forward)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in extra]

    def named_forward(*args, **keywords):
        return forward(*args, **keywords)

    named_forward.__signature__ = signature.replace(parameters=params)
    had = model.__dict__.get("forward")
    model.__dict__["forward"] = named_forward
    try:
        yield
    finally:
        if had is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = had


def keyword_inputs(forward, args: tuple, kwargs: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The inputs of a call ``forward(*args, **kwargs)`` by name, with those it takes through ``**kwargs`` by their
    own names (as :func:`capture` takes them); None where a positional input lands in ``*args``."""
    bound = inspect.signature(forward).bind(*args, **kwargs)
    named: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


# torch loggers that report a failing export (its error, which the report shows, says it all)
_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export", "torch._dynamo",
                   "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _quiet_export():
    """A failing export prints its partial graph to stderr and logs warnings; the compile report says why
    it failed instead. The loggers' levels are raised for the duration and restored after (nothing else
    about logging is touched), and stderr is kept for the duration."""
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _drop_metadata_asserts(graph: torch.fx.Graph) -> None:
    """``aten._assert_tensor_metadata`` checks dtypes export saw; they compute nothing and would count
    as uses of the values they check (a parameter's embedding would look used outside its site)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)


_GUARD = "fxdp_input_shapes"


def _replace_export_guard(graph: torch.fx.Graph, args, kwargs, batch_dim: int, model_name: str) -> None:
    """export's guard call (``_guards_fn``) becomes a call of an :class:`ExportShapeGuard` of the example
    inputs' shapes, right after the inputs (before any size is used)."""
    leaves = pytree.tree_leaves((args, kwargs))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(leaves) != len(placeholders):
        return  # inputs export flattened otherwise: export's own guard stays (such a model does not pickle)
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    first = next((x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > batch_dim), None)
    n = None if first is None else first.shape[batch_dim]
    shapes = [tuple(None if d == batch_dim and s == n else s for d, s in enumerate(x.shape))
              if isinstance(x, torch.Tensor) else None for x in leaves]
    values = [None if isinstance(x, torch.Tensor) else x for x in leaves]  # (export builds them into the graph)
    graph.owning_module.add_module(_GUARD, ExportShapeGuard([str(p.target) for p in placeholders], shapes, batch_dim,
                                                            model_name, values))
    with graph.inserting_after(placeholders[-1]):
        graph.call_module(_GUARD, tuple(placeholders))


def symbolic_batch(gm: torch.fx.GraphModule) -> Optional[SymbolicBatch]:
    """:class:`SymbolicBatch` of a graph captured here, where torch.export kept the batch size a symbol in
    every batched input; None for any other graph, where export fixed the batch size to a number (the
    model's code used it as one, e.g. ``int(x.shape[0])``), or where it recorded conditions on other
    symbols (sizes that depend on data)."""
    shape_guard = getattr(gm, _GUARD, None)
    if not isinstance(shape_guard, ExportShapeGuard):
        return None
    expected = dict(zip(shape_guard.names, shape_guard.shapes))
    mask, sizes = [], []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        shape = expected.get(str(node.target))
        batched = shape is not None and len(shape) > shape_guard.batch_dim and shape[shape_guard.batch_dim] is None
        value = node.meta.get("val")
        if batched:
            if not isinstance(value, torch.Tensor) or value.dim() != len(shape):
                return None
            sizes.append(value.shape[shape_guard.batch_dim])
        mask.append(batched)
    if not sizes or not all(isinstance(size, torch.SymInt) for size in sizes):
        return None
    try:
        return _symbolic_batch(mask, sizes)
    except (AttributeError, TypeError, ValueError):  # a torch whose ShapeEnv reads otherwise: analyse each size
        return None


def _symbolic_batch(mask: List[bool], sizes: List[torch.SymInt]) -> Optional[SymbolicBatch]:
    env = sizes[0].node.shape_env
    exprs = [env.replace(size.node.expr) for size in sizes]
    if not all(isinstance(expr, sympy.Symbol) for expr in exprs):
        return None  # fixed to a number (or a formula of another symbol): not free
    symbols = set(exprs) | {key for key, value in env.replacements.items() if value in exprs}
    conditions = [env.replace(guard.expr) for guard in env.guards]
    conditions += [env.replace(a.expr) for asserts in env.deferred_runtime_asserts.values() for a in asserts]
    if any(not condition.free_symbols <= symbols for condition in conditions):
        return None
    ranges = [env.var_to_range[symbol] for symbol in set(exprs) if symbol in env.var_to_range]
    lower = max([2, *(int(r.lower) for r in ranges if isinstance(r.lower, sympy.Integer))])
    uppers = [int(r.upper) for r in ranges if isinstance(r.upper, sympy.Integer)]  # int_oo: unbounded
    return SymbolicBatch(tuple(mask), tuple(symbols), lower, min(uppers) if uppers else None, tuple(conditions))


def _root(model: nn.Module, captured: torch.fx.GraphModule, graph: torch.fx.Graph) -> Dict[str, Any]:
    """Every attribute the graph reads, taken from the user's model (export's own objects otherwise:
    its guard, lifted constants)."""
    root: Dict[str, Any] = {}
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module") or node.target in root:
            continue
        value = dotted_attribute(model, node.target)
        if value is None:
            value = dotted_attribute(captured, node.target)
        root[node.target] = value
    return root
