"""Pass 2, inplace: rewrite in-place ops out of place, reporting each rewrite with its source line.

In-place writes break per-sample gradient hooks (a module's output is a view the hooks still need)
and hide data flow from the later passes. Each form becomes its out-of-place equivalent:

- ``out += y`` (``operator.iadd``, and every other augmented assignment) -> ``operator.add``;
- ``x.add_(y)``, ``x.relu_()``, ``x.masked_fill_(m, v)``, ... -> ``x.add(y)``, ...; ``copy_``, ``fill_``,
  ``zero_`` and the random fills (``normal_``, ...) have dedicated equivalents;
- ``torch.relu_(x)``, ``F.leaky_relu_(x)`` -> ``torch.relu(x)``, ``F.leaky_relu(x)``;
- ``F.relu(x, inplace=True)`` (any function with an ``inplace`` argument) -> ``inplace=False``;
- a module called with ``inplace=True`` (``nn.ReLU(inplace=True)``) -> a shallow copy with
  ``inplace=False`` swapped into the GraphModule (the user's module is shared, never changed);
- ``x[idx] = v`` (``operator.setitem``) -> ``x = index_assign(x, idx, v)``.

Python keeps using the same variable after ``y.add_(1)``, so later nodes still read the old node:
those uses (after the in-place node, in graph order) are moved to the new node.

An out-of-place rewrite is wrong when another alias of the written memory is read afterwards (``v =
x[0]; v.add_(1); use(x)``) or when the write is state that must outlive the call (a parameter or
buffer): such ops are kept and reported, as are ops with no out-of-place equivalent (``resize_``).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import io
import operator
import tokenize
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from fxdp import meta
from fxdp.diagnostics import Finding, Kind, PassReport, PassResult, Severity, op_name
from fxdp.frontends.fx import source_location
from fxdp.runtime.inplace_ops import apply_out_of_place, copy_into, index_assign, is_basic_index, random_like

PASS_NAME = "inplace"

# ---------------------------------------------------------------------------------------------------
# What counts as an in-place op, and its equivalent
# ---------------------------------------------------------------------------------------------------

OUT_OF_PLACE_OPERATORS = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
    operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod,
    operator.ipow: operator.pow,
    operator.imatmul: operator.matmul,
    operator.iand: operator.and_,
    operator.ior: operator.or_,
    operator.ixor: operator.xor,
    operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift,
}
_DUNDER_OPERATORS = {f"__{op.__name__}__": op for op in OUT_OF_PLACE_OPERATORS}

# Named like in-place ops but do not write a tensor's values: nothing to rewrite.
_NOT_VALUE_WRITES = {"requires_grad_", "share_memory_"}
# No out-of-place equivalent (storage or Python callbacks): kept and reported.
_NO_EQUIVALENT = {
    "set_", "resize_", "resize_as_", "resize_as_sparse_", "sparse_resize_", "sparse_resize_and_clear_",
    "apply_", "map_", "map2_", "embedding_renorm_",
}
# Random fills: the result does not depend on the tensor's values (and ``bernoulli`` differs).
_RANDOM_FILLS = {"uniform_", "normal_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
                 "bernoulli_"}
# Comparisons and logical ops keep the tensor's dtype in place but return bool out of place.
_BOOL_RESULTS = {"eq_", "ne_", "lt_", "le_", "gt_", "ge_", "greater_", "greater_equal_", "less_",
                 "less_equal_", "not_equal_", "logical_and_", "logical_or_", "logical_xor_", "logical_not_"}


def has_inplace_flag(module: nn.Module) -> bool:
    """True for any module with a true boolean ``inplace`` attribute (``nn.ReLU(inplace=True)``)."""
    flag = getattr(module, "inplace", None)
    return isinstance(flag, bool) and flag


@dataclass
class InplaceOp:
    """An in-place op in a graph and its out-of-place equivalent (``op`` is None when it has none)."""

    node: Node
    mutated: Any  # the value the op writes to (a Node, normally)
    form: str  # "augmented", "method", "function", "flag", "module", "setitem", "out"
    old: str  # what the node runs, for reports: "operator.iadd", "Tensor.add_", "nn.ReLU(inplace=True)"
    new: str = ""  # what replaces it: "operator.add", ...
    op: Optional[str] = None  # "call_function" / "call_method" / "call_module"; None: no equivalent
    target: Any = None
    args: tuple = ()
    kwargs: Dict[str, Any] = field(default_factory=dict)
    cast_to_mutated: bool = False  # bool results cast back to the written tensor's dtype
    reason: str = ""  # why there is no equivalent


def _first_input(node: Node):
    if node.args:
        return node.args[0]
    return node.kwargs.get("input", node.kwargs.get("self"))


@functools.lru_cache(maxsize=None)
def _inplace_parameter_index(fn) -> Optional[int]:
    """Position of an ``inplace`` parameter in ``fn``'s signature, or None."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def _method_equivalent(node: Node, name: str, self_arg, rest: tuple, kwargs: dict, old: str) -> InplaceOp:
    """The equivalent of ``self_arg.<name>(*rest, **kwargs)`` for an in-place Tensor method ``name``."""
    op = InplaceOp(node, self_arg, "method", old)
    base = name[:-1]
    if name in _NO_EQUIVALENT:
        op.reason = f"`Tensor.{name}` changes the tensor's storage and has no out-of-place equivalent"
        return op
    if name == "copy_":
        op.op, op.target, op.new = "call_function", copy_into, "copy_into"
        op.args, op.kwargs = (self_arg,) + rest, kwargs
    elif name == "fill_":
        op.op, op.target, op.new = "call_function", torch.fill, "torch.fill"
        op.args, op.kwargs = (self_arg,) + rest, kwargs
    elif name == "zero_":
        op.op, op.target, op.new = "call_function", torch.zeros_like, "torch.zeros_like"
        op.args, op.kwargs = (self_arg,), {}
    elif name in _RANDOM_FILLS:
        op.op, op.target, op.new = "call_function", random_like, f"random_like(..., {name!r})"
        op.args, op.kwargs = (self_arg, name) + rest, kwargs
    elif callable(getattr(torch.Tensor, base, None)):
        op.op, op.target, op.new = "call_method", base, f"Tensor.{base}"
        op.args, op.kwargs = (self_arg,) + rest, kwargs
        op.cast_to_mutated = name in _BOOL_RESULTS
    else:
        op.op, op.target, op.new = "call_function", apply_out_of_place, f"apply_out_of_place(..., {name!r})"
        op.args, op.kwargs = (self_arg, name) + rest, kwargs
    return op


