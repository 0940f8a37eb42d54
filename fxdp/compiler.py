"""``compile_for_dp``: trace, run the passes by name, emit a GraphModule (or fall back, and say why).

This module is the ONE place an engine is chosen (:func:`compile_for_dp`, :func:`wrap_model`); the
report names it (``fx``, ``fx+whole-model``, ``hooks``, ``ew``, ``functorch``, ``no_op``) and says why.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect as inspect_module
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.fx
from torch import nn

from fxdp import meta, runtime
from fxdp.diagnostics import (
    BatchDimAnalysisError,
    BatchMixingError,
    CompileReport,
    FxdpError,
    GradientCheckpointingError,
    Kind,
    ModelChangedError,
    NotPrivateError,
    PassError,
    PassReport,
    PassResult,
    Severity,
    UnsupportedInputError,
)
from fxdp.engines import (
    ExpandedWeightsGradSampleModule,
    FunctorchGradSampleModule,
    GradSampleHooks,
    GradSampleModule,
    NoOpGradSampleModule,
    check_grad_sample_mode,
)
from fxdp.engines.base import user_hooks
from fxdp.engines.hooks import fallback_self_check
from fxdp.engines.whole_model import whole_model_op
from fxdp.export_capture import FRONT_END, ExportShapeError, ExportShapeGuard, flat_inputs, symbolic_batch
from fxdp.engines.wrappers import AlreadyCompiledError, unwrap_or_refuse  # noqa: F401  (re-exported)
from fxdp.grad_sample.generic import check_loss_reduction
from fxdp.grad_sample.moe import describe_moe_blocks
from fxdp.layout import PACKED, BatchLayout
from fxdp.passes.batch_dim import batched_input_names, bind_inputs, propagate_batch_dim
from fxdp.passes.inplace import remove_inplace_ops
from fxdp.passes.per_sample import batch_source, insert_per_sample_ops, one_sample_layouts, update_site_layouts
from fxdp.passes.validate import validate_graph
from fxdp.sinks.bookkeeping import BookkeepingSink, describe_plans, plan_graph
from fxdp.sinks.contract import GradientSink, GradSampleSink, sink_of
from fxdp.tracing import OutputType, copy_graph_module, make_copyable, trace
from fxdp.diagnostics.errors import expect_module

_REPORT_ATTR = "fxdp_report"


# Errors that already tell the user what is wrong and where (NotPrivateError, BatchDimAnalysisError,
# ...); anything else from a pass is a PassError.
_USER_ERRORS = (FxdpError,)


def _run(name: str, fn: Callable[..., PassResult], gm: torch.fx.GraphModule, reports: List[PassReport], **kwargs):
    try:
        result = fn(gm, **kwargs)
    except _USER_ERRORS:
        raise
    except Exception as exc:
        raise PassError(name, exc) from exc
    reports.append(result.report)
    return result.graph_module


def _analyse(model: nn.Module, example_inputs, batch_dim: int, strict: bool, batch_inputs=None):
    """Trace and run the analysis passes. Returns (graph module or None, trace result, pass reports)."""
    traced = trace(model, example_inputs, batch_dim)
    if not traced.ok:
        return None, traced, []
    reports: List[PassReport] = []
    gm = _run("validate", validate_graph, traced.graph_module, reports, strict=strict)
    gm = _run("inplace", remove_inplace_ops, gm, reports)
    if example_inputs is not None:
        gm = _run("batch_dim", propagate_batch_dim, gm, reports, example_inputs=example_inputs,
                  batch_dim=batch_dim, strict=strict, batch_inputs=batch_inputs)
    return gm, traced, reports


def _make_report(model, traced, reports, engine="fx", fallback_reason=None, fallback_location=None, notes=()):
    if traced.fixed_to_none:
        notes = [*notes, f"traced with {', '.join(traced.fixed_to_none)} = None (they default to None and "
                         "example_inputs does not give them); give them in example_inputs to use them"]
    notes = [*notes, *describe_moe_blocks(model)]
    front_end_reason = None
    if not traced.ok:
        fallback_reason = f"the model cannot be traced by torch.fx ({traced.reason})"
        if isinstance(traced.error, UnsupportedInputError):  # its inputs, not its code, keep it out of a graph
            fallback_reason = traced.reason
        elif traced.export_error is not None:
            fallback_reason += f", nor captured by torch.export ({traced.export_reason})"
        elif traced.error is not None:
            fallback_reason += "; pass example_inputs to let fxdp capture it with torch.export instead"
        fallback_location = traced.location
        engine = "hooks"
    elif traced.error is not None:  # captured by the second front end: say why the first failed, and where
        where = f" at {traced.location}" if traced.location else ""
        front_end_reason = f"torch.fx could not trace the model{where} ({traced.reason})"
        guard = getattr(traced.graph_module, "fxdp_input_shapes", None)
        if guard is not None:
            notes = [*notes, f"torch.export: the graph runs inputs of shapes {guard.describe()} (N: any batch size); "
                             "inputs of other sizes are captured again before their forward (once per shape)"]
    return CompileReport(type(model).__name__, traced.ok, tuple(reports), fallback_reason, fallback_location,
                         engine, tuple(notes), traced.front_end, front_end_reason)


_NO_INPUTS_NOTE = ("batch_dim: not run (no example_inputs); compile_for_dp runs it on the first batch, "
                   "before its backward")


def inspect(model: nn.Module, example_inputs: Any = None, batch_dim: int = 0, strict: bool = False,
            batch_inputs: Optional[Tuple[str, ...]] = None) -> CompileReport:
    """The report ``compile_for_dp`` would produce, without compiling (the model is not changed)."""
    expect_module(model, "fxdp.inspect(model, ...)")
    gm, traced, reports = _analyse(model, example_inputs, batch_dim, strict, batch_inputs)
    notes = [_NO_INPUTS_NOTE] if traced.ok and example_inputs is None else []
    if not traced.ok:
        reports.append(fallback_self_check(model, example_inputs, batch_dim, strict))
    return _make_report(model, traced, reports, notes=notes)


def report(compiled: nn.Module) -> CompileReport:
    """The CompileReport of a model returned by :func:`compile_for_dp`."""
    rep = getattr(compiled, _REPORT_ATTR, None)
    if rep is None:
        raise ValueError(f"{type(compiled).__name__} was not produced by fxdp.compile_for_dp; "
                         "use fxdp.inspect(model, example_inputs) to analyse a plain model")
    return rep


def _refuse_if_not_private(reports: List[PassReport], when: str = "") -> None:
    errors = [f for r in reports for f in r.findings if f.severity is Severity.ERROR]
    if not errors:
        return
    mixing = [f for f in errors if f.kind is Kind.MIXES_SAMPLES]
    header = (
        "The model mixes samples across the batch dimension, so it cannot be trained with DP-SGD: "
        "each sample's computation must not read another sample's data."
        if mixing else
        "The model cannot be trained with DP-SGD as it is. Fix the findings below "
        "(fxdp.validators.ModuleValidator.fix(model) replaces BatchNorm and in-place flags)."
    ) + when
    raise (BatchMixingError if mixing else NotPrivateError)(errors, header)


def compile_for_dp(
    model: nn.Module,
    example_inputs: Any = None,
    batch_dim: int = 0,
    loss_reduction: str = "mean",
    strict: bool = False,
    grad_sample_mode: str = "fx",
    sink: Optional[GradientSink] = None,
    batch_inputs: Optional[Tuple[str, ...]] = None,
) -> nn.Module:
    """Make ``model`` compute per-sample gradients: after ``loss.backward()`` every trainable parameter
    ``p`` has ``p.grad_sample`` of shape ``(N, *p.shape)``, row i being sample i's own gradient.

    ``sink``: where the model's DP-aware ops deliver in backward (``model.fxdp_sink``). By default a
    :class:`~fxdp.sinks.contract.GradSampleSink`, which writes ``p.grad_sample``; a
    :class:`~fxdp.sinks.bookkeeping.BookkeepingSink` keeps per-sample norms and clipped sums
    instead (no ``p.grad_sample``, no ``p.grad`` for the layers it book-keeps: the DP optimizer writes it).

    Returns a ``torch.fx.GraphModule`` sharing the model's parameters, or — when the model cannot be
    traced — the hooks engine around it; ``fxdp.report(result)`` says which and why. Raises
    :class:`fxdp.diagnostics.NotPrivateError` for a model DP-SGD cannot train (BatchNorm in training,
    ops that mix samples), with a table of the findings.

    ``batch_inputs``: names (or positions) of the forward() inputs that hold one row per sample at
    ``batch_dim``; the others are shared by all samples (masks, position ids). Without it fxdp finds
    them from all inputs and the graph, and asks for it when the inputs can be read two ways.

    The compiled model guards what its analysis assumed: a forward on input shapes not analysed yet
    re-runs the analysis for them (once per shape signature) or raises an fxdp error before any
    per-sample gradient is computed (see docs/per_sample.md, "Guards").
    """
    expect_module(model, "fxdp.compile_for_dp(model, ...)")
    check_loss_reduction(loss_reduction)
    check_grad_sample_mode(grad_sample_mode)
    if batch_dim not in (0, 1):
        raise ValueError(f"batch_dim must be 0 (batch first) or 1 (time major), got {batch_dim!r}")
    model = unwrap_or_refuse(model)
    _refuse_checkpointing(model)

    if sink is not None and grad_sample_mode in ("ew", "no_op"):
        raise ValueError(f"fxdp: grad_sample_mode={grad_sample_mode!r} writes p.grad_sample itself and delivers "
                         "nothing to a sink; leave sink=None, or use grad_sample_mode='fx' or 'hooks'")
    gm, traced, reports = _analyse(model, example_inputs, batch_dim, strict, batch_inputs)
    _refuse_if_not_private(reports)
    if gm is None or grad_sample_mode != "fx":
        # an explicit engine is honoured (none of them needs a trace); "fx" falls back to hooks
        engine = grad_sample_mode if grad_sample_mode != "fx" else "hooks"
        wrapped = _wrap(model, engine, batch_first=(batch_dim == 0), loss_reduction=loss_reduction,
                        require_verified=strict, sink=sink)
        reason = None if gm is None else f"grad_sample_mode={grad_sample_mode!r} was asked for"
        rep = _make_report(model, traced, reports, engine, reason, notes=_bookkeeping_notes(sink, engine))
        if gm is None and engine != "hooks":
            rep = dataclasses.replace(rep, engine=engine, fallback_reason=(
                f"grad_sample_mode={grad_sample_mode!r} was asked for (and {rep.fallback_reason})"))
        setattr(wrapped, _REPORT_ATTR, rep)
        return wrapped

    hooked = _user_hooks(model, traced.front_end)
    if hooked:  # the graph would drop the root's hooks and see the layers' hooks twice
        where = f"the model has hooks of yours on {', '.join(hooked)}"
        if any("backward" in h for h in hooked):  # torch.func cannot re-run backward hooks: hooks engine
            wrapped = _wrap(model, "hooks", batch_first=(batch_dim == 0), loss_reduction=loss_reduction,
                            require_verified=strict, sink=sink)
            reason, engine = f"{where}; the hooks engine sees them as the model runs (and checks itself)", "hooks"
        else:  # the whole model, its hooks included, runs as one op and is re-run per sample
            wrapped = whole_model_op(model, gm, loss_reduction=loss_reduction, batch_dim=batch_dim,
                                     sink=sink if sink is not None else GradSampleSink())
            reason = f"{where}; the whole model runs as one op (with its hooks) under the generic per-sample rule"
            engine = "fx+whole-model"
        setattr(wrapped, _REPORT_ATTR, _make_report(model, traced, reports, engine, reason,
                                                    notes=_bookkeeping_notes(sink, engine)))
        return wrapped

    analysed = copy_graph_module(gm)  # re-analysed by the guards for new shapes
    sink = sink if sink is not None else GradSampleSink()  # one per compiled model: its DP-aware ops deliver here
    gm = _run("per_sample", insert_per_sample_ops, gm, reports, loss_reduction=loss_reduction, batch_dim=batch_dim,
              sink=sink)
    unsupported = [f for f in reports[-1].findings if f.severity is not Severity.INFO]
    if unsupported:
        if strict:
            raise NotPrivateError(unsupported, "strict=True: fxdp cannot compute per-sample gradients on the graph for:")
        packed = [n.target for n in gm.graph.nodes if n.op == "placeholder" and _is_packed(n.meta.get(meta.BATCH_DIM))]
        if packed:  # the whole model re-runs each sample alone: it cannot split such an input into samples
            wrapped = _wrap(model, "hooks", batch_first=(batch_dim == 0), loss_reduction=loss_reduction, sink=sink)
            reason = (f"input(s) {', '.join(map(repr, packed))} hold the samples' entries one after another (an "
                      f"EmbeddingBag's flat indices), and {len(unsupported)} parametrised op(s) the graph engine "
                      "cannot handle (see per_sample findings); the whole-model engine cannot split such an input "
                      "into samples, the hooks engine counts one sample per bag (and checks itself)")
            setattr(wrapped, _REPORT_ATTR, _make_report(model, traced, reports, "hooks", reason,
                                                        notes=_bookkeeping_notes(sink, "hooks")))
            return wrapped
        wrapped = whole_model_op(model, gm, loss_reduction=loss_reduction, batch_dim=batch_dim, sink=sink)
        reason = (f"{len(unsupported)} parametrised op(s) the graph engine cannot handle (see per_sample findings); "
                  "the whole model runs as one op with the generic per-sample rule")
        setattr(wrapped, _REPORT_ATTR, _make_report(model, traced, reports, "fx+whole-model", reason,
                                                    notes=_bookkeeping_notes(sink, "fx+whole-model")))
        return wrapped

    notes = ([_NO_INPUTS_NOTE] if example_inputs is None else []) + private_parameters_note(model) + \
        _bookkeeping_notes(sink, "fx", gm)
    gm = make_copyable(gm)  # deepcopy, pickle and torch.save keep the report, the sink and the hooks
    if traced.output_type is not None:  # the graph returns a plain dict: give back the model's own type
        gm.register_forward_hook(OutputType(traced.output_type))
    setattr(gm, _REPORT_ATTR, _make_report(model, traced, reports, notes=notes))
    _install_guards(gm, analysed, example_inputs, batch_dim, strict, batch_inputs)
    _watch_model(gm, model, loss_reduction, example_inputs is not None)
    return gm


def _refuse_checkpointing(model: nn.Module) -> None:
    """Hugging Face models mark the layers ``gradient_checkpointing_enable()`` switched on."""
    on = [name or "<model>" for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if on:
        raise GradientCheckpointingError(
            f"fxdp: gradient checkpointing is on in {type(model).__name__} (layers {', '.join(on[:3])}"
            f"{', ...' if len(on) > 3 else ''}): those layers re-run their forward inside backward, which fxdp's "
            "engines do not follow, so per-sample gradients could not be checked. Call "
            "model.gradient_checkpointing_disable() (or activation_checkpointing_disable()) before making the model "
            "private (fxdp's book-keeping keeps "
            "per-sample norms without materialising per-sample gradients; a smaller physical batch with "
            "fxdp.data.BatchMemoryManager saves memory too)")


def _is_packed(layout) -> bool:
    return isinstance(layout, BatchLayout) and layout.kind == PACKED


def _bookkeeping_notes(sink: Optional[GradientSink], engine: str, gm: Optional[torch.fx.GraphModule] = None):
    """With a book-keeping sink, the report says how each layer's norms are computed, or why not."""
    if not isinstance(sink, BookkeepingSink):
        return []
    if engine == "fx+whole-model":
        return ["book-keeping: the whole model runs as one op with the generic rule, so every per-sample "
                "gradient is materialised"]
    plans = describe_plans([(name, plan) for name, plan in plan_graph(gm, sink.method) if not _frozen_layer(gm, name)]
                           ) if gm is not None else []
    return plans or [f"book-keeping on the {engine} engine: each layer's method is chosen from its shapes on the "
                     "first backward (model.fxdp_sink.plans)"]


