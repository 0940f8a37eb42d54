"""``compile_for_dp``: trace, run the passes by name, emit a GraphModule (or fall back, and say why).

This module is the ONE place an engine is chosen (:func:`compile_for_dp`, :func:`wrap_model`); the
report names it (``fx``, ``fx+whole-model``, ``hooks``, ``ew``, ``functorch``, ``no_op``) and says why.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, List

import torch
import torch.fx
from torch import nn

from fxdp import runtime
from fxdp.diagnostics import (
    BatchMixingError,
    CompileReport,
    FxdpError,
    Kind,
    NotPrivateError,
    PassError,
    PassReport,
    PassResult,
    Severity,
)
from fxdp.engines import (
    ExpandedWeightsGradSampleModule,
    FunctorchGradSampleModule,
    GradSampleModule,
    NoOpGradSampleModule,
    check_grad_sample_mode,
)
from fxdp.engines.base import user_hooks
from fxdp.engines.hooks import fallback_self_check
from fxdp.engines.whole_model import whole_model_op
from fxdp.engines.wrappers import AlreadyCompiledError, unwrap_or_refuse  # noqa: F401  (re-exported)
from fxdp.grad_sample.generic import check_loss_reduction
from fxdp.grad_sample.sink import GradSampleSink
from fxdp.passes.batch_dim import propagate_batch_dim
from fxdp.passes.inplace import remove_inplace_ops
from fxdp.passes.per_sample import insert_per_sample_ops, update_site_layouts
from fxdp.passes.validate import validate_graph
from fxdp.tracing import OutputType, make_copyable, trace
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


def _analyse(model: nn.Module, example_inputs, batch_dim: int, strict: bool):
    """Trace and run the analysis passes. Returns (graph module or None, trace result, pass reports)."""
    traced = trace(model, example_inputs)
    if not traced.ok:
        return None, traced, []
    reports: List[PassReport] = []
    gm = _run("validate", validate_graph, traced.graph_module, reports, strict=strict)
    gm = _run("inplace", remove_inplace_ops, gm, reports)
    if example_inputs is not None:
        gm = _run("batch_dim", propagate_batch_dim, gm, reports, example_inputs=example_inputs,
                  batch_dim=batch_dim, strict=strict)
    return gm, traced, reports


def _make_report(model, traced, reports, engine="fx", fallback_reason=None, fallback_location=None, notes=()):
    if traced.fixed_to_none:
        notes = [*notes, f"traced with {', '.join(traced.fixed_to_none)} = None (they default to None and "
                         "example_inputs does not give them); give them in example_inputs to use them"]
    if not traced.ok:
        fallback_reason = f"the model cannot be traced by torch.fx ({traced.reason})"
        fallback_location = traced.location
        engine = "hooks"
    return CompileReport(type(model).__name__, traced.ok, tuple(reports), fallback_reason, fallback_location,
                         engine, tuple(notes))


_NO_INPUTS_NOTE = ("batch_dim: not run (no example_inputs); compile_for_dp runs it on the first batch, "
                   "before its backward")


def inspect(model: nn.Module, example_inputs: Any = None, batch_dim: int = 0, strict: bool = False) -> CompileReport:
    """The report ``compile_for_dp`` would produce, without compiling (the model is not changed)."""
    expect_module(model, "fxdp.inspect(model, ...)")
    gm, traced, reports = _analyse(model, example_inputs, batch_dim, strict)
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


def _refuse_if_not_private(reports: List[PassReport]) -> None:
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
    )
    raise (BatchMixingError if mixing else NotPrivateError)(errors, header)


def compile_for_dp(
    model: nn.Module,
    example_inputs: Any = None,
    batch_dim: int = 0,
    loss_reduction: str = "mean",
    strict: bool = False,
    grad_sample_mode: str = "fx",
) -> nn.Module:
    """Make ``model`` compute per-sample gradients: after ``loss.backward()`` every trainable parameter
    ``p`` has ``p.grad_sample`` of shape ``(N, *p.shape)``, row i being sample i's own gradient.

    Returns a ``torch.fx.GraphModule`` sharing the model's parameters, or — when the model cannot be
    traced — the hooks engine around it; ``fxdp.report(result)`` says which and why. Raises
    :class:`fxdp.diagnostics.NotPrivateError` for a model DP-SGD cannot train (BatchNorm in training,
    ops that mix samples), with a table of the findings.
    """
    expect_module(model, "fxdp.compile_for_dp(model, ...)")
    check_loss_reduction(loss_reduction)
    check_grad_sample_mode(grad_sample_mode)
    if batch_dim not in (0, 1):
        raise ValueError(f"batch_dim must be 0 (batch first) or 1 (time major), got {batch_dim!r}")
    model = unwrap_or_refuse(model)

    gm, traced, reports = _analyse(model, example_inputs, batch_dim, strict)
    _refuse_if_not_private(reports)
    if gm is None or grad_sample_mode != "fx":
        # an explicit engine is honoured (none of them needs a trace); "fx" falls back to hooks
        engine = grad_sample_mode if grad_sample_mode != "fx" else "hooks"
        wrapped = _wrap(model, engine, batch_first=(batch_dim == 0), loss_reduction=loss_reduction,
                        require_verified=strict)
        reason = None if gm is None else f"grad_sample_mode={grad_sample_mode!r} was asked for"
        rep = _make_report(model, traced, reports, engine, reason)
        if gm is None and engine != "hooks":
            rep = dataclasses.replace(rep, engine=engine, fallback_reason=(
                f"grad_sample_mode={grad_sample_mode!r} was asked for (and {rep.fallback_reason})"))
        setattr(wrapped, _REPORT_ATTR, rep)
        return wrapped

    hooked = _user_hooks(model)
    if hooked:  # the graph would drop the root's hooks and see the layers' hooks twice
        where = f"the model has hooks of yours on {', '.join(hooked)}"
        if any("backward" in h for h in hooked):  # torch.func cannot re-run backward hooks: hooks engine
            wrapped = _wrap(model, "hooks", batch_first=(batch_dim == 0), loss_reduction=loss_reduction,
                            require_verified=strict)
            reason, engine = f"{where}; the hooks engine sees them as the model runs (and checks itself)", "hooks"
        else:  # the whole model, its hooks included, runs as one op and is re-run per sample
            wrapped = whole_model_op(model, gm, loss_reduction=loss_reduction, batch_dim=batch_dim)
            reason = f"{where}; the whole model runs as one op (with its hooks) under the generic per-sample rule"
            engine = "fx+whole-model"
        setattr(wrapped, _REPORT_ATTR, _make_report(model, traced, reports, engine, reason))
        return wrapped

    analysed = None if example_inputs is not None else torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    sink = GradSampleSink()  # one per compiled model: its DP-aware ops deliver here
    gm = _run("per_sample", insert_per_sample_ops, gm, reports, loss_reduction=loss_reduction, batch_dim=batch_dim,
              sink=sink)
    unsupported = [f for f in reports[-1].findings if f.severity is not Severity.INFO]
    if unsupported:
        if strict:
            raise NotPrivateError(unsupported, "strict=True: fxdp cannot compute per-sample gradients on the graph for:")
        wrapped = whole_model_op(model, gm, loss_reduction=loss_reduction, batch_dim=batch_dim, sink=sink)
        reason = (f"{len(unsupported)} parametrised op(s) the graph engine cannot handle (see per_sample findings); "
                  "the whole model runs as one op with the generic per-sample rule")
        setattr(wrapped, _REPORT_ATTR, _make_report(model, traced, reports, "fx+whole-model", reason))
        return wrapped

    notes = [_NO_INPUTS_NOTE] if analysed is not None else []
    gm = make_copyable(gm)  # deepcopy, pickle and torch.save keep the report, the sink and the hooks
    if traced.output_type is not None:  # the graph returns a plain dict: give back the model's own type
        gm.register_forward_hook(OutputType(traced.output_type))
    setattr(gm, _REPORT_ATTR, _make_report(model, traced, reports, notes=notes))
    if analysed is not None:
        _analyse_on_first_batch(gm, analysed, batch_dim, strict)
    return gm


def _analyse_on_first_batch(gm: torch.fx.GraphModule, analysed: torch.fx.GraphModule, batch_dim: int, strict: bool):
    """Without example inputs, run the batch_dim pass on the first batch, before its backward."""
    gm.register_forward_pre_hook(_FirstBatchAnalysis(analysed, batch_dim, strict), with_kwargs=True)


class _FirstBatchAnalysis:
    """The forward pre-hook of :func:`_analyse_on_first_batch` (an object, so that compiled models pickle)."""

    def __init__(self, analysed: torch.fx.GraphModule, batch_dim: int, strict: bool):
        self.analysed, self.batch_dim, self.strict = analysed, batch_dim, strict
        self.settled = False

    def __call__(self, gm, args, kwargs):
        if self.settled:
            return
        batch_dim, strict = self.batch_dim, self.strict
        inputs = dict(kwargs) if kwargs and not args else tuple(args)
        result = propagate_batch_dim(self.analysed, inputs, batch_dim=batch_dim, strict=strict)
        previous = report(gm)
        analysis = [p for p in previous.passes if p.name not in ("batch_dim", "per_sample")]
        reports = [*analysis, result.report, previous.pass_report("per_sample")]
        _refuse_if_not_private(reports)
        problems, changes = update_site_layouts(gm, result.graph_module, batch_dim)
        if problems:
            raise NotPrivateError(problems, "fxdp cannot compute per-sample gradients on the graph for these ops; "
                                  "compile with example_inputs so fxdp can choose another engine up front:")
        reports[-1] = PassReport(reports[-1].name, tuple(changes), reports[-1].findings)
        notes = [n for n in previous.notes if n != _NO_INPUTS_NOTE] + ["batch_dim: run on the first batch"]
        setattr(gm, _REPORT_ATTR, CompileReport(previous.model, True, tuple(reports), notes=tuple(notes)))
        # settled once the analysis passed (a refused model stays refused) on a batch of several samples
        # (with one, a (1, T) input cannot be told from a batched one)
        if runtime.batch_size(gm.fxdp_batch, *args, *kwargs.values()) > 1:
            self.settled = True


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
          require_verified: bool = False) -> nn.Module:
    model = unwrap_or_refuse(model)
    if engine == "hooks":
        return GradSampleModule(model, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                                require_verified=require_verified)
    return _WRAPPERS[engine](model, batch_first=batch_first, loss_reduction=loss_reduction)


def _user_hooks(model: nn.Module) -> List[str]:
    return [f"'{name or '<model>'}' ({', '.join(kinds)})" for name, m in model.named_modules()
            if (kinds := user_hooks(m))]