def find_inplace_op(node: Node, gm: Optional[torch.fx.GraphModule] = None) -> Optional[InplaceOp]:
    """The in-place op ``node`` runs, with its out-of-place equivalent, or None if it writes nothing.

    ``gm`` is needed to recognise modules called with ``inplace=True``.
    """
    if node.op == "call_function":
        target = node.target
        if target in OUT_OF_PLACE_OPERATORS:
            new = OUT_OF_PLACE_OPERATORS[target]
            return InplaceOp(node, node.args[0], "augmented", op_name(target), op_name(new),
                             "call_function", new, node.args, dict(node.kwargs))
        if target is operator.setitem:
            if isinstance(node.args[1], str):  # a dict or module attribute, not a tensor
                return None
            return InplaceOp(node, node.args[0], "setitem", "operator.setitem", "index_assign",
                             "call_function", index_assign, node.args, {})
        if isinstance(target, torch._ops.OpOverload):
            return _aten_equivalent(node, target)
        name = getattr(target, "__name__", "")
        if name.endswith("_") and not name.startswith("_") and name not in _NOT_VALUE_WRITES:
            op = _function_equivalent(node, target, name)
            if op is not None:
                return op
        index = _inplace_parameter_index(target) if callable(target) else None
        if index is not None:
            flag = node.kwargs.get("inplace", node.args[index] if len(node.args) > index else False)
            if flag is True:
                name = op_name(target)
                args = node.args[:index] + node.args[index + 1:] if len(node.args) > index else node.args
                return InplaceOp(node, _first_input(node), "flag", f"{name}(inplace=True)",
                                 f"{name}(inplace=False)", "call_function", target, args,
                                 {**node.kwargs, "inplace": False})
        return _out_argument(node)
    if node.op == "call_method":
        name = node.target
        if name in _DUNDER_OPERATORS:
            new = OUT_OF_PLACE_OPERATORS[_DUNDER_OPERATORS[name]]
            return InplaceOp(node, node.args[0], "augmented", f"Tensor.{name}", op_name(new),
                             "call_function", new, node.args, dict(node.kwargs))
        if name == "__setitem__":
            return InplaceOp(node, node.args[0], "setitem", "Tensor.__setitem__", "index_assign",
                             "call_function", index_assign, node.args, {})
        if (name.endswith("_") and not name.startswith("_") and name not in _NOT_VALUE_WRITES
                and hasattr(torch.Tensor, name)):
            return _method_equivalent(node, name, node.args[0], tuple(node.args[1:]), dict(node.kwargs),
                                      f"Tensor.{name}")
        return _out_argument(node)
    if node.op == "call_module" and gm is not None:
        module = gm.get_submodule(node.target)
        if has_inplace_flag(module):
            kind = f"nn.{type(module).__name__}" if type(module).__module__.startswith("torch.nn") \
                else type(module).__name__
            # A module whose forward ignores the flag writes nothing: swap it all the same (harmless,
            # and no module is left flagged), but its input keeps its value.
            written = _first_input(node) if _forward_reads_inplace_flag(type(module)) else None
            return InplaceOp(node, written, "module", f"{kind}(inplace=True)",
                             f"{kind}(inplace=False)", "call_module", node.target, node.args, dict(node.kwargs))
    return None


