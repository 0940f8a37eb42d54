"""``compile_for_dp``: trace, run the passes by name, emit a GraphModule (or fall back, and say why).

This module is the ONE place an engine is chosen (:func:`choose_engine` for :func:`compile_for_dp`;
:func:`wrap_model`); the report names it (``fx``, ``fx+whole-model``, ``hooks``, ``ew``, ``functorch``,
``no_op``) and says why.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.fx
from torch import nn

from fxdp import meta
from fxdp.diagnostics import (
    CompileReport,
    FxdpError,
    GradientCheckpointingError,
    NotPrivateError,
    PassError,
    PassReport,
    PassResult,
    Severity,
    UnsupportedInputError,
    WHOLE_MODEL,
)
from fxdp.diagnostics.errors import expect_module
from fxdp.diagnostics.report import REPORT_ATTR, refuse_if_not_private
from fxdp.engines import WRAPPERS, GradSampleHooks, GradSampleModule, check_grad_sample_mode
from fxdp.engines.base import user_hooks
from fxdp.engines.blocks import BlockGradSampleModule
from fxdp.engines.hooks import fallback_self_check
from fxdp.engines.whole_model import whole_model_op
from fxdp.frontends.export import FRONT_END
from fxdp.frontends.parts import Parts, describe_parts, find_parts
from fxdp.engines.wrappers import unwrap_or_refuse
from fxdp.grad_sample.moe import describe_moe_blocks
from fxdp.layout import PACKED, BatchLayout
from fxdp.passes.batch_dim import propagate_batch_dim
from fxdp.passes.inplace import remove_inplace_ops
from fxdp.passes.per_sample import insert_per_sample_ops
from fxdp.passes.reanalyse import NO_INPUTS_NOTE, install_guards
from fxdp.passes.validate import validate_graph
from fxdp.validators import ModuleValidator  # the module rules the validate pass applies
from fxdp.frontends.fx import trace
from fxdp.graphs.engine import compile_graph_model, is_graph_model
from fxdp.runtime.module import OutputType, copy_graph_module, make_copyable
from fxdp.sinks.bookkeeping import BookkeepingSink, describe_plans, plan_graph
from fxdp.sinks.contract import GradientSink, GradSampleSink, check_loss_reduction

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
    gm = _run("validate", validate_graph, traced.graph_module, reports, validator_class=ModuleValidator, strict=strict)
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


def inspect(model: nn.Module, example_inputs: Any = None, batch_dim: int = 0, strict: bool = False,
            batch_inputs: Optional[Tuple[str, ...]] = None) -> CompileReport:
    """The report ``compile_for_dp`` would produce, without compiling (the model is not changed)."""
    expect_module(model, "fxdp.inspect(model, ...)")
    gm, traced, reports = _analyse(model, example_inputs, batch_dim, strict, batch_inputs)
    notes = [NO_INPUTS_NOTE] if traced.ok and example_inputs is None else []
    if not traced.ok:
        parts = _untraceable_parts(model, traced)
        candidates = tuple(b.path for b in parts.blocks) if parts is not None else ()
        blocks = _probe_blocks(model, example_inputs, batch_dim, candidates)
        make = functools.partial(BlockGradSampleModule, blocks=blocks, candidates=candidates) if candidates else None
        reports.append(fallback_self_check(model, example_inputs, batch_dim, strict, make))
        notes = describe_parts(parts, blocks) if parts is not None else []
    return _make_report(model, traced, reports, notes=notes)


def report(compiled: nn.Module) -> CompileReport:
    """The CompileReport of a model returned by :func:`compile_for_dp`."""
    rep = getattr(compiled, REPORT_ATTR, None)
    if rep is None:
        raise ValueError(f"{type(compiled).__name__} was not produced by fxdp.compile_for_dp; "
                         "use fxdp.inspect(model, example_inputs) to analyse a plain model")
    return rep


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
    :class:`fxdp.errors.NotPrivateError` for a model DP-SGD cannot train (BatchNorm in training,
    ops that mix samples), with a table of the findings. The hooks engine tests the model on its first
    batch and raises :class:`fxdp.errors.UnverifiedModelError` there when it cannot verify it (an output
    without one row per sample), strict or not.

    ``batch_inputs``: names (or positions) of the forward() inputs that hold one row per sample at
    ``batch_dim``; the others are shared by all samples (masks, position ids). Without it fxdp finds
    them from all inputs and the graph, and asks for it when the inputs can be read two ways or the model
    holds together only with an input of the batch's number of rows read as shared (never assumed).

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
    if grad_sample_mode in ("fx", "hooks") and is_graph_model(model):  # one sample, one graph (fxdp/graphs): no
        # trace (torch.fx cannot trace PyG's message passing); the graphs engine, with its report
        return compile_graph_model(model, batch_dim=batch_dim, loss_reduction=loss_reduction, sink=sink)
    if sink is not None and grad_sample_mode in ("ew", "no_op"):
        raise ValueError(f"fxdp: grad_sample_mode={grad_sample_mode!r} writes p.grad_sample itself and delivers "
                         "nothing to a sink; leave sink=None, or use grad_sample_mode='fx' or 'hooks'")

    gm, traced, reports = _analyse(model, example_inputs, batch_dim, strict, batch_inputs)
    refuse_if_not_private(reports)
    analysed = copy_graph_module(gm) if gm is not None and grad_sample_mode == "fx" else None  # (reanalyse's)
    choice = choose_engine(model, gm, traced, reports, grad_sample_mode=grad_sample_mode, strict=strict,
                           loss_reduction=loss_reduction, batch_dim=batch_dim, sink=sink)
    compiled = _build(choice, model, traced, loss_reduction=loss_reduction, batch_dim=batch_dim,
                      example_inputs=example_inputs)

    notes = _bookkeeping_notes(choice.sink, choice.engine, choice.graph if choice.engine == "fx" else None)
    if choice.parts is not None:
        notes = describe_parts(choice.parts, getattr(compiled, "blocks", ())) + notes
    if choice.engine == "fx":
        notes = ([NO_INPUTS_NOTE] if example_inputs is None else []) + private_parameters_note(model) + notes
    rep = _make_report(model, traced, reports, choice.engine, choice.reason, notes=notes)
    if gm is None and choice.engine != "hooks":  # an engine asked for, on a model no front end captured
        rep = dataclasses.replace(rep, engine=choice.engine, fallback_reason=(
            f"grad_sample_mode={grad_sample_mode!r} was asked for (and {rep.fallback_reason})"))
    setattr(compiled, REPORT_ATTR, rep)
    if choice.engine == "fx":
        install_guards(compiled, analysed, model, example_inputs, batch_dim=batch_dim, strict=strict,
                       batch_inputs=batch_inputs, loss_reduction=loss_reduction, compile_again=compile_for_dp)
    return compiled


@dataclasses.dataclass
class EngineChoice:
    """What :func:`choose_engine` decided: the engine (``"fx"``, the graph engine; ``WHOLE_MODEL``; or a
    wrapper's mode: ``"hooks"``, ``"ew"``, ``"functorch"``, ``"no_op"``), why (None on the graph engine), the
    graph it runs (the graph engine's with its per-sample ops; the whole-model op's) and the sink it delivers to."""

    engine: str
    reason: Optional[str]
    graph: Optional[torch.fx.GraphModule]
    sink: Optional[GradientSink]
    parts: Optional[Parts] = None  # a model no front end captured: its untraceable parts (fxdp.frontends.parts)


def choose_engine(model: nn.Module, gm: Optional[torch.fx.GraphModule], traced, reports: List[PassReport], *,
                  grad_sample_mode: str, strict: bool, loss_reduction: str, batch_dim: int,
                  sink: Optional[GradientSink]) -> EngineChoice:
    """The ONE place an engine is chosen for :func:`compile_for_dp`, in this order: an engine asked for
    (``grad_sample_mode`` other than ``"fx"``) or a model no front end captured (the hooks engine); hooks of the
    user's the graph would not replay (the hooks engine for backward hooks, else the whole model as one op); then
    the graph's per-sample pass (run here, it appends its report): ops it cannot handle send the model to the
    whole-model op (the hooks engine when an input is packed), or raise under ``strict``; else the graph engine.
    (A model with PyTorch Geometric message-passing layers does not get here: :func:`compile_for_dp` gives it the
    graphs engine before any trace, :mod:`fxdp.graphs`.)"""
    if gm is None or grad_sample_mode != "fx":  # an explicit engine is honoured (none of them needs a trace)
        engine = grad_sample_mode if grad_sample_mode != "fx" else "hooks"
        parts = _untraceable_parts(model, traced) if gm is None and grad_sample_mode == "fx" else None
        return EngineChoice(engine, None if gm is None else f"grad_sample_mode={grad_sample_mode!r} was asked for",
                            None, sink, parts)
    hooked = _user_hooks(model, traced.front_end)
    if hooked:  # the graph would drop the root's hooks and see the layers' hooks twice
        where = f"the model has hooks of yours on {', '.join(hooked)}"
        if any("backward" in h for h in hooked):  # torch.func cannot re-run backward hooks: hooks engine
            return EngineChoice("hooks", f"{where}; the hooks engine sees them as the model runs (and checks itself)",
                                None, sink)
        # the whole model, its hooks included, runs as one op and is re-run per sample
        return EngineChoice(WHOLE_MODEL, f"{where}; the whole model runs as one op (with its hooks) under the "
                            "generic per-sample rule", gm, sink if sink is not None else GradSampleSink())

    sink = sink if sink is not None else GradSampleSink()  # one per compiled model: its DP-aware ops deliver here
    gm = _run("per_sample", insert_per_sample_ops, gm, reports, loss_reduction=loss_reduction, batch_dim=batch_dim,
              sink=sink)
    unsupported = [f for f in reports[-1].findings if f.severity is not Severity.INFO]
    if not unsupported:
        return EngineChoice("fx", None, gm, sink)
    if strict:
        raise NotPrivateError(unsupported, "strict=True: fxdp cannot compute per-sample gradients on the graph for:")
    packed = [n.target for n in gm.graph.nodes if n.op == "placeholder" and _is_packed(n.meta.get(meta.BATCH_LAYOUT))]
    if packed:  # the whole model re-runs each sample alone: it cannot split such an input into samples
        return EngineChoice("hooks", (
            f"input(s) {', '.join(map(repr, packed))} hold the samples' entries one after another (an "
            f"EmbeddingBag's flat indices), and {len(unsupported)} parametrised op(s) the graph engine "
            "cannot handle (see per_sample findings); the whole-model engine cannot split such an input "
            "into samples, the hooks engine counts one sample per bag (and checks itself)"), None, sink)
    return EngineChoice(WHOLE_MODEL, f"{len(unsupported)} parametrised op(s) the graph engine cannot handle (see "
                        "per_sample findings); the whole model runs as one op with the generic per-sample rule",
                        gm, sink)


def _build(choice: EngineChoice, model: nn.Module, traced, *, loss_reduction: str, batch_dim: int,
           example_inputs=None) -> nn.Module:
    """The model on the engine ``choice`` names (``traced``: what the front end captured)."""
    if choice.engine == WHOLE_MODEL:
        return whole_model_op(model, choice.graph, loss_reduction=loss_reduction, batch_dim=batch_dim,
                              sink=choice.sink)
    if choice.engine == "hooks" and choice.parts is not None and choice.parts.blocks:
        candidates = tuple(b.path for b in choice.parts.blocks)
        return BlockGradSampleModule(model, batch_first=(batch_dim == 0), loss_reduction=loss_reduction,
                                     sink=choice.sink, candidates=candidates,
                                     blocks=_probe_blocks(model, example_inputs, batch_dim, candidates))
    if choice.engine != "fx":
        return _wrap(model, choice.engine, batch_first=(batch_dim == 0), loss_reduction=loss_reduction,
                     sink=choice.sink)
    gm = make_copyable(choice.graph)  # deepcopy, pickle and torch.save keep the report, the sink and the hooks
    if traced.output_type is not None:  # the graph returns a plain dict: give back the model's own type
        gm.register_forward_hook(OutputType(traced.output_type))
    return gm


def _probe_blocks(model: nn.Module, example_inputs, batch_dim: int, candidates: Tuple[str, ...]) -> Tuple[str, ...]:
    """Which untraceable submodules become blocks on ``example_inputs`` (the engine's test on a copy of the model);
    none known without them (the engine then chooses on its first batch)."""
    if not candidates or example_inputs is None:
        return ()
    args, kwargs = ((), dict(example_inputs)) if isinstance(example_inputs, dict) else (
        ((example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)), {})
    probe = BlockGradSampleModule(copy.deepcopy(model), batch_first=batch_dim == 0, candidates=candidates)
    try:
        probe(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the engine raises it again on the model's batch; here only its choice counts
        pass
    finally:
        probe.remove_hooks()
    return probe.blocks


def _untraceable_parts(model: nn.Module, traced) -> Optional[Parts]:
    """A model no front end captured because of its code (not its inputs): its parts, each traced alone."""
    if traced.ok or traced.error is None or isinstance(traced.error, UnsupportedInputError):
        return None
    return find_parts(model)


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
    if engine == WHOLE_MODEL:
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


def attach_hooks(model: nn.Module, *, batch_dim: int = 0, loss_reduction: str = "mean", strict: bool = False,
                 sink: Optional[GradientSink] = None, verify: bool = True) -> GradSampleHooks:
    """The hooks engine on ``model`` itself, for code that keeps calling the model it has (Opacus's
    ``make_private(wrap_model=False)``): the same analysis and refusals as :func:`compile_for_dp`, then
    :class:`~fxdp.engines.hooks.GradSampleHooks` (keep it alive while training; ``cleanup()`` detaches it).
    ``verify=False``: no self-check on the first batch (FSDP2, where its extra runs would be collectives on
    some ranks only); the layers are still checked against the batch at every forward."""
    expect_module(model, "fxdp.compiler.attach_hooks(model, ...)")
    check_loss_reduction(loss_reduction)
    model = unwrap_or_refuse(model)
    _, traced, reports = _analyse(model, None, batch_dim, strict)
    refuse_if_not_private(reports)
    hooks = GradSampleHooks(model, batch_first=(batch_dim == 0), loss_reduction=loss_reduction, sink=sink,
                            verify=verify)
    setattr(hooks, REPORT_ATTR, _make_report(model, traced, reports, "hooks", "the hooks engine was asked for on the "
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


def _wrap(model: nn.Module, engine: str, *, batch_first: bool, loss_reduction: str, strict: bool = False,
          sink: Optional[GradientSink] = None) -> nn.Module:
    model = unwrap_or_refuse(model)
    if engine == "hooks":
        return GradSampleModule(model, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                                sink=sink)
    return WRAPPERS[engine](model, batch_first=batch_first, loss_reduction=loss_reduction, sink=sink)


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
