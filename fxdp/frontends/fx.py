"""The first front end, torch.fx symbolic tracing (torch.export second); every node remembers the line
of the user's code that created it.

- Modules with a per-sample rule (and the usual ``torch.nn`` layers) stay leaves: the graph calls
  them whole, so the per_sample pass can apply their rule.
- Augmented assignment (``out += x``) and item assignment (``x[m] = v``) on traced tensors are
  recorded as ``operator.iadd`` / ``operator.setitem`` nodes instead of being silently turned into
  out-of-place ops (``+=``) or failing (``[]=``); the inplace pass then rewrites and reports them.
- A model that torch.fx cannot trace is captured with ``torch.export`` (non-strict) when example inputs
  are given (:mod:`fxdp.frontends.export`: a graph of ATen ops, the batch dimension dynamic).
- A model neither can capture is not an error: :func:`trace` returns both errors and the user's line
  (the compiler then falls back to the hooks engine).
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.fx
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from fxdp import meta
from fxdp.frontends import export
from fxdp.diagnostics.errors import UnsupportedInputError
from fxdp.diagnostics.source import (
    SourceLocation,
    build_location,
    called_by_torch,
    location_from_stack_trace,
    location_from_traceback,
    location_of_caller,
)
from fxdp.grad_sample.registry import find_grad_sampler


def source_location(node: torch.fx.Node) -> Optional[SourceLocation]:
    """Where in the user's code ``node`` was created, if known."""
    loc = node.meta.get(meta.SOURCE)
    if loc is None:
        loc = location_from_stack_trace(node.stack_trace)
    return loc


class _InplaceRecordingProxy(torch.fx.Proxy):
    """A Proxy that records ``x += y`` and ``x[i] = v`` as in-place nodes."""

    def __setitem__(self, index, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})


def _make_inplace_magic(name):
    op = getattr(operator, name)

    def impl(self, other):
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    impl.__name__ = f"__{name}__"
    return impl


for _name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
              "iand", "ior", "ixor", "ilshift", "irshift"):
    setattr(_InplaceRecordingProxy, f"__{_name}__", _make_inplace_magic(_name))


def is_leaf_layer(module: nn.Module) -> bool:
    """Modules the graph calls whole: torch.nn layers, subclasses of them that keep torch's ``forward``
    (``fxdp.layers.DPLSTM``), and anything with a registered per-sample rule.

    A user's subclass of a layer that overrides ``forward`` (``class CosineLinear(nn.Linear)``) has no
    rule (:mod:`fxdp.registry`), so it is traced into like any composite module."""
    if find_grad_sampler(module) is not None:
        return True
    if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return False
    forward_from = getattr(type(module).forward, "__module__", None) or ""
    return type(module).__module__.startswith("torch.nn") or forward_from.startswith("torch.nn.")


class DPTracer(torch.fx.Tracer):
    def __init__(self):
        super().__init__()
        self.record_stack_traces = True
        # buffers appear as get_attr nodes, so writes to them in forward are visible to the passes
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_leaf_layer(m)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _InplaceRecordingProxy(node, self)

    _depth = 0
    _caller_file: Optional[str] = None  # the user's file that called fxdp, found once per trace
    last_value_type: Optional[type] = None  # after trace: the type of what forward returned

    def create_arg(self, a):
        # the last top-level value turned into graph arguments is forward's return value
        self._depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.last_value_type = type(a)

    def create_proxy(self, *args, **kwargs):
        proxy = super().create_proxy(*args, **kwargs)
        node = proxy.node
        node.meta[meta.SOURCE] = self._source(node)
        return proxy

    def _source(self, node: torch.fx.Node) -> Optional[SourceLocation]:
        # a layer torch's code calls (nn.Sequential's forward) is located where the user's code built it
        if node.op == "call_module" and hasattr(self, "root") and called_by_torch(node.stack_trace):
            if self._caller_file is None:
                caller = location_of_caller()
                self._caller_file = caller.file if caller is not None else ""
            built = build_location(self.root, node.target, self._caller_file)
            if built is not None:
                return built
        return location_from_stack_trace(node.stack_trace)