@functools.lru_cache(maxsize=None)
def _forward_reads_inplace_flag(module_type: type) -> bool:
    """False for modules such as nn.AlphaDropout whose forward never passes ``inplace`` on."""
    try:
        return "inplace" in inspect.getsource(module_type.forward)
    except (OSError, TypeError):
        return True  # no source: trust the flag


def _function_equivalent(node: Node, target, name: str) -> Optional[InplaceOp]:
    """``torch.relu_(x)``, ``F.leaky_relu_(x, 0.1)``, ``Tensor.add_(x, y)`` called as functions."""
    base = name[:-1]
    old = op_name(target)
    for namespace in (torch, F):
        if getattr(namespace, name, None) is not target:
            continue
        if name in _NO_EQUIVALENT:
            return InplaceOp(node, _first_input(node), "function", old,
                             reason=f"`{old}` has no out-of-place equivalent")
        if name == "zero_":
            return InplaceOp(node, _first_input(node), "function", old, "torch.zeros_like", "call_function",
                             torch.zeros_like, (_first_input(node),), {})
        for out_namespace in (namespace, F, torch):
            new = getattr(out_namespace, base, None)
            if callable(new):
                return InplaceOp(node, _first_input(node), "function", old, op_name(new), "call_function",
                                 new, node.args, dict(node.kwargs))
    if getattr(torch.Tensor, name, None) is target and node.args:
        op = _method_equivalent(node, name, node.args[0], tuple(node.args[1:]), dict(node.kwargs), old)
        op.form = "function"
        return op
    return None


def _aten_equivalent(node: Node, target) -> Optional[InplaceOp]:
    """``aten.add_.Tensor(x, y)`` (graphs torch.export captured): the same overload of ``aten.add``."""
    name = target.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_") or name in _NOT_VALUE_WRITES:
        return None
    old = str(target)
    packet = getattr(torch.ops.aten, name[:-1], None)
    new = getattr(packet, target._overloadname, None) if packet is not None else None
    if new is None:
        return InplaceOp(node, _first_input(node), "function", old, reason=f"`{old}` has no out-of-place equivalent")
    op = InplaceOp(node, _first_input(node), "function", old, str(new), "call_function", new, node.args,
                   dict(node.kwargs))
    op.cast_to_mutated = name in _BOOL_RESULTS
    return op


def _out_argument(node: Node) -> Optional[InplaceOp]:
    """``torch.add(a, b, out=y)`` writes into ``y``."""
    out = node.kwargs.get("out")
    if not isinstance(out, Node):
        return None
    name = op_name(node.target) if node.op == "call_function" else f"Tensor.{node.target}"
    kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
    return InplaceOp(node, out, "out", f"{name}(out=...)", name, node.op, node.target, node.args, kwargs)