def _frozen_layer(gm: torch.fx.GraphModule, name: str) -> bool:
    """A layer whose own parameters are all frozen: nothing is computed for it (a LoRA adapter's base layer)."""
    try:
        params = list(gm.get_submodule(name).parameters(recurse=False))
    except AttributeError:  # a functional use of parameters, named by its site
        return False
    return bool(params) and not any(p.requires_grad for p in params)


def private_parameters_note(model: nn.Module) -> List[str]:
    """With some parameters frozen (an adapter's base model), which ones DP-SGD trains (per-sample gradients,
    clipped and noised); none when all are trained."""
    params = list(model.named_parameters())
    private = [(n, p) for n, p in params if p.requires_grad]
    values = f"{sum(p.numel() for _, p in private):,} of {sum(p.numel() for _, p in params):,} values"
    if len(private) == len(params):
        return []
    return [f"private parameters (per-sample gradients, clipped and noised): {len(private)} of {len(params)} "
            f"({values}): {', '.join(n for n, _ in private) or 'none'}; the other {len(params) - len(private)} are "
            "frozen (nothing is computed for them)"]


@dataclass
class _GuardContext:
    """What the guard needs to re-run the batch_dim analysis for new input shapes."""

    analysed: torch.fx.GraphModule  # the graph before the per_sample pass
    batch_dim: int
    strict: bool
    batch_inputs: Optional[Tuple[str, ...]]  # pinned once known (the user's, or found on a batch of several)
    compiled: Optional[torch.fx.GraphModule] = None  # its report is updated on the first batch
    # what compiling again needs (fxdp.runtime.structure): the model compiled, how, and what the graph reads
    original: Optional[nn.Module] = None
    loss_reduction: str = "mean"
    with_example_inputs: bool = False
    paths: Tuple[str, ...] = ()  # the layers and parameters the graph calls or reads
    objects: Optional[dict] = None  # root name -> {path or prefix of one: the object there at compile time}
    # a graph torch.export captured: the graphs captured for each input shape seen, as (class, __dict__),
    # shared by their contexts (a copy of the model keeps only its current graph and captures again)
    captures: Optional[list] = None
    training: bool = True  # the mode the graph was captured in (functional dropout keeps it)

    def __getstate__(self):  # the compiled model holds this context: a pickled copy must not hold it back
        return {**vars(self), "compiled": None, "captures": None}

    def fxdp_relink(self, model, guard: runtime.BatchSource) -> None:
        """A copy of the compiled model (deepcopy, pickle): its report and its watch are the copy's own."""
        self.compiled = model
        if self.original is not None:
            _watch_model(model, self.original, self.loss_reduction, self.with_example_inputs, guard)


