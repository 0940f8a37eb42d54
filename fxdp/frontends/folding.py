"""Folding a captured graph's ATen calls back into the layers they came from.

torch.export records ATen ops, not layer calls: ``aten.linear(x, fc.weight, fc.bias)`` where the model
called ``fc``. Where that is exact, the call becomes a ``call_module`` node of the layer again, so the
hand-written per-sample rules and book-keeping serve it:

- :func:`fold_layers`: a stock layer's op with the layer's own parameters and configuration
  (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, convolutions, batch norm, the recurrent cells),
  matched op by op from which module holds the parameters; ``nn.Dropout``'s ``aten.dropout`` (found from
  the node's module stack), so the call follows ``train()``/``eval()``;
- :func:`fold_registered_layers`: every call of a layer of yours with a per-sample rule registered
  (``fxdp.register_grad_sampler``), replaced by one call of the layer when the ops it recorded read one
  value from outside and give one out.

Other uses of parameters stay functional calls; the per_sample pass gives them the generic rule.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx
from torch import nn

aten = torch.ops.aten


def dotted_attribute(obj, target: str):
    """``obj.a.b`` for ``target`` ``"a.b"``; None where a part is missing."""
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
        return dotted_attribute(graph_owner, node.target)
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


def refuse_unfolded_moe_blocks(graph: torch.fx.Graph, model: nn.Module) -> None:
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
