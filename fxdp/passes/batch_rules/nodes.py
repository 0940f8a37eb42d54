"""What the generic batch_dim interpreter asks about a node besides its rule.

The interpreter (:mod:`fxdp.passes.batch_dim`) names no op. Everything it needs to know about ops
beyond ``find_batch_rule(op)(call) -> Verdict`` is answered here, per node:

- :func:`record_facts`: remember the values that carry no layout but matter to rules: ints equal to
  the batch size (``x.size(0)``, ``x.shape[0]``, ``len(x)``), shapes (``x.shape``) and
  ``torch.arange(N)`` (each sample's own index);
- :func:`reads_facts`: the node uses such a value, so its rule runs even if no per-sample tensor
  flows in (``torch.zeros(x.size(0), d)`` is batched);
- :func:`selects_element` / :func:`element_layout`: the node picks an element of a tuple, list or
  dict value (``out[0]`` of an LSTM, ``torch.max(x, 1).values``), which has its own layout;
- :func:`stores_item`: the node writes into its first argument and returns nothing (``x[i] = v``);
- :func:`is_inplace`: the node writes its result into its first argument (``x.add_(y)``, ``out += y``,
  ``inplace=True``), so later readers of that argument see the verdict's layout;
- :func:`keeps_sample_index`: applied to ``torch.arange(N)``, the result still indexes each sample's
  own rows (``arange(N).unsqueeze(1)``, ``.view(N, 1)``, ``.long()``).
"""

from __future__ import annotations

import builtins
import operator
from typing import Any, Iterable, Mapping

import torch
import torch.fx

from fxdp.layout import BATCHED, UNKNOWN_LAYOUT, BatchLayout
from fxdp.passes.batch_rules.aten import canonical_target
from fxdp.passes.batch_rules.core import Facts, _norm_dim, mirror

# ops that keep "this is torch.arange(N), each sample's own index" when applied to it
_INDEX_PRESERVING = {"unsqueeze", "view", "reshape", "expand", "contiguous", "to", "long", "int", "clone", "alias",
                     torch.unsqueeze, torch.reshape, operator.getitem}


def _is_batched(layout) -> bool:
    return isinstance(layout, BatchLayout) and layout.kind == BATCHED


def record_facts(n: torch.fx.Node, args, layouts: Mapping[torch.fx.Node, Any], facts: Facts) -> None:
    """Remember ints that are the batch size (x.size(0), x.shape[0]) and torch.arange(N).

    ``args``: the node's argument values; ``layouts``: the layouts of the nodes computed so far.
    """
    op, t = canonical_target(n)  # an ATen node as the fx node it stands for (aten.sym_size.int: x.size(d))
    first = n.args[0] if n.args else None
    lay = layouts.get(first) if isinstance(first, torch.fx.Node) else None
    if op == "call_method" and t == "size" and isinstance(args[0], torch.Tensor):
        d = args[1] if len(args) > 1 else n.kwargs.get("dim")
        if d is None:
            facts.shapes[n] = lay
        elif _is_batched(lay) and _norm_dim(d, args[0].dim()) == lay.dim:
            facts.batch_size.add(n)
    elif (n.op == "call_function" and t is builtins.getattr and args[1] == "shape"
          and isinstance(args[0], torch.Tensor)):
        facts.shapes[n] = lay
    elif op == "call_function" and t is operator.getitem and first in facts.shapes and isinstance(args[1], int):
        shape_of = facts.shapes[first]
        if _is_batched(shape_of) and _norm_dim(args[1], len(args[0])) == shape_of.dim:
            facts.batch_size.add(n)
    elif op == "call_function" and t is builtins.len and _is_batched(lay) and lay.dim == 0:
        facts.batch_size.add(n)
    elif op == "call_function" and t is torch.arange:
        a = list(n.args)
        step_one = n.kwargs.get("step", a[2] if len(a) > 2 else 1) == 1
        end = a[0] if len(a) == 1 else (a[1] if len(a) > 1 and args[0] == 0 else n.kwargs.get("end"))
        if step_one and isinstance(end, torch.fx.Node) and end in facts.batch_size:
            facts.sample_index.add(n)


def reads_facts(n: torch.fx.Node, inputs: Iterable[torch.fx.Node], facts: Facts) -> bool:
    """True when the node computes with a recorded batch size or shape (``inputs``: its input nodes)."""
    return any(isinstance(a, torch.fx.Node) and (a in facts.batch_size or a in facts.shapes)
               for a in inputs) or canonical_target(n)[1] is torch.arange


def selects_element(n: torch.fx.Node, args) -> bool:
    """The node picks an element of a tuple/list/dict value (a tuple output's element, or ``.values``)."""
    return (n.op == "call_function" and n.target in (operator.getitem, builtins.getattr)
            and isinstance(args[0], (tuple, list, dict)))


def element_layout(n: torch.fx.Node, layout, args, out):
    """The layout of ``container[index]`` (or of the field ``index`` of a named tuple like max's),
    given the container's ``layout`` and the node's argument values ``args``."""
    container, index = args[0], args[1]
    if n.target is builtins.getattr:  # torch.return_types: find the field by identity
        index = next((i for i, v in enumerate(container) if v is out), None)
        if index is None:
            return mirror(out, UNKNOWN_LAYOUT)
    try:
        picked = layout[index]
    except (TypeError, KeyError, IndexError):
        return None
    return tuple(picked) if isinstance(index, slice) else picked


def stores_item(n: torch.fx.Node) -> bool:
    """``x[i] = v``: returns nothing, but writes per-sample values into ``x``."""
    return n.target is operator.setitem


def is_inplace(n: torch.fx.Node) -> bool:
    """The op writes its result into its first argument (``x.add_(y)``, ``out += y``, ``inplace=True``)."""
    if n.kwargs.get("inplace") is True:
        return True
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if n.op == "call_function" and getattr(n.target, "__module__", "") in ("_operator", "operator"):
        return name.startswith("i") and name not in ("is_", "is_not", "index", "invert", "itemgetter")
    return n.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("__")


def keeps_sample_index(n: torch.fx.Node) -> bool:
    """Applied to ``torch.arange(N)``, this op's result still indexes each sample's own rows."""
    op, target = canonical_target(n)
    if target is operator.getitem and op == "call_function" and n.target is not operator.getitem:
        return _full_slice(n)  # aten.slice.Tensor: only x[:] keeps every sample's index
    return op != "call_module" and target in _INDEX_PRESERVING


def _full_slice(n: torch.fx.Node) -> bool:
    start = n.args[2] if len(n.args) > 2 else n.kwargs.get("start")
    end = n.args[3] if len(n.args) > 3 else n.kwargs.get("end")
    step = n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= 2 ** 62)) and step == 1