def _install_guards(gm: torch.fx.GraphModule, analysed: torch.fx.GraphModule, example_inputs, batch_dim: int,
                    strict: bool, batch_inputs) -> None:
    """Let the compiled model check at every forward that its layouts were analysed for the input
    shapes it gets, and re-run the analysis (or refuse) for new ones (:mod:`fxdp.runtime.guards`)."""
    guard = gm.fxdp_batch
    pinned = None if batch_inputs is None else tuple(
        (batch_inputs,) if isinstance(batch_inputs, (str, int)) else batch_inputs)
    guard.context = _GuardContext(analysed, batch_dim, strict, pinned, gm)
    guard.reanalyse = _reanalyse
    guard.symbolic_batch = symbolic_batch(gm) if batch_dim == guard.dim else None
    if isinstance(getattr(gm, _INPUT_SHAPES, None), ExportShapeGuard):
        guard.recapture = _recapture
        guard.context.training = gm.training
    if example_inputs is not None:  # analysed at compile time: these shapes need no second analysis
        values = tuple(bind_inputs(analysed, example_inputs))
        _pin_batch_inputs(guard, values)
        guard.remember(runtime.input_signature(values), values)


_COMPILED, _ORIGINAL = "the compiled model", "the model it was compiled from"


def _watch_model(gm: torch.fx.GraphModule, model: nn.Module, loss_reduction: str, with_example_inputs: bool,
                 guard: Optional[runtime.BatchSource] = None) -> None:
    """Let the compiled model notice, before each forward, that a layer or parameter its graph uses was
    replaced (on it or on ``model``) or that a frozen parameter it cannot train was unfrozen, and then be
    compiled again in place (:func:`_rebuild`)."""
    guard = guard if guard is not None else gm.fxdp_batch
    ctx = guard.context
    ctx.original, ctx.loss_reduction, ctx.with_example_inputs = model, loss_reduction, with_example_inputs
    ctx.paths = tuple(dict.fromkeys(
        str(node.target) for node in gm.graph.nodes if node.op in ("call_module", "get_attr")
        and isinstance(_resolve(gm, str(node.target)), (nn.Module, nn.Parameter))))
    watch = runtime.StructureWatch()
    ctx.objects = {}
    for root, name in ((gm, _COMPILED), (model, _ORIGINAL)):
        ctx.objects[name] = {prefix: _resolve(root, prefix) for path in ctx.paths for prefix in _prefixes(path)}
        for path in ctx.paths:
            end = watch.add_path(root, path, name)
            if isinstance(end, nn.Module):
                watch.add_subtree(end, path, name, sizes=False)  # a stock layer's forward finds no new one
    for use in guard.frozen:
        watch.add_frozen(use.param, use.name)
    guard.watch, guard.rebuild = watch, _rebuild