# ---------------------------------------------------------------------------------------------------
# Aliasing: which nodes may share memory with which
# ---------------------------------------------------------------------------------------------------

_VIEW_NAMES = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "narrow", "select", "squeeze",
    "unsqueeze", "expand", "expand_as", "flatten", "unflatten", "movedim", "moveaxis", "swapaxes",
    "swapdims", "diagonal", "unfold", "as_strided", "detach", "contiguous", "split", "split_with_sizes",
    "chunk", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit", "real", "imag", "view_as_real",
    "view_as_complex", "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool",
}
_ATEN_VIEW_NAMES = _VIEW_NAMES | {"slice", "alias", "_unsafe_view", "as_strided", "_reshape_alias"}
_VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "data", "real", "imag"}
_VIEW_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)


def view_base(node: Node, gm: Optional[torch.fx.GraphModule] = None) -> Optional[Node]:
    """The node whose memory ``node``'s value may share (it is a view of it, or wrote into it)."""
    base = None
    if node.op == "call_function":
        target = node.target
        if target is operator.getitem:
            base = node.args[0]
        elif target is getattr:
            base = node.args[0] if node.args[1] in _VIEW_ATTRIBUTES else None
        elif isinstance(target, torch._ops.OpOverload):  # aten.view.default, aten.slice.Tensor, ...
            base = _first_input(node) if target.overloadpacket.__name__ in _ATEN_VIEW_NAMES else None
        elif getattr(target, "__name__", None) in _VIEW_NAMES and (
                getattr(torch, target.__name__, None) is target
                or getattr(torch.Tensor, target.__name__, None) is target):
            base = _first_input(node)
    elif node.op == "call_method" and node.target in _VIEW_NAMES:
        base = node.args[0]
    elif node.op == "call_module" and gm is not None and isinstance(gm.get_submodule(node.target), _VIEW_MODULES):
        base = _first_input(node)
    if base is None:
        op = find_inplace_op(node, gm)
        base = op.mutated if op is not None else None
    return base if isinstance(base, Node) else None


def alias_chain(node: Node, gm: Optional[torch.fx.GraphModule] = None) -> List[Node]:
    """``node``, its view base, that one's base, ... up to a node that owns its memory."""
    chain = [node]
    while True:
        base = view_base(chain[-1], gm)
        if base is None or base in chain:
            return chain
        chain.append(base)


def alias_root(node: Node, gm: Optional[torch.fx.GraphModule] = None) -> Node:
    return alias_chain(node, gm)[-1]


def _disjoint(chain_a: List[Node], chain_b: List[Node]) -> bool:
    """Two aliases are disjoint when they part at ``base[i]`` and ``base[j]`` with constant i != j."""
    in_b = set(chain_b)
    common = next((n for n in chain_a if n in in_b), None)
    if common is None:
        return True
    ia, ib = chain_a.index(common), chain_b.index(common)
    if ia == 0 or ib == 0:  # one is an alias of the other
        return False
    a, b = chain_a[ia - 1], chain_b[ib - 1]
    if a.op == b.op == "call_function" and a.target is b.target is operator.getitem:
        i, j = a.args[1], b.args[1]
        if type(i) is int and type(j) is int and i != j and (i >= 0) == (j >= 0):
            return True
    return False


@dataclass
class _Verdict:
    safe: bool
    message: str = ""
    fix: str = ""
    severity: Severity = Severity.WARNING
    writeback: Optional[Tuple[Node, Any]] = None  # (base, index): also write the result into base[index]
    input_note: str = ""


def _is_write_back(node: Node, base: Node, index, written: Node) -> bool:
    """``base[index] = written``: the store Python does after ``base[index] += v``."""
    return (node.op == "call_function" and node.target is operator.setitem and node.args[0] is base
            and node.args[1] == index and node.args[2] is written)


