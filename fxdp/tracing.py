"""The front ends: torch.fx symbolic tracing first, torch.export second; every node remembers the line
of the user's code that created it.

- Modules with a per-sample rule (and the usual ``torch.nn`` layers) stay leaves: the graph calls
  them whole, so the per_sample pass can apply their rule.
- Augmented assignment (``out += x``) and item assignment (``x[m] = v``) on traced tensors are
  recorded as ``operator.iadd`` / ``operator.setitem`` nodes instead of being silently turned into
  out-of-place ops (``+=``) or failing (``[]=``); the inplace pass then rewrites and reports them.
- A model that torch.fx cannot trace is captured with ``torch.export`` (non-strict) when example inputs
  are given (:mod:`fxdp.export_capture`: a graph of ATen ops, the batch dimension dynamic).
- A model neither can capture is not an error: :func:`trace` returns both errors and the user's line
  (the compiler then falls back to the hooks engine).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import pickle
import warnings
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.fx
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from fxdp import export_capture, meta
from fxdp.diagnostics.errors import UnsupportedInputError
from fxdp.diagnostics.source import SourceLocation, location_from_stack_trace, location_from_traceback
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.runtime.guards import run_eagerly
from fxdp.sinks.model_methods import OpacusModelMethods

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
        node.meta[meta.SOURCE] = location_from_stack_trace(node.stack_trace)
        return proxy


@dataclass(frozen=True)
class TraceResult:
    graph_module: Optional[torch.fx.GraphModule]
    error: Optional[BaseException] = None
    location: Optional[SourceLocation] = None  # the user's line that made tracing fail
    fixed_to_none: Tuple[str, ...] = ()  # optional inputs traced as None
    # a dict subclass forward returns (a ModelOutput-like OrderedDict): the graph returns a plain dict
    output_type: Optional[type] = None
    front_end: Optional[str] = None  # "torch.fx" or "torch.export" (fxdp.export_capture); None: no graph
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
    the model on them (:mod:`fxdp.export_capture`); ``front_end`` says which graph this is and
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
            exported = export_capture.capture(model, example_inputs, batch_dim)
        except Exception as export_exc:  # noqa: BLE001 - export's failures are reported outcomes too
            return TraceResult(None, exc, location, export_error=export_exc)
        return TraceResult(exported, exc, location, front_end=export_capture.FRONT_END)
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


class OutputType:
    """A forward hook giving a compiled model's output the type the model's own forward returns."""

    def __init__(self, cls: type):
        self.cls = cls

    def __call__(self, module, args, output):
        if isinstance(output, dict) and type(output) is not self.cls:
            try:
                return self.cls(**output)
            except TypeError:
                return self.cls(output)
        return None


# -- compiled graphs survive deepcopy, pickle and torch.save ------------------------------------------
#
# torch.fx rebuilds a GraphModule from its code on load and on deepcopy, keeping only the attributes
# the graph uses: a compiled model's report, its sink and its forward hooks (the analysis on the first
# batch) would be lost. A compiled model's class is a subclass of CompiledGraphModule, which carries them.

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class CompiledGraphModule(OpacusModelMethods, torch.fx.GraphModule):
    """A GraphModule whose copies (deepcopy, pickle, torch.save) keep every attribute and forward hook.
    ``_module`` and :meth:`to_standard_module` give the model it was compiled from (the same parameters)."""

    def _standard_module(self) -> nn.Module:
        guard = self.__dict__.get("fxdp_batch")
        original = getattr(getattr(guard, "context", None), "original", None)
        return original if original is not None else self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_module":  # Opacus's name for the wrapped model; a submodule of that name comes first
                return self._standard_module()
            raise

    def __call__(self, *args, **kwargs):
        # a model changed since it was compiled (a layer replaced, a parameter unfrozen) is compiled again
        # before its forward runs (fxdp.runtime.structure): the graph's code calls what it was compiled with
        guard = self.__dict__.get("fxdp_batch")
        if guard is not None:
            run_eagerly(guard.before_forward, self, args, kwargs)  # (also under torch.compile)
        return super().__call__(*args, **kwargs)

    # torch.fx saves the code and re-traces it on load, which renames the nodes (the DP-aware ops'
    # sites refer to them by name): the graph itself is saved instead.
    def __reduce__(self):
        body = self.__dict__.copy()
        original = body.pop("_graph")
        graph = torch.fx.Graph()
        with _quiet_pytree_specs():
            graph._codegen = copy.deepcopy(original._codegen)  # torch.export's: flattens inputs, rebuilds outputs
        graph.output(graph.graph_copy(original, {}))
        for node in graph.nodes:  # analysis results (fake tensors) are not needed to run, nor picklable
            node.meta = {k: v for k, v in node.meta.items() if _picklable(v)}
        return (_rebuild_compiled, (body, graph, type(self).__mro__[1].__name__))

    def __deepcopy__(self, memo):
        with _quiet_pytree_specs():
            res = super().__deepcopy__(memo)
            copied = copy.deepcopy(self.__dict__, memo)  # the objects the copy already holds, via memo
        for key, value in copied.items():
            if key in _HOOK_DICTS or key not in res.__dict__:
                res.__dict__[key] = value
        res.training = self.training
        _relink(res)
        return res


@contextlib.contextmanager
def _quiet_pytree_specs():
    """Copying torch.export's pytree specs (in a captured graph's code generator) warns about a check
    torch itself makes (``isinstance(treespec, LeafSpec)``, deprecated); the user can do nothing about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        yield


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - anything pickle refuses
        return False
    return True


def _rebuild_compiled(body, graph, class_name):
    with _quiet_pytree_specs():
        return _rebuild(body, graph, class_name)


def _rebuild(body, graph, class_name):
    holder = nn.Module()
    holder.__dict__.update(body)
    gm = make_copyable(torch.fx.GraphModule(holder, graph, class_name))
    for key, value in body.items():  # what the graph does not use (report, sink, hooks, ...)
        if key in _HOOK_DICTS or key not in gm.__dict__:
            gm.__dict__[key] = value
    _relink(gm)
    return gm


def _relink(gm: torch.fx.GraphModule) -> None:
    """Attributes that refer back to their model (an ``fxdp_relink(model)`` method) point at the copy."""
    for value in list(gm.__dict__.values()):
        relink = getattr(value, "fxdp_relink", None)
        if callable(relink):
            relink(gm)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule running a copy of ``gm``'s graph on the same parameters and layers, with what the
    graph's code reads besides them (torch.export's input and output specs); it copies and pickles as
    compiled models do."""
    with _quiet_pytree_specs():
        graph = copy.deepcopy(gm.graph)
    copied = torch.fx.GraphModule(gm, graph, type(gm).__name__)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(gm, attr):
            setattr(copied, attr, getattr(gm, attr))
    return make_copyable(copied)


def make_copyable(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give ``gm`` (in place) a class derived from :class:`CompiledGraphModule`; returns ``gm``."""
    if not isinstance(gm, CompiledGraphModule):
        # GraphModule gives each instance a class of its own (its forward is set on the class)
        impl = type("GraphModuleImpl", (CompiledGraphModule,), {})
        impl.__qualname__ = "GraphModuleImpl"
        gm.__class__ = impl
        gm.recompile()
    return gm
