"""The user's loss, judged on the first step: a compiled model's output carries the batch analysis into the code
between the model and ``backward()``.

On the first training forward of a compiled model (and the first after it is compiled again), the tensors of its
output are returned as :class:`LossProbe` tensors: views of the same data, on the same autograd graph. Every torch
op the user's code runs on one of them (``F.cross_entropy(out, y)``, ``z @ z.T``, ``loss.mean()``) runs as usual
and is also recorded, as a node of a torch.fx graph (:class:`LossRecording`) with the user's line; its tensor
results are probes too. When ``backward()`` (or ``torch.autograd.backward`` / ``grad``) is called on a probe, the
recording, up to that tensor, is handed to the model's :class:`LossAnalysis` (:mod:`fxdp.passes.loss`, which runs
the batch rules; the runtime imports no pass) before anything is differentiated: an op that mixes samples raises
there, a normaliser set by the batch warns, and ``fxdp.report(model)`` lists the loss's findings. Then the probe
steps aside: later forwards return plain tensors (the cost on later steps is one attribute read per forward).
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.fx

from fxdp import meta
from fxdp.diagnostics import PassReport, SampleMixingError, Severity
from fxdp.diagnostics.report import REPORT_ATTR
from fxdp.diagnostics.source import location_of_caller
from fxdp.runtime.guards import run_eagerly

LOSS_WATCH_ATTR = "fxdp_loss_watch"  # where a compiled model holds its LossWatch
SHARED_ATTR = "_fxdp_shared"  # on a tensor marked with fxdp.shared

# properties whose value is a tensor computed from the tensor (a torch.fx graph reads them with getattr)
_TENSOR_PROPERTIES = {"T", "mT", "H", "mH", "real", "imag"}
# reflected operators: the torch.fx op, with the operands swapped back
_REFLECTED = {"__radd__": operator.add, "__rsub__": operator.sub, "__rmul__": operator.mul,
              "__rtruediv__": operator.truediv, "__rdiv__": operator.truediv, "__rpow__": operator.pow,
              "__rmatmul__": operator.matmul, "__rfloordiv__": operator.floordiv, "__rmod__": operator.mod}
_BACKWARDS = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}


class LossAnalysis(Protocol):
    """The compile-time work the probe asks for (implemented by :class:`fxdp.passes.reanalyse.GraphReanalysis`)."""

    def judge_loss(self, graph: torch.fx.GraphModule, values: Sequence[Any], outputs: Sequence[Tuple[int, tuple]],
                   batch_size: int, shared: Sequence[int] = (), guessed: Sequence[int] = ()) -> PassReport:
        """The loss pass's report on ``graph`` (placeholders: ``values``; ``outputs``: (placeholder position,
        path in the model's output) of each output tensor the loss reads; ``shared``: positions of tensors shared
        by all samples; ``guessed``: of tensors read as batched where they have the batch's number of rows)."""