@dataclass(frozen=True)
class TraceResult:
    graph_module: Optional[torch.fx.GraphModule]
    error: Optional[BaseException] = None
    location: Optional[SourceLocation] = None  # the user's line that made tracing fail
    fixed_to_none: Tuple[str, ...] = ()  # optional inputs traced as None
    # a dict subclass forward returns (a ModelOutput-like OrderedDict): the graph returns a plain dict
    output_type: Optional[type] = None
    front_end: Optional[str] = None  # "torch.fx" or "torch.export" (fxdp.frontends.export); None: no graph
    export_error: Optional[BaseException] = None  # why torch.export failed too (error: why torch.fx failed)

    @property
    def ok(self) -> bool:
        return self.graph_module is not None

    @property
    def reason(self) -> Optional[str]:
        if self.error is None:
            return None
        return _one_line(self.error)

    @property
    def export_reason(self) -> Optional[str]:
        return None if self.export_error is None else _one_line(self.export_error)


def _one_line(error: BaseException) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}"


def _unused_optional_inputs(model: nn.Module, example_inputs) -> Dict[str, None]:
    """Inputs of ``forward`` that default to None and that ``example_inputs`` does not give.

    They are traced as None (``if mask is not None:`` takes its None branch); the compiled model then
    refuses another value for them with a clear message."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    if isinstance(example_inputs, dict):
        given = set(example_inputs)
    else:
        count = 1 if isinstance(example_inputs, torch.Tensor) else len(example_inputs)
        given = {p.name for p in params[:count]}
    return {p.name: None for p in params
            if p.default is None and p.name not in given
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _packed_input(example_inputs) -> Optional[str]:
    """Which example input is a PackedSequence ("input 0", "input 'x'"), if one is."""
    if isinstance(example_inputs, PackedSequence):
        return "the example input"
    items = example_inputs.items() if isinstance(example_inputs, dict) else (
        enumerate(example_inputs) if isinstance(example_inputs, (list, tuple)) else ())
    for key, value in items:
        if isinstance(value, PackedSequence):
            return f"example input {key!r}"
    return None


def trace(model: nn.Module, example_inputs=None, batch_dim: int = 0) -> TraceResult:
    """Trace ``model`` into a GraphModule, or say why it cannot be traced and where.

    torch.fx first; when it fails and ``example_inputs`` are given, torch.export (non-strict) captures
    the model on them (:mod:`fxdp.frontends.export`); ``front_end`` says which graph this is and
    ``error`` why torch.fx failed. With ``example_inputs``, inputs that default to None and are not
    among them are traced as None. ``batch_dim``: where the batch sits in the inputs (dynamic in the
    captured graph)."""
    packed = _packed_input(example_inputs)
    if packed is not None:  # no graph can say which packed row is whose: the hooks engine maps them
        return TraceResult(None, UnsupportedInputError(
            f"fxdp: {packed} is a PackedSequence: its rows interleave the samples by time step, which the "
            "graph's batch analysis cannot follow; the hooks engine maps each packed row to its sample instead"))
    tracer = DPTracer()
    fixed = _unused_optional_inputs(model, example_inputs) if example_inputs is not None else {}
    try:
        with _state_restored(model):
            graph = tracer.trace(model, concrete_args=fixed or None)
    except Exception as exc:  # any Python the tracer cannot follow is a reported outcome
        location = location_from_traceback(exc.__traceback__)
        if example_inputs is None:
            return TraceResult(None, exc, location)
        try:
            exported = export.capture(model, example_inputs, batch_dim)
        except Exception as export_exc:  # noqa: BLE001 - export's failures are reported outcomes too
            return TraceResult(None, exc, location, export_error=export_exc)
        return TraceResult(exported, exc, location, front_end=export.FRONT_END)
    name = type(model).__name__
    gm = torch.fx.GraphModule(tracer.root, graph, name)
    gm.training = model.training  # not gm.train(): that would also reset the user's submodules' modes
    returned = tracer.last_value_type
    output_type = returned if returned is not None and issubclass(returned, dict) and returned is not dict else None
    return TraceResult(gm, fixed_to_none=tuple(fixed), output_type=output_type, front_end="torch.fx")


@contextlib.contextmanager
def _state_restored(model: nn.Module):
    """Symbolic tracing runs ``forward`` with proxies: ``self.count += 1`` stores a Proxy in the buffer.
    Every module's buffers and parameters are put back as they were afterwards."""
    saved = [(m, dict(m._buffers), dict(m._parameters)) for m in model.modules()]
    try:
        yield
    finally:
        for m, buffers, params in saved:
            m._buffers.update(buffers)
            m._parameters.update(params)
