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
  (:func:`fold_layers`): ``aten.linear(x, fc.weight, fc.bias)`` of an ``nn.Linear`` becomes a call of
  ``fc``, so the hand-written per-sample rules and book-keeping serve it, and an ``nn.Dropout``'s
  ``aten.dropout`` a call of the layer, which follows ``train()``/``eval()``. Other uses of parameters
  stay functional calls and the per_sample pass gives them the generic rule; functional dropout (inside
  attention) keeps the mode the model had when it was captured (evaluate with the model itself, which
  shares its parameters with the compiled one). A layer of yours with a per-sample rule registered
  (``fxdp.register_grad_sampler``) is folded back from the ops its call recorded
  (:func:`fold_registered_layers`), so its rule serves it too.

The model's output keeps its type (a ``ModelOutput``): export's pytree code generation rebuilds it.
"""

from __future__ import annotations

import contextlib
import copyreg
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

aten = torch.ops.aten

FRONT_END = "torch.export"


def _op_overload(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _reduce_op_overload(op):
    return _op_overload, (op.namespace, op._opname, op._overloadname)


# a compiled model's sites hold the ATen ops they call; pickle names them (torch's OpOverload has no reduce)
copyreg.pickle(torch._ops.OpOverload, _reduce_op_overload)


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
    source locations and stock layers folded back. Raises what torch.export raises."""
    args, kwargs = _positional_and_keyword(model, example_inputs)
    with _quiet_export():
        exported = torch.export.export(model, args, kwargs, dynamic_shapes=_dynamic_shapes(model, args, kwargs, batch_dim),
                                       strict=False)
    captured = exported.module()
    graph = captured.graph
    _drop_metadata_asserts(graph)
    owners = _parameter_owners(model)
    fold_layers(graph, model, owners)
    fold_registered_layers(graph, model)
    _refuse_unfolded_moe_blocks(graph, model)
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
    graph.owning_module.add_module(_GUARD, ExportShapeGuard([str(p.target) for p in placeholders], shapes, batch_dim,
                                                            model_name))
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
        value = _attribute(model, node.target)
        if value is None:
            value = _attribute(captured, node.target)
        root[node.target] = value
    return root


def _attribute(obj, target: str):
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# ------------------------------------------------------------------------------------------------
# Folding ATen calls back into the stock layers they came from
# ------------------------------------------------------------------------------------------------