@dataclass
class LossWatch:
    """On a compiled model: whether its next training forward is probed (``armed``), and the recording of the step
    in progress (``pending``, until its loss is judged): started by a batch of the loader (its labels are probes too,
    so what the loss computes from them alone, ``mask.sum()``, is recorded as well) or by the first forward, and
    joined by the step's other forwards (two views of one batch)."""

    armed: bool = True
    report: Any = None  # the report the loss was judged with: a model compiled again has another
    pending: Optional["LossRecording"] = None

    def __getstate__(self):  # a copy of the model judges its own first step
        return {"armed": self.armed, "report": None, "pending": None}

    def wants(self, model) -> bool:
        if not (model.training and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return False
        if not self.armed and self.report is not getattr(model, REPORT_ATTR, None):
            self.armed = True  # compiled again since: its loss is judged again
        return self.armed

    def probe_batch(self, batch):
        """A batch of the loader, its tensors probes of a new recording, while the loss is still to be judged."""
        if not self.armed or torch.compiler.is_compiling():
            return batch
        self.pending = LossRecording(self)
        return self.pending.leaves(batch, ("batch",), output=False)

    def probe(self, model, output, analysis: LossAnalysis, batch_size: Optional[int]):
        """``output`` with its tensors as probes of the step's recording (a new one for another batch size); as it
        is where the batch size is unknown."""
        if batch_size is None:
            return output
        recording = self.pending
        if recording is None or recording.done or recording.model not in (None, model) or \
                recording.batch_size not in (0, batch_size):
            recording = LossRecording(self)
        recording.model, recording.analysis, recording.batch_size = model, analysis, batch_size
        self.pending = recording
        return recording.leaves(output, ())

    def judged(self, model, report: PassReport) -> None:
        """The loss was judged: ``report`` joins the model's report, and the probe steps aside."""
        add_loss_report(model, report)
        self.armed, self.report = False, getattr(model, REPORT_ATTR, None)


def shared(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as the same for every sample (a vector of weights, a temperature) for the analysis of the
    loss: a tensor the loss reads besides the model's output and the loader's batch is otherwise read as one row
    per sample where it has the batch's number of rows. Returns ``tensor``."""
    setattr(tensor, SHARED_ATTR, True)
    return tensor


def batch_probe_of(model) -> Optional[Callable[[Any], Any]]:
    """What a loader feeding ``model`` hands its batches to (``DPDataLoader.batch_probe``): the compiled model's
    :meth:`LossWatch.probe_batch`, or None for a model that judges no loss."""
    watch = getattr(model, "__dict__", {}).get(LOSS_WATCH_ATTR)
    return watch.probe_batch if watch is not None else None


def add_loss_report(model, report: PassReport) -> None:
    """``report`` (the loss pass's) in ``fxdp.report(model)``, in place of an earlier one."""
    previous = getattr(model, REPORT_ATTR, None)
    if previous is not None:
        passes = tuple(p for p in previous.passes if p.name != report.name) + (report,)
        setattr(model, REPORT_ATTR, dataclasses.replace(previous, passes=passes))


def warn_of(report: PassReport) -> None:
    """Raise the loss's errors (ops that mix samples); warn of its other findings."""
    errors = [f for f in report.findings if f.severity is Severity.ERROR]
    if errors:
        raise SampleMixingError(errors, "fxdp: the loss computed from the model's output lets samples influence "
                                        "each other, so DP-SGD cannot train with it (nothing was differentiated):")
    caller = location_of_caller()
    for f in report.findings:
        where = f" at {f.where} ({f.location.code})" if f.location is not None and f.location.code else ""
        message = f"fxdp loss: {f.op}{where}: {f.message}. {f.fix}"
        if caller is None:
            warnings.warn(message, stacklevel=2)
        else:  # at the user's line that asked for the gradient
            warnings.warn_explicit(message, UserWarning, caller.file, caller.line)


def plain(value, detach: bool = True):
    """``value`` with its probes as plain tensors, detached (what an analysis reads) unless ``detach`` is False."""
    if isinstance(value, LossProbe):
        with torch._C.DisableTorchFunctionSubclass():
            return value.detach() if detach else value.as_subclass(torch.Tensor)
    if isinstance(value, torch.Tensor):
        return value.detach() if detach else value
    if isinstance(value, (tuple, list)):
        return type(value)(plain(v, detach) for v in value)
    if isinstance(value, dict):
        return type(value)({k: plain(v, detach) for k, v in value.items()}) if type(value) is dict else value
    return value


class LossRecording:
    """The ops run on a compiled model's output until the first backward, as a torch.fx graph."""

    def __init__(self, watch: LossWatch):
        self.watch = watch
        self.model, self.analysis, self.batch_size = None, None, 0  # set by the forward whose output it follows
        self.graph = torch.fx.Graph()
        self.values: List[Any] = []  # one per placeholder
        self.outputs: List[Tuple[int, tuple]] = []  # (placeholder position, path in the output)
        # per placeholder: "output" (the model's), "batch" (the loader's), "shared" (a parameter, or a tensor marked
        # with fxdp.shared), "guessed" (another tensor: batched where it has N rows)
        self.kinds: List[str] = []
        self._inputs: Dict[int, torch.fx.Node] = {}  # id of a tensor the loss reads -> its placeholder
        self._first_op: Optional[torch.fx.Node] = None
        self.done = False

    # -- building the graph -------------------------------------------------------------------------------

    def _placeholder(self, value: torch.Tensor, kind: str) -> torch.fx.Node:
        if self._first_op is None:
            node = self.graph.placeholder(f"input_{len(self.values)}")
        else:
            with self.graph.inserting_before(self._first_op):
                node = self.graph.placeholder(f"input_{len(self.values)}")
        self.values.append(plain(value))
        self.kinds.append(kind)
        return node

    def leaves(self, value, path: tuple, output: bool = True):
        """``value`` (the model's output, or with ``output=False`` a batch of the loader) with each tensor a probe
        (a placeholder of the graph)."""
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter):
            if output:
                self.outputs.append((len(self.values), path))
            return LossProbe.of(value, self._placeholder(value, "output" if output else "batch"), self)
        if isinstance(value, dict):
            for key in list(value.keys()):
                value[key] = self.leaves(value[key], (*path, key), output)
            return value
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            return type(value)(self.leaves(v, (*path, i), output) for i, v in enumerate(value))
        return value

    def _arg(self, value):
        if isinstance(value, LossProbe) and value._fxdp_recording is self:
            return value._fxdp_node
        if isinstance(value, torch.Tensor):
            key = id(value)
            if key not in self._inputs:
                shared = getattr(value, SHARED_ATTR, False) or isinstance(value, torch.nn.Parameter)
                self._inputs[key] = self._placeholder(value, "shared" if shared else "guessed")
            return self._inputs[key]
        if isinstance(value, (tuple, list)):
            return type(value)(self._arg(v) for v in value)
        if isinstance(value, dict):
            return {k: self._arg(v) for k, v in value.items()}
        return value

    def record(self, func, args: tuple, kwargs: dict, out):
        """Add the call to the graph; its tensor results as probes (``out`` as it is if the call is not recorded)."""
        op = _fx_op(func, args)
        if op is None or not _has_tensor(out):
            return out
        kind, target, fx_args = op
        node = self.graph.create_node(kind, target, self._arg(tuple(fx_args)), self._arg(dict(kwargs)))
        if self._first_op is None:
            self._first_op = node
        node.meta[meta.SOURCE] = location_of_caller()
        if out is (args[0] if args else None) and isinstance(out, LossProbe) and out._fxdp_recording is self:
            out._fxdp_node = node  # an in-place op: the tensor now holds the op's result
            return out
        return self._wrap(out, node)

    def _wrap(self, out, node: torch.fx.Node):
        if isinstance(out, torch.Tensor):
            return LossProbe.of(out, node, self)
        if isinstance(out, (tuple, list)):
            items = [self._wrap(v, self.graph.call_function(operator.getitem, (node, i))) if isinstance(v, torch.Tensor)
                     else v for i, v in enumerate(out)]
            return type(out)(items) if not hasattr(out, "n_fields") else type(out)(tuple(items))
        return out

    # -- judging ----------------------------------------------------------------------------------------

    def judge(self, losses: Sequence["LossProbe"]) -> None:
        """Run the loss analysis on the graph up to ``losses``; raise what mixes samples, warn of the rest."""
        self.done = True  # nothing after this is the loss
        if self.watch.pending is self:
            self.watch.pending = None
        mine = [t._fxdp_node for t in losses if isinstance(t, LossProbe) and t._fxdp_recording is self]
        if not mine or self.model is None:  # a loss of the batch alone (no output of the model): not judged here
            return
        self.graph.output(mine[0] if len(mine) == 1 else tuple(mine))
        self.graph.eliminate_dead_code()  # (placeholders stay: one per value)
        gm = torch.fx.GraphModule(torch.nn.Module(), self.graph)
        report = self.analysis.judge_loss(gm, self.values, self.outputs, self.batch_size,
                                          shared=[i for i, k in enumerate(self.kinds) if k == "shared"],
                                          guessed=[i for i, k in enumerate(self.kinds) if k == "guessed"])
        warn_of(report)
        self.watch.judged(self.model, report)


class LossProbe(torch.Tensor):
    """A tensor of a compiled model's output on the first step: see the module docstring."""

    _fxdp_node: torch.fx.Node
    _fxdp_recording: LossRecording

    @staticmethod
    def of(t: torch.Tensor, node: torch.fx.Node, recording: LossRecording) -> "LossProbe":
        probe = t.as_subclass(LossProbe)
        probe._fxdp_node, probe._fxdp_recording = node, recording
        return probe

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # a loss torch.compile traces: not judged, and the probe steps aside
            run_eagerly(_compiled_loss, args, kwargs)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        recording = _recording_of(args, kwargs)
        if recording is not None and func in _BACKWARDS:
            recording.judge(_losses(func, args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if recording is None or func in _BACKWARDS:
            return out
        return recording.record(func, args, kwargs, out)


def _recording_of(args, kwargs) -> Optional[LossRecording]:
    for value in (*args, *kwargs.values()):
        for t in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(t, LossProbe) and not t._fxdp_recording.done:
                return t._fxdp_recording
    return None


def _compiled_loss(args, kwargs) -> None:
    recording = _recording_of(args, kwargs)
    if recording is None or recording.model is None:
        return
    recording.done = True
    model, watch = recording.model, recording.watch
    if watch.pending is recording:
        watch.pending = None
    note = ("loss: not judged: the first step's loss ran under torch.compile (run the first step's loss eagerly, "
            "or give make_private the criterion)")
    previous = getattr(model, REPORT_ATTR, None)
    if previous is not None and note not in previous.notes:
        setattr(model, REPORT_ATTR, dataclasses.replace(previous, notes=(*previous.notes, note)))
        warnings.warn(f"fxdp: {note}; see docs/losses.md", stacklevel=2)
    watch.armed, watch.report = False, getattr(model, REPORT_ATTR, None)


def _losses(func, args, kwargs) -> List[Any]:
    if func is torch.Tensor.backward:
        return [args[0]]
    tensors = kwargs.get("tensors", kwargs.get("outputs", args[0] if args else ()))
    return list(tensors) if isinstance(tensors, (tuple, list)) else [tensors]


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _fx_op(func, args: tuple) -> Optional[Tuple[str, Any, tuple]]:
    """The torch.fx node a call becomes: ``(op, target, args)``, or None for what is not recorded (properties
    that are not tensors: ``shape``, ``dtype``, ``requires_grad``)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        return ("call_function", builtins.getattr, (args[0], prop)) if prop in _TENSOR_PROPERTIES else None
    if name in _REFLECTED:
        return "call_function", _REFLECTED[name], (args[1], args[0])
    if getattr(func, "__qualname__", "").startswith(("Tensor.", "TensorBase.")):  # a method (x ** 2 too)
        if name.startswith("__") and name.endswith("__"):
            fn = getattr(operator, name.strip("_"), None) or getattr(operator, name.strip("_") + "_", None)
            return ("call_function", fn, args) if fn is not None else ("call_method", name, args)
        return "call_method", name, args
    return "call_function", func, args
