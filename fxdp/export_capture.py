"""The second front end: a graph captured by ``torch.export`` (non-strict) when torch.fx cannot trace.

torch.fx traces ``forward`` with proxies and stops at Python it cannot follow (``if mask.any():``,
the ``**kwargs`` wrappers of Hugging Face transformers 5). ``torch.export.export(..., strict=False)``
runs ``forward`` as Python on fake tensors and records the ATen ops it dispatches, so it captures
those models. What changes for the passes:

- the graph calls ATen ops (``torch.ops.aten.linear.default``), not torch functions, Tensor methods
  and layers; their batch rules are in :mod:`fxdp.passes.batch_rules.aten`;
- every dimension of every input tensor is dynamic (``Dim.AUTO``), so the graph runs for other batch
  sizes (and sequence lengths, where the model allows); the sizes it does build in are checked at every
  forward by export's own guard, which raises :class:`ExportShapeError` here;
- each node's ``stack_trace`` holds the Python frames that dispatched it: ``meta.SOURCE`` is the
  innermost one outside torch and fxdp (a line of the user's code, or of the library the model comes
  from, as for torchvision models);
- the graph is re-rooted on the user's model: its parameters, buffers and layers are the model's own;
- calls of stock layers are folded back into ``call_module`` nodes where that is exact
  (:func:`fold_layers`): ``aten.linear(x, fc.weight, fc.bias)`` of an ``nn.Linear`` becomes a call of
  ``fc``, so the hand-written per-sample rules and book-keeping serve it. Other uses of parameters stay
  functional calls and the per_sample pass gives them the generic rule.

The model's output keeps its type (a ``ModelOutput``): export's pytree code generation rebuilds it.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxdp import meta
from fxdp.diagnostics import FxdpError
from fxdp.diagnostics.source import location_from_stack_trace

aten = torch.ops.aten

FRONT_END = "torch.export"


class ExportShapeError(FxdpError, ValueError):
    """A model captured with torch.export was called with inputs whose shapes its graph cannot run
    (a size the model's code made fixed at capture time)."""


class ExportShapeGuard(nn.Module):
    """Runs torch.export's check of the input shapes and turns its failure into an fxdp error."""

    def __init__(self, check: nn.Module, model_name: str):
        super().__init__()
        self.check = check
        self.model_name = model_name

    def forward(self, *inputs):
        try:
            self.check(*inputs)
        except Exception as exc:  # export raises AssertionError / RuntimeError naming the size
            shapes = ", ".join(str(tuple(x.shape)) for x in inputs if isinstance(x, torch.Tensor))
            raise ExportShapeError(
                f"fxdp: {self.model_name} was captured with torch.export (torch.fx could not trace it), and its "
                f"graph holds sizes the model's code fixed for the example inputs; inputs of shapes {shapes} break "
                f"them ({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}). Compile "
                "again with example_inputs of the shapes you train with (e.g. pad every batch to one sequence "
                "length)."
            ) from exc


def _positional_and_keyword(model: nn.Module, example_inputs) -> Tuple[tuple, Dict[str, Any]]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: Dict[str, Any]):
    """Every dimension of every tensor input dynamic (``Dim.AUTO``: export keeps what the code allows)."""
    from torch.export import Dim

    def dims(value):
        return {d: Dim.AUTO for d in range(value.dim())} if isinstance(value, torch.Tensor) else None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    spec = {}
    for name, value in bound.arguments.items():
        spec[name] = pytree.tree_map(dims, value)
    return spec


def capture(model: nn.Module, example_inputs) -> torch.fx.GraphModule:
    """``model`` as a GraphModule of ATen ops, captured by ``torch.export`` (non-strict) on
    ``example_inputs``, re-rooted on ``model`` (its parameters and layers are the model's own), with
    source locations and stock layers folded back. Raises what torch.export raises."""
    args, kwargs = _positional_and_keyword(model, example_inputs)
    exported = torch.export.export(model, args, kwargs, dynamic_shapes=_dynamic_shapes(model, args, kwargs),
                                   strict=False)
    captured = exported.module()
    graph = captured.graph
    _drop_metadata_asserts(graph)
    owners = _parameter_owners(model)
    fold_layers(graph, model, owners)
    for node in graph.nodes:
        node.meta[meta.SOURCE] = location_from_stack_trace(node.meta.get("stack_trace"))
    gm = torch.fx.GraphModule(_root(model, captured, graph), graph, type(model).__name__)
    for attr in ("_in_spec", "_out_spec"):  # export's generated code flattens inputs and rebuilds outputs
        if hasattr(captured, attr):
            setattr(gm, attr, getattr(captured, attr))
    gm.training = model.training
    gm.recompile()
    return gm


def _drop_metadata_asserts(graph: torch.fx.Graph) -> None:
    """``aten._assert_tensor_metadata`` checks dtypes export saw; they compute nothing and would count
    as uses of the values they check (a parameter's embedding would look used outside its site)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)


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
        if node.op == "call_module" and node.target == "_guards_fn":
            value = ExportShapeGuard(value, type(model).__name__)
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


_FOLDS = {
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
        if node.op == "placeholder" or (any(a in reached for a in node.all_input_nodes)
                                        and node.target is not aten.sym_size.int):
            reached.add(node)
    for node in list(graph.nodes):
        match = _FOLDS.get(node.target) if node.op == "call_function" else None
        found = match(node, get, owners) if match else None
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
