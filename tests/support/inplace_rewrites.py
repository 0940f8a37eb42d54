"""The inplace pass run on a model, and what a correct rewrite looks like: same outputs, nothing left that
writes in place, the rewrite reported at the user's line (marked ``# <marker>`` in the test file)."""

from __future__ import annotations

import inspect
import operator
import os
import sys
import types

import torch
from torch import nn

from fxdp import meta
from fxdp.diagnostics import Kind, Severity
from fxdp.passes.inplace import remove_inplace_ops
from fxdp.frontends.fx import trace

_IN_PLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.setitem,
}


def line_marked(module: types.ModuleType, marker: str) -> int:
    """Line number in ``module``'s file of the line ending with ``# <marker>``."""
    lines, _ = inspect.getsourcelines(module)
    hits = [number for number, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def remaining_inplace(gm: torch.fx.GraphModule):
    """Nodes that still write in place, found independently of the pass's own classification."""
    left = []
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", n.target if isinstance(n.target, str) else "")
        if n.op == "call_function" and (
            n.target in _IN_PLACE_OPERATORS
            or (name.endswith("_") and name not in ("and_", "or_"))
            or n.kwargs.get("inplace") is True
            or "out" in n.kwargs
        ):
            left.append(n)
        elif n.op == "call_method" and n.target.endswith("_"):
            left.append(n)
        elif n.op == "call_module" and getattr(gm.get_submodule(n.target), "inplace", False) is True:
            left.append(n)
    return left


def clone_all(inputs):
    return tuple(t.clone() for t in inputs)


def rewrite(model: nn.Module):
    traced = trace(model)
    assert traced.ok, traced.reason
    return remove_inplace_ops(traced.graph_module)


def assert_rewritten(model, inputs, *, marker, op, message=None, seed=0):
    """(a) same outputs, (b) nothing in place left, (c) the rewrite reported at the marker's line (in the
    file that defines the model's class)."""
    source = sys.modules[type(model).__module__]
    torch.manual_seed(seed)
    expected = model(*clone_all(inputs))
    result = rewrite(model)
    gm = result.graph_module
    torch.manual_seed(seed)
    actual = gm(*clone_all(inputs))
    torch.testing.assert_close(actual, expected)
    assert remaining_inplace(gm) == [], gm.graph
    report = result.report
    assert report.name == "inplace"
    assert [f for f in report.findings if f.severity is not Severity.INFO] == []
    matching = [c for c in report.changes if c.op.startswith(op)]
    assert matching, [c.op for c in report.changes]
    change = matching[0]
    assert change.kind is Kind.REWRITE and change.severity is Severity.INFO
    assert os.path.samefile(change.location.file, source.__file__)
    assert change.location.line == line_marked(source, marker)
    if message is not None:
        assert change.message == message
    new_nodes = [n for n in gm.graph.nodes if meta.INPLACE_REWRITE in n.meta]
    assert new_nodes and all(n.meta[meta.SOURCE] is not None for n in new_nodes)
    return result