def _prefixes(path: str) -> List[str]:
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _resolve(root: nn.Module, path: str):
    """The layer or parameter at ``path`` in ``root`` (None if there is none)."""
    obj: Any = root
    for part in path.split("."):
        if not isinstance(obj, nn.Module):
            return None
        obj = obj._modules.get(part, obj._parameters.get(part))
    return obj


def _rebuild(compiled: torch.fx.GraphModule, why: str, args: tuple, kwargs: dict) -> None:
    """The watch's callback: ``compiled`` changed since it was compiled (``why``). Bring what was replaced on it
    over to the model it was compiled from, compile that again with the same settings and sink, and put the
    new graph in ``compiled``'s place; parameters the model no longer uses are retired in the sink (a DP
    optimizer still holding one refuses to step). Raises instead where the result would not be a graph."""
    guard = compiled.fxdp_batch
    ctx = guard.context
    original = ctx.original
    _copy_replacements(compiled, ctx)
    inputs = None
    if ctx.with_example_inputs:  # compiled with example inputs: compile again with these ones
        inputs = (args[0] if len(args) == 1 else tuple(args)) if not kwargs else dict(
            inspect_module.signature(original.forward).bind(*args, **kwargs).arguments)
    sink = sink_of(compiled)
    new = compile_for_dp(original, inputs, batch_dim=ctx.batch_dim, loss_reduction=ctx.loss_reduction,
                         strict=ctx.strict, sink=sink, batch_inputs=ctx.batch_inputs)
    rep = report(new)
    if rep.engine != "fx" or not isinstance(new, torch.fx.GraphModule):
        remove = getattr(new, "remove_hooks", None)
        if callable(remove):
            remove()
        raise ModelChangedError(
            f"fxdp: {why} since the model was compiled. Compiled again, it needs the {rep.engine} engine "
            f"({rep.fallback_reason}), which cannot take the compiled graph's place: compile the changed model "
            "again with fxdp.compile_for_dp (or call make_private again with it)")
    if sink is not None:  # the parameters as compiled, against the new graph's
        sink.retire([p for _, _, p, _ in guard.watch.entries if isinstance(p, nn.Parameter)], new.parameters(), why)
    note = f"compiled again before a forward: {why}"
    setattr(new, _REPORT_ATTR, dataclasses.replace(rep, notes=(*rep.notes, note)))
    mine = {k: v for k, v in compiled.__dict__.items() if "hook" in k or k == "training"}  # the user's too
    compiled.__dict__.clear()
    compiled.__dict__.update(new.__dict__)
    compiled.__dict__.update(mine)
    compiled.__class__ = type(new)
    compiled.fxdp_batch.fxdp_relink(compiled)
    # forward calls go on being numbered: a call before the change and one after, then one backward, hold
    # different samples (the sink keeps their rows apart by call)
    compiled.fxdp_batch.calls = guard.calls
    warnings.warn(f"fxdp: {why}: the model was compiled again before this forward (fxdp.report(model) says "
                  "how). A DP optimizer trains a new parameter only if it holds it, and "
                  "refuses to step while it holds one the model no longer uses", stacklevel=6)