def _parameter_owners(model: nn.Module) -> Dict[int, List[Tuple[str, nn.Module]]]:
    """id(parameter or buffer) -> the (qualified name, module) pairs that hold it directly."""
    owners: Dict[int, List[Tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for tensor in list(module._parameters.values()) + list(module._buffers.values()):
            if tensor is not None:
                owners.setdefault(id(tensor), []).append((name, module))
    return owners


def _stock(module: nn.Module, cls: type) -> bool:
    """An instance of ``cls`` whose forward is ``cls``'s own (a subclass may compute something else)."""
    return isinstance(module, cls) and type(module).forward is cls.forward and not module._forward_hooks \
        and not module._forward_pre_hooks


def _value(graph_owner, node):
    """The parameter/buffer a get_attr node reads (from the graph module export built)."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        return _attribute(graph_owner, node.target)
    return None


def _owner(owners, tensor, cls) -> Optional[Tuple[str, nn.Module]]:
    if tensor is None:
        return None
    for name, module in owners.get(id(tensor), ()):
        if _stock(module, cls):
            return name, module
    return None


def _arg(node: torch.fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _match_linear(node, get, owners):
    w, b = get(_arg(node, 1, "weight")), get(_arg(node, 2, "bias"))
    found = _owner(owners, w, nn.Linear)
    if found and found[1].weight is w and found[1].bias is b:
        return found, (node.args[0],)
    return None


def _match_embedding(node, get, owners):
    w = get(_arg(node, 0, "weight"))
    found = _owner(owners, w, nn.Embedding)
    if not found:
        return None
    m = found[1]
    padding = _arg(node, 2, "padding_idx", -1)
    same = (m.weight is w and m.max_norm is None and (m.padding_idx if m.padding_idx is not None else -1) == padding
            and bool(_arg(node, 3, "scale_grad_by_freq", False)) == m.scale_grad_by_freq
            and bool(_arg(node, 4, "sparse", False)) == m.sparse)
    return (found, (node.args[1],)) if same else None


def _match_layer_norm(node, get, owners):
    w, b = get(_arg(node, 2, "weight")), get(_arg(node, 3, "bias"))
    found = _owner(owners, w, nn.LayerNorm)
    if not found:
        return None
    m = found[1]
    same = (m.weight is w and m.bias is b and tuple(m.normalized_shape) == tuple(_arg(node, 1, "normalized_shape"))
            and m.eps == _arg(node, 4, "eps", 1e-5))
    return (found, (node.args[0],)) if same else None


def _conv_matcher(cls):
    def match(node, get, owners):
        w, b = get(_arg(node, 1, "weight")), get(_arg(node, 2, "bias"))
        found = _owner(owners, w, cls)
        if not found:
            return None
        m = found[1]
        k = len(m.kernel_size)

        def tup(value, default):
            value = default if value is None else value
            return tuple(value) * (k if len(tuple(value)) == 1 else 1) if isinstance(value, (list, tuple)) \
                else (value,) * k

        padding = _arg(node, 4, "padding", 0)
        same_padding = padding == m.padding if isinstance(padding, str) else tup(padding, 0) == tuple(m.padding)
        same = (m.weight is w and m.bias is b and m.padding_mode == "zeros" and same_padding
                and tup(_arg(node, 3, "stride", 1), 1) == tuple(m.stride)
                and tup(_arg(node, 5, "dilation", 1), 1) == tuple(m.dilation)
                and _arg(node, 6, "groups", 1) == m.groups)
        return (found, (node.args[0],)) if same else None

    return match


def _match_batch_norm(node, get, owners):
    w = get(_arg(node, 1, "weight"))
    found = _owner(owners, w, nn.modules.batchnorm._BatchNorm)
    if not found:
        return None
    m = found[1]
    same = (m.weight is w and m.bias is get(_arg(node, 2, "bias")) and m.running_mean is get(_arg(node, 3, "running_mean"))
            and bool(_arg(node, 5, "training")) == (m.training or m.running_mean is None) and m.eps == _arg(node, 7, "eps"))
    return (found, (node.args[0],)) if same else None


def _cell_matcher(cls, nonlinearity=None):
    """aten.gru_cell / lstm_cell / rnn_*_cell(input, hx, w_ih, w_hh, b_ih, b_hh) of an nn.*Cell."""
    def match(node, get, owners):
        w_ih = get(_arg(node, 2, "w_ih"))
        found = _owner(owners, w_ih, cls)
        if not found:
            return None
        m = found[1]
        same = (m.weight_ih is w_ih and m.weight_hh is get(_arg(node, 3, "w_hh"))
                and m.bias_ih is get(_arg(node, 4, "b_ih")) and m.bias_hh is get(_arg(node, 5, "b_hh"))
                and (nonlinearity is None or m.nonlinearity == nonlinearity))
        hx = node.args[1]
        return (found, (node.args[0], tuple(hx) if isinstance(hx, (list, tuple)) else hx)) if same else None

    return match


def _match_dropout(node, get, owners, model=None):
    """aten.dropout(x, p, train) recorded inside an nn.Dropout: a call of it follows its train/eval mode."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack or model is None:
        return None
    path = list(stack.values())[-1][0]
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    same = _stock(module, nn.Dropout) and module.p == _arg(node, 1, "p") and module.training == _arg(node, 2, "train")
    return ((path, module), (node.args[0],)) if same else None


_FOLDS = {
    aten.dropout.default: _match_dropout,
    aten.gru_cell.default: _cell_matcher(nn.GRUCell),
    aten.lstm_cell.default: _cell_matcher(nn.LSTMCell),
    aten.rnn_tanh_cell.default: _cell_matcher(nn.RNNCell, "tanh"),
    aten.rnn_relu_cell.default: _cell_matcher(nn.RNNCell, "relu"),
    aten.linear.default: _match_linear,
    aten.embedding.default: _match_embedding,
    aten.layer_norm.default: _match_layer_norm,
    aten.conv1d.default: _conv_matcher(nn.Conv1d),
    aten.conv2d.default: _conv_matcher(nn.Conv2d),
    aten.conv3d.default: _conv_matcher(nn.Conv3d),
    aten.batch_norm.default: _match_batch_norm,
}


def fold_layers(graph: torch.fx.Graph, model: nn.Module, owners=None) -> List[str]:
    """Turn ATen calls that are exactly a stock layer's forward (the layer's own parameters, its
    configuration) into ``call_module`` nodes of that layer. Returns the folded layers' names.

    The layer's forward does what the ATen call did (and what it did around it: batch norm's update of
    ``num_batches_tracked``, whose separate node is dropped)."""
    owners = owners if owners is not None else _parameter_owners(model)
    holder = graph.owning_module

    def get(node):
        return _value(holder, node)

    folded = []
    reached = set()  # nodes computed from a model input: a layer applied to anything else (position
    for node in graph.nodes:  # embeddings of arange(T)) stays an op the per_sample pass folds into its consumer
        if node.op == "placeholder" or any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    for node in list(graph.nodes):
        match = _FOLDS.get(node.target) if node.op == "call_function" else None
        found = (match(node, get, owners, model) if match is _match_dropout else match(node, get, owners)) \
            if match else None
        if found is None or found[1][0] not in reached:
            continue
        (name, module), args = found
        inputs = list(node.all_input_nodes)
        node.op, node.target, node.args, node.kwargs = "call_module", name, args, {}
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            _drop_counter_update(graph, holder, module)
        for old in inputs:  # the parameters' get_attr nodes, if nothing else reads them
            if old.op == "get_attr" and not old.users:
                graph.erase_node(old)
        folded.append(name)
    return folded


def _drop_counter_update(graph, holder, module) -> None:
    counter = getattr(module, "num_batches_tracked", None)
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is aten.add_.Tensor and not node.users
                and _value(holder, node.args[0]) is counter and counter is not None):
            graph.erase_node(node)


# ------------------------------------------------------------------------------------------------
# Folding the calls of layers with a per-sample rule registered for their type (your own layers)
# ------------------------------------------------------------------------------------------------


def fold_registered_layers(graph: torch.fx.Graph, model: nn.Module) -> List[str]:
    """Each call of a layer (not a torch.nn one: those are matched op by op) whose type has a per-sample
    rule registered with ``fxdp.register_grad_sampler`` becomes a ``call_module`` node again, so its rule
    serves it: the nodes the call recorded (``nn_module_stack``) are replaced by one call of the layer,
    when they read exactly one value from outside (besides the layer's own parameters and buffers, and
    sizes such as export's shared ``sym_size(x, 0)`` when ``forward`` takes one argument) and one of them
    is used outside (transformers' ``Conv1D``: ``view``, ``addmm``, ``view``). Other calls keep their ATen ops, which the generic rule serves."""
    from fxdp.grad_sample.registry import find_grad_sampler  # the registry of per-sample rules

    layers = {name: m for name, m in model.named_modules()
              if name and find_grad_sampler(m) is not None and not type(m).__module__.startswith("torch.nn")}
    calls: Dict[str, List[torch.fx.Node]] = {}  # one call of a layer -> its nodes, in graph order
    for node in graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if path in layers and node.op in ("call_function", "call_module"):  # stock layers inside, folded already
                calls.setdefault(key, []).append(node)
                break  # the outermost registered layer owns the node
    holder = graph.owning_module
    folded = []
    for key, nodes in calls.items():
        path = nodes[0].meta["nn_module_stack"][key][0]
        own = {id(t) for t in list(layers[path].parameters()) + list(layers[path].buffers())}
        inside = set(nodes)
        outside_inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside
                          and not (a.op == "get_attr" and id(_value(holder, a)) in own)}
        if _takes_one_input(layers[path]):  # sizes read from outside (export reuses ``sym_size(x, 0)``
            outside_inputs = {a for a in outside_inputs if not _is_size(a)}  # nodes): its forward reads its own
        # a size the call computed (``s0 * 7``) and export's CSE shares with later code stays in the graph
        outputs = [n for n in nodes if any(u not in inside for u in n.users) and not _is_size(n)]
        if len(outside_inputs) != 1 or len(outputs) != 1:
            continue
        (x,), (out,) = outside_inputs, outputs
        with graph.inserting_before(out):
            call = graph.call_module(path, (x,))
        call.meta.update(out.meta)
        out.replace_all_uses_with(call)
        for n in reversed(nodes):
            if not n.users:
                graph.erase_node(n)
        folded.append(path)
    for node in list(graph.nodes):  # the layer's parameters, read by nothing now
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    return folded