def _check_aliasing(op: InplaceOp, gm: torch.fx.GraphModule, code: str) -> _Verdict:
    node, mutated = op.node, op.mutated
    if not isinstance(mutated, Node):
        return _Verdict(True)
    chain = alias_chain(mutated, gm)
    root = chain[-1]
    if root.op == "get_attr":
        kind = attribute_kind(gm, root.target)
        return _Verdict(
            False,
            f"`{code}` writes into {kind} `{root.target}` during forward; the change must persist between "
            f"calls, so it cannot be rewritten out of place. The op is kept.",
            "do not update parameters or buffers in forward: compute a new tensor instead, or update the "
            "state outside the training step.",
            Severity.ERROR,
        )
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    here = order[node]
    live = []
    for other in node.graph.nodes:
        if order[other] >= here:
            break
        if other is mutated or not any(order[u] > here for u in other.users):
            continue
        other_chain = alias_chain(other, gm)
        if other_chain[-1] is root and not _disjoint(chain, other_chain):
            live.append(other)
    verdict = _Verdict(True)
    if live:
        verdict = _resolve_live_aliases(op, live, order, code, gm)
    if verdict.safe and root.op == "placeholder":
        verdict.input_note = (
            f"`{code}` wrote into the model input `{root.target}`; after the rewrite the caller's tensor is "
            f"left unchanged (the model's outputs are the same)."
        )
    return verdict


def _resolve_live_aliases(op: InplaceOp, live: List[Node], order, code: str, gm) -> _Verdict:
    node, mutated = op.node, op.mutated
    here = order[node]
    if (mutated.op == "call_function" and mutated.target is operator.getitem and live == [mutated.args[0]]):
        base, index = mutated.args[0], mutated.args[1]
        first = min((u for u in base.users if order[u] > here), key=order.__getitem__)
        if _is_write_back(first, base, index, node):
            return _Verdict(True)  # `x[i] += v`: the store that follows writes the result back
        parts = index if isinstance(index, tuple) else (index,)
        if all(is_basic_index(p) for p in parts):  # a view for sure: write the result back ourselves
            return _Verdict(True, writeback=(base, index))
    other = live[0]
    later = min((u for u in other.users if order[u] > here), key=order.__getitem__)
    loc = source_location(later)
    where = f" (at {loc.short})" if loc is not None else ""
    return _Verdict(
        False,
        f"`{code}` writes in place into `{mutated.name}`, which shares memory with `{other.name}`, read "
        f"again afterwards by `{later.name}`{where}; rewritten out of place, `{other.name}` would no longer "
        f"see the change, so the op is kept.",
        "write it out of place yourself and use the new tensor wherever the old one is read, e.g. "
        "`y = y.add(1)` instead of `y.add_(1)`.",
    )


def attribute_kind(gm: torch.fx.GraphModule, target: str) -> str:
    """"parameter", "buffer" or "attribute", for a ``get_attr`` target."""
    module_path, _, name = target.rpartition(".")
    try:
        owner = gm.get_submodule(module_path) if module_path else gm
    except AttributeError:
        return "attribute"
    if name in owner._parameters:
        return "parameter"
    if name in owner._buffers:
        return "buffer"
    return "attribute"


# ---------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------

_AST_SYMBOLS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
    ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>",
}


def _suggestion(code: str, op: InplaceOp) -> Optional[str]:
    """The user's line written out of place, when it is a simple statement."""
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1:
        return None
    stmt = tree.body[0]
    if op.form == "augmented" and isinstance(stmt, ast.AugAssign) and type(stmt.op) in _AST_SYMBOLS:
        target = ast.unparse(stmt.target)
        return f"{target} = {target} {_AST_SYMBOLS[type(stmt.op)]} {ast.unparse(stmt.value)}"
    if op.form == "setitem":
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], ast.unparse(stmt.value)
        elif isinstance(stmt, ast.AugAssign) and type(stmt.op) in _AST_SYMBOLS:
            target = stmt.target
            value = f"{ast.unparse(target)} {_AST_SYMBOLS[type(stmt.op)]} {ast.unparse(stmt.value)}"
        else:
            return None
        if not isinstance(target, ast.Subscript):
            return None
        x = ast.unparse(target.value)
        index = ast.unparse(target)[len(x):]  # "[:, 0]"
        return f"{x} = index_assign({x}, {index}, {value})"
    if op.form in ("method", "function", "flag"):
        return _rewritten_call(stmt, op)
    return None