_INPUT_SHAPES = "fxdp_input_shapes"  # a captured graph's ExportShapeGuard
_CAPTURES_NOTE = "torch.export: captured once per input shape"


def _recapture(compiled: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """The guard's callback before each forward of a graph torch.export captured: for inputs whose sizes the
    graph does not hold (another sequence length), put in the graph captured for them (kept from an earlier
    capture, or captured now, with the same settings and the same sink: the parameters are the same, so their
    per-sample norms and clipped sums go on accumulating where they did). Each graph keeps its own guards
    and its analysis; the forward calls go on being numbered across them."""
    inputs = flat_inputs(compiled, args, kwargs)
    if inputs is None or getattr(compiled, _INPUT_SHAPES).mismatch(inputs) is None:
        return  # fits, or a call the captured graph's own code refuses
    guard = compiled.fxdp_batch
    ctx = guard.context
    if ctx.original is None:
        return
    if ctx.captures is None:
        ctx.captures = [(type(compiled), dict(compiled.__dict__))]
    captures = ctx.captures
    entry = next((e for e in captures if e[1]["_modules"][_INPUT_SHAPES].mismatch(inputs) is None), None)
    if entry is None:
        # in the mode the first graph was captured in, whatever the mode now: every graph then treats dropout
        # as the first does (a layer's follows train()/eval(); functional dropout keeps the captured mode, and
        # the graph refuses eval() if it is on)
        modes = [(m, m.training) for m in ctx.original.modules()]
        ctx.original.train(ctx.training)
        try:
            new = compile_for_dp(ctx.original, _capture_inputs(ctx.original, args, kwargs, ctx.batch_dim),
                                 batch_dim=ctx.batch_dim, loss_reduction=ctx.loss_reduction, strict=ctx.strict,
                                 sink=sink_of(compiled), batch_inputs=ctx.batch_inputs)
        finally:
            for m, mode in modes:
                m.training = mode
        rep = report(new)
        if rep.engine != "fx" or not isinstance(getattr(new, _INPUT_SHAPES, None), ExportShapeGuard):
            remove = getattr(new, "remove_hooks", None)
            if callable(remove):
                remove()
            shape_guard = getattr(compiled, _INPUT_SHAPES)
            name, want, shape = shape_guard.mismatch(inputs)
            raise ExportShapeError(
                f"fxdp: {rep.model} was captured with torch.export for inputs of shapes {shape_guard.describe()}; "
                f"input '{name}' has shape {shape}, and captured again for it the model needs the {rep.engine} "
                f"engine ({rep.fallback_reason or 'not one graph'}), which cannot take the graph's place: give it inputs "
                "of the shapes it was captured for (pad every batch to one length, padding='max_length')")
        new.fxdp_batch.context.captures = captures
        entry = (type(new), dict(new.__dict__))
        captures.append(entry)
    rep = report(compiled)
    shapes = "; ".join(body["_modules"][_INPUT_SHAPES].describe() for _, body in captures)
    notes = [n for n in rep.notes if not n.startswith(_CAPTURES_NOTE)]
    note = f"{_CAPTURES_NOTE} seen ({len(captures)} graphs, kept: {shapes})"
    mine = {k: v for k, v in compiled.__dict__.items() if "hook" in k or k == "training"}  # the user's too
    calls = guard.calls
    compiled.__dict__.clear()
    compiled.__dict__.update(entry[1])
    compiled.__dict__.update(mine)
    compiled.__class__ = entry[0]
    setattr(compiled, _REPORT_ATTR, dataclasses.replace(rep, notes=(*notes, note)))
    for name, module in compiled._modules.items():  # the graph's own guards take the model's mode (its layers are
        if name.startswith("fxdp_") and isinstance(module, nn.Module):  # the user's, in the mode they are in)
            module.training = compiled.training
    now = compiled.fxdp_batch
    if now.context.compiled is not compiled:  # its report and its watch are the compiled model's
        now.fxdp_relink(compiled)
    now.calls = calls  # a call before the switch and one after, then one backward, hold different samples


def _capture_inputs(original: nn.Module, args: tuple, kwargs: dict, batch_dim: int):
    """The inputs to capture ``original`` with, as the call gives them; a batch of one repeated to two samples
    (torch.export fixes a size of one: the graph would run batches of one only)."""
    inputs = (args[0] if len(args) == 1 else tuple(args)) if not kwargs else dict(
        inspect_module.signature(original.forward).bind(*args, **kwargs).arguments)
    leaves = [x for x in torch.utils._pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > batch_dim]
    if leaves and leaves[0].shape[batch_dim] == 1:
        inputs = torch.utils._pytree.tree_map(
            lambda x: torch.cat([x, x], batch_dim) if isinstance(x, torch.Tensor) and x.dim() > batch_dim
            and x.shape[batch_dim] == 1 else x, inputs)
    return inputs


def _copy_replacements(compiled: torch.fx.GraphModule, ctx: "_GuardContext") -> None:
    """A layer or parameter replaced on the compiled model is replaced on the model it was compiled from too
    (they share layers and parameters; checkpoints hold the latter's), so that compiling that again sees it."""
    done: List[str] = []
    for prefix in sorted(ctx.objects[_COMPILED], key=lambda p: p.count(".")):
        if any(prefix.startswith(d + ".") for d in done):
            continue
        now, then = _resolve(compiled, prefix), ctx.objects[_COMPILED][prefix]
        if now is then:
            continue
        where = prefix.rpartition(".")
        parent = _resolve(ctx.original, where[0]) if where[0] else ctx.original
        theirs = _resolve(ctx.original, prefix)
        if now is None or not isinstance(parent, nn.Module) or (
                theirs is not ctx.objects[_ORIGINAL].get(prefix) and theirs is not now):
            raise ModelChangedError(
                f"fxdp: '{prefix}' was {'removed from' if now is None else 'replaced on'} the compiled model"
                + ("" if now is None or theirs is ctx.objects[_ORIGINAL].get(prefix) else
                   " and replaced by another object on the model it was compiled from")
                + ", which fxdp cannot follow: change the model you passed to compile_for_dp (make_private) and "
                "compile it again")
        setattr(parent, where[2], now)
        done.append(prefix)


def _pin_batch_inputs(guard: runtime.BatchSource, values) -> None:
    """Once found on a batch of several samples, the batched inputs stay the same for other shapes (with
    one sample, a (1, T) input cannot be told from a batched one)."""
    ctx = guard.context
    if ctx.batch_inputs is None and guard.size_of(values) > 1:
        ctx.batch_inputs = batched_input_names(ctx.analysed)


def _reanalyse(guard: runtime.BatchSource, inputs) -> None:
    """The guard's callback for input shapes not analysed yet (the first batch without example_inputs)."""
    ctx = guard.context
    first = ctx.compiled is not None and all(p.name != "batch_dim" for p in report(ctx.compiled).passes)
    try:
        result = propagate_batch_dim(ctx.analysed, tuple(inputs), batch_dim=ctx.batch_dim, strict=ctx.strict,
                                     batch_inputs=ctx.batch_inputs)
    except BatchDimAnalysisError as exc:
        if isinstance(exc.__cause__, ExportShapeError):  # a captured graph's sizes do not fit: its own error
            raise exc.__cause__
        if not first and exc.__cause__ is not None and not isinstance(exc.__cause__, FxdpError):
            # an op of an analysed model fails on these inputs: the error its own forward raises
            raise exc.__cause__
        raise  # on the first batch, the analysis's error (the one example_inputs of that shape would give)
    shapes = ", ".join(str(tuple(x.shape)) for x in inputs if isinstance(x, torch.Tensor))
    when = "" if first else (f" (found when the model ran on inputs of shapes {shapes}, which the analysis had not "
                             "seen: fxdp re-ran it for them)")
    _refuse_if_not_private([result.report], when)
    problems, changes = update_site_layouts(ctx.analysed, guard, ctx.batch_dim)
    index, dim = batch_source([n for n in ctx.analysed.graph.nodes if n.op == "placeholder"], ctx.batch_dim)
    if problems and isinstance(inputs[index], torch.Tensor) and inputs[index].shape[dim] == 1:
        # a batch of one leaves layouts ambiguous ((N*T, d) with N = 1 is also (T, d)), but every tensor
        # then is the one sample's: each site reads its tensors whole
        guard.input_index, guard.dim = index, dim
        one_sample_layouts(guard)
        return
    if problems:
        fix = ("train with the input shapes the model was analysed for, or compile again with example_inputs of "
               "these shapes so that fxdp can choose another engine up front")
        causes = [f for f in result.report.findings if f.severity is not Severity.INFO]
        raise NotPrivateError([*causes, *(dataclasses.replace(f, fix=fix) for f in problems)],
                              f"fxdp cannot follow the batch through the model for inputs of shapes {shapes}"
                              + ("" if first else ", which the analysis had not seen (fxdp re-ran it for them)")
                              + "; per-sample gradients would be wrong, so this forward is refused:")
    if first:
        previous = report(ctx.compiled)
        reports = [*[p for p in previous.passes if p.name not in ("batch_dim", "per_sample")], result.report,
                   PassReport("per_sample", tuple(changes), previous.pass_report("per_sample").findings)]
        notes = [n for n in previous.notes if n != _NO_INPUTS_NOTE] + ["batch_dim: run on the first batch"]
        setattr(ctx.compiled, _REPORT_ATTR, dataclasses.replace(previous, passes=tuple(reports), notes=tuple(notes),
                                                                fallback_reason=None, fallback_location=None))
    _pin_batch_inputs(guard, inputs)


def attach_hooks(model: nn.Module, *, batch_dim: int = 0, loss_reduction: str = "mean", strict: bool = False,
                 sink: Optional[GradientSink] = None) -> GradSampleHooks:
    """The hooks engine on ``model`` itself, for code that keeps calling the model it has (Opacus's
    ``make_private(wrap_model=False)``): the same analysis and refusals as :func:`compile_for_dp`, then
    :class:`~fxdp.engines.hooks.GradSampleHooks` (keep it alive while training; ``cleanup()`` detaches it)."""
    expect_module(model, "fxdp.compiler.attach_hooks(model, ...)")
    check_loss_reduction(loss_reduction)
    model = unwrap_or_refuse(model)
    _, traced, reports = _analyse(model, None, batch_dim, strict)
    _refuse_if_not_private(reports)
    hooks = GradSampleHooks(model, batch_first=(batch_dim == 0), loss_reduction=loss_reduction, sink=sink,
                            require_verified=strict)
    setattr(hooks, _REPORT_ATTR, _make_report(model, traced, reports, "hooks", "the hooks engine was asked for on the "
                                              "model itself (wrap_model=False)", notes=_bookkeeping_notes(sink, "hooks")))
    return hooks


def wrap_model(
    model: nn.Module,
    grad_sample_mode: str,
    *,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    strict: bool = False,
) -> nn.Module:
    """``model`` with the engine named by ``grad_sample_mode``, without the analysis passes for the
    engines that do not compile (see :mod:`fxdp.engines`); ``"fx"`` is :func:`compile_for_dp`."""
    check_grad_sample_mode(grad_sample_mode)
    check_loss_reduction(loss_reduction)
    if grad_sample_mode == "fx":
        return compile_for_dp(model, batch_dim=0 if batch_first else 1, loss_reduction=loss_reduction, strict=strict)
    return _wrap(model, grad_sample_mode, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict)


_WRAPPERS = {
    "hooks": GradSampleModule,
    "ew": ExpandedWeightsGradSampleModule,
    "functorch": FunctorchGradSampleModule,
    "no_op": NoOpGradSampleModule,
}


def _wrap(model: nn.Module, engine: str, *, batch_first: bool, loss_reduction: str, strict: bool = False,
          require_verified: bool = False, sink: Optional[GradientSink] = None) -> nn.Module:
    model = unwrap_or_refuse(model)
    if engine == "hooks":
        return GradSampleModule(model, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                                require_verified=require_verified, sink=sink)
    return _WRAPPERS[engine](model, batch_first=batch_first, loss_reduction=loss_reduction, sink=sink)


def _user_hooks(model: nn.Module, front_end: Optional[str]) -> List[str]:
    """The modules with hooks of the user's that the graph would not replay (they send the model to another
    engine), as ``'name' (kinds)``."""
    ignore = _records_into_the_output if front_end == FRONT_END else None
    return [f"'{name or '<model>'}' ({', '.join(kinds)})" for name, m in model.named_modules()
            if (kinds := user_hooks(m, ignore=ignore))]


def _records_into_the_output(hook: Callable) -> bool:
    """transformers 5 records hidden states and attentions (``output_hidden_states=True``) with forward hooks
    that append a layer's output to a list the model then returns, and change nothing. torch.export runs
    them as it captures the model, so the graph returns what they record: nothing is left for them to do. Nor
    for the hook ``enable_input_require_grads()`` (which ``gradient_checkpointing_enable()`` calls, and
    ``gradient_checkpointing_disable()`` leaves) puts on the input embeddings: it only marks their output as
    requiring a gradient, for checkpointing, which fxdp refuses."""
    module = getattr(hook, "__module__", None) or ""
    return module == "transformers.utils.output_capturing" or (
        module.startswith("transformers.") and getattr(hook, "__name__", None) == "make_inputs_require_grads")