def _refuse_unfolded_moe_blocks(graph: torch.fx.Graph, model: nn.Module) -> None:
    """A mixture-of-experts block's ops left in the graph pick tokens by data, which the passes cannot follow:
    its call was not folded because a value computed inside leaves it besides its output (router logits for
    an auxiliary loss). The capture fails, so the hooks engine, which names the cause, takes the model."""
    from fxdp.grad_sample.moe import is_moe_block  # the registry of per-sample rules

    blocks = {name for name, m in model.named_modules() if name and is_moe_block(m)}
    left = sorted({path for node in graph.nodes if node.op in ("call_function", "call_module") and not _is_size(node)
                   and node.target not in blocks  # a folded call keeps its last node's module stack
                   for path, _ in (node.meta.get("nn_module_stack") or {}).values() if path in blocks})
    if left:
        raise NotImplementedError(
            f"the mixture-of-experts block(s) {', '.join(repr(p) for p in left)} cannot be captured as one call: a value "
            "computed inside leaves the block besides its output (router logits for an auxiliary loss?)")


def _is_size(node: torch.fx.Node) -> bool:
    """A node whose value is a (symbolic) size, not a tensor: ``aten.sym_size.int(x, 0)``, ``s0 * 7``."""
    return isinstance(node.meta.get("val"), (int, torch.SymInt))


def _takes_one_input(module: nn.Module) -> bool:
    """``module.forward`` takes exactly one argument: a call of it read no size from outside except to
    compute what its forward computes from that argument again."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)