class _CallRewriter(ast.NodeTransformer):
    """Replaces the calls of ``name`` in a statement by their out-of-place spelling."""

    def __init__(self, name: str, op: InplaceOp):
        self.name, self.op = name, op
        self.first: Optional[Tuple[ast.Call, Optional[ast.expr]]] = None  # (new call, tensor written)

    def visit_Call(self, call: ast.Call):
        self.generic_visit(call)
        func = call.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called != self.name:
            return call
        new, written = self._replace(call)
        if new is None:
            return call
        if self.first is None:
            self.first = (new, written)
        return new

    def _replace(self, call: ast.Call):
        op, func = self.op, call.func
        is_method = op.form == "method" and isinstance(func, ast.Attribute)
        written = func.value if is_method else (call.args[0] if call.args else None)
        if op.form == "flag":
            keywords = [ast.keyword(k.arg, ast.Constant(False)) if k.arg == "inplace" else k for k in call.keywords]
            if all(k.arg != "inplace" for k in call.keywords):
                return None, None
            return ast.Call(func, call.args, keywords), written
        if op.op == "call_method":
            if isinstance(func, ast.Attribute):
                return ast.Call(ast.Attribute(func.value, op.target, ast.Load()), call.args, call.keywords), written
            return None, None
        if op.op != "call_function":
            return None, None
        args = list(call.args)
        if is_method:
            args = [func.value] + args
        if op.target in (random_like, apply_out_of_place):
            args = args[:1] + [ast.Constant(self.name)] + args[1:]
        if op.target is torch.zeros_like:
            args = args[:1]
        new_func = ast.parse(op_name(op.target), mode="eval").body
        return ast.Call(new_func, args, call.keywords), written


def _rewritten_call(stmt: ast.stmt, op: InplaceOp) -> Optional[str]:
    name = op.old.split("(")[0].split(".")[-1]
    rewriter = _CallRewriter(name, op)
    new_stmt = rewriter.visit(stmt)
    if rewriter.first is None:
        return None
    call, written = rewriter.first
    if isinstance(new_stmt, ast.Expr) and new_stmt.value is call and written is not None:
        return f"{ast.unparse(written)} = {ast.unparse(new_stmt)}"
    return ast.unparse(new_stmt)


def _change_message(op: InplaceOp, code: str, suggestion: Optional[str], gm) -> str:
    if op.form == "module":
        module = gm.get_submodule(op.node.target)
        return (f"`{code or op.node.name}` calls `{op.node.target}` ({op.old}); it now runs a copy with "
                f"inplace=False (the model's own {type(module).__name__} is unchanged)")
    if code and suggestion:
        text = f"`{code}` rewritten as `{suggestion}`"
    elif code:
        text = f"`{code}`: in-place `{op.old}` rewritten as `{op.new}`"
    else:
        text = f"in-place `{op.old}` rewritten as `{op.new}`"
    return text


def _node_code(node: Node) -> str:
    """The user's line, without a trailing comment."""
    loc = source_location(node)
    if loc is None or not loc.code:
        return ""
    code = loc.code.strip()
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.type == tokenize.COMMENT:
                return code[: token.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return code


# ---------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------


def _copy_meta(old: Node, new: Node, description: str) -> None:
    new.meta[meta.SOURCE] = source_location(old)
    if old.stack_trace:
        new.stack_trace = old.stack_trace
    new.meta[meta.INPLACE_REWRITE] = description


def _later_users(value: Node, after: int, order) -> List[Node]:
    return [u for u in value.users if order.get(u, -1) > after]


def remove_inplace_ops(gm: torch.fx.GraphModule) -> PassResult:
    """Rewrite every in-place op of ``gm`` out of place (the graph is changed in place).

    The report lists each rewrite (``changes``) and each in-place op kept because no rewrite is safe
    (``findings``). Forward outputs are unchanged.
    """
    graph = gm.graph
    changes: List[Finding] = []
    findings: List[Finding] = []
    module_calls: Dict[str, List[Node]] = {}
    for node in list(graph.nodes):
        op = find_inplace_op(node, gm)
        if op is None:
            continue
        code = _node_code(node) or node.format_node()
        location = source_location(node)
        if op.op is None:
            findings.append(Finding(PASS_NAME, node.name, op.old, Kind.NOTE, Severity.WARNING,
                                    f"`{code}`: {op.reason}; the op is kept.",
                                    "avoid it in forward.", location))
            continue
        verdict = _check_aliasing(op, gm, code)
        if not verdict.safe:
            kind = Kind.CANNOT_BE_PRIVATE if verdict.severity is Severity.ERROR else Kind.NOTE
            findings.append(Finding(PASS_NAME, node.name, op.old, kind, verdict.severity, verdict.message,
                                    verdict.fix, location))
            continue
        new_node = _rewrite(graph, op, verdict)
        if op.form == "module":
            module_calls.setdefault(node.target, []).append(new_node)
        changes.append(Finding(PASS_NAME, new_node.name, f"{op.old} → {op.new}", Kind.REWRITE, Severity.INFO,
                               _change_message(op, code, _suggestion(code, op), gm), "", location))
        if verdict.input_note:
            findings.append(Finding(PASS_NAME, new_node.name, f"{op.old} → {op.new}", Kind.REWRITE,
                                    Severity.WARNING, verdict.input_note,
                                    "clone the input first if you relied on it being modified.", location))
    _install_module_copies(gm, module_calls)
    graph.lint()
    gm.recompile()
    return PassResult(gm, PassReport(PASS_NAME, tuple(changes), tuple(findings)))


def _rewrite(graph: torch.fx.Graph, op: InplaceOp, verdict: _Verdict) -> Node:
    node, mutated = op.node, op.mutated
    order = {n: i for i, n in enumerate(graph.nodes)}
    here = order[node]
    later = _later_users(mutated, here, order) if isinstance(mutated, Node) else []
    base_later = _later_users(verdict.writeback[0], here, order) if verdict.writeback else []
    description = f"{op.old} → {op.new}"
    with graph.inserting_after(node):
        new = graph.create_node(op.op, op.target, tuple(op.args), dict(op.kwargs))
    _copy_meta(node, new, description)
    result = new
    if op.cast_to_mutated:
        with graph.inserting_after(new):
            result = graph.call_method("type_as", (new, mutated))
        _copy_meta(node, result, description)
    for user in later:
        user.replace_input_with(mutated, result)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    if verdict.writeback:
        base, index = verdict.writeback
        with graph.inserting_after(result):
            stored = graph.call_function(index_assign, (base, index, result))
        _copy_meta(result, stored, f"{description}, written back into {base.name}")
        for user in base_later:
            user.replace_input_with(base, stored)
    return new


def _without_inplace(module: nn.Module) -> nn.Module:
    """A shallow copy with ``inplace=False``; parameters and submodules stay shared."""
    clone = copy.copy(module)
    for attr in ("_parameters", "_buffers", "_modules"):  # own dicts, so the copy cannot alter the original
        object.__setattr__(clone, attr, dict(getattr(module, attr)))
    clone.inplace = False
    return clone


def _install_module_copies(gm: torch.fx.GraphModule, module_calls: Dict[str, List[Node]]) -> None:
    """Swap a copy with ``inplace=False`` in for each rewritten target.

    GraphModule shares leaf modules with the user's model, so the copy replaces the reference in the
    GraphModule only. If a parent on the path is itself shared (installed whole), or some call of the
    target was kept in place, the copy gets a new name and only the rewritten calls use it.
    """
    installed = {n.target for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    for target, new_nodes in module_calls.items():
        replacement = _without_inplace(gm.get_submodule(target))
        parts = target.split(".")
        shared_parent = any(".".join(parts[:i]) in installed for i in range(1, len(parts)))
        kept = any(n.op == "call_module" and n.target == target and n not in new_nodes for n in gm.graph.nodes)
        if shared_parent or kept:
            name = _fresh_name(gm, target.replace(".", "_") + "_out_of_place")
            gm.add_submodule(name, replacement)
            for n in new_nodes:
                n.target = name
        else:
            parent_path, _, attr = target.rpartition(".")
            setattr(gm.get_submodule(parent_path) if parent_path else gm, attr, replacement)


def _fresh_name(gm: nn.Module, name: str) -> str:
    candidate, i = name, 1
    while hasattr(gm, candidate):
        candidate, i = f"{name}_{i}", i + 1
    return candidate
