"""The re-analysis a compiled model's batch guard asks for before a forward: :class:`GraphReanalysis`, the
implementation of :class:`fxdp.runtime.guards.Reanalysis` (the runtime imports no pass).

- Input shapes not analysed yet (the first batch without example inputs, another sequence length of a
  merged ``(N*T, d)`` layout): the batch_dim pass runs again on the graph as it was before the per_sample
  pass, and the sites get the layouts it finds (:meth:`GraphReanalysis.layouts_for`), or the forward is
  refused with the findings.
- A graph torch.export captured, given inputs of sizes it does not hold (another sequence length), or keyword
  inputs it was not captured with that the model's ``forward`` takes: the model is captured again for them, or a
  graph captured for them earlier is put in (:meth:`GraphReanalysis.recapture`).
- A layer or parameter replaced, a frozen parameter unfrozen (the structure watch,
  :mod:`fxdp.runtime.structure`): the model is compiled again in place (:meth:`GraphReanalysis.rebuild`).

The last two compile again: the compiler hands in ``compile_for_dp`` (``compile_again``), since no pass
imports the compiler.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import nn

from fxdp import meta
from fxdp.layout import BATCHED, UNBATCHED_LAYOUT, BatchLayout
from fxdp.diagnostics import (BatchDimAnalysisError, ExportShapeError, FxdpError, ModelChangedError, NotPrivateError,
                              PassReport, Severity)
from fxdp.diagnostics.report import REPORT_ATTR, refuse_if_not_private
from fxdp.frontends.export import flat_inputs, keyword_inputs, symbolic_batch
from fxdp.sinks.contract import sink_of
from fxdp.passes.batch_dim import batched_input_names, bind_inputs, propagate_batch_dim
from fxdp.passes.loss import analyse_loss, trace_criterion
from fxdp.passes.per_sample import one_sample_layouts, site_layouts
from fxdp.runtime.guards import (GUARD_ATTR, AnalysedLayouts, BatchGuard, ExportShapeGuard, batch_size_of,
                                 input_signature)
from fxdp.runtime.loss_probe import LOSS_WATCH_ATTR, LossWatch
from fxdp.runtime.structure import StructureWatch

NO_INPUTS_NOTE = ("batch_dim: not run (no example_inputs); compile_for_dp runs it on the first batch, "
                  "before its backward")
_INPUT_SHAPES = "fxdp_input_shapes"  # a captured graph's ExportShapeGuard
_CAPTURES_NOTE = "torch.export: captured once per input shape"
_COMPILED, _ORIGINAL = "the compiled model", "the model it was compiled from"

#: ``compile_for_dp`` (the compiler hands it in): ``(model, example_inputs, *, batch_dim, loss_reduction, strict,
#: sink, batch_inputs) -> compiled model``
CompileAgain = Callable[..., nn.Module]


@dataclass
class GraphReanalysis:
    """What a compiled graph's guard needs to analyse new input shapes and to compile the model again."""

    analysed: torch.fx.GraphModule  # the graph before the per_sample pass
    batch_dim: int
    strict: bool
    batch_inputs: Optional[Tuple[str, ...]]  # pinned once known (the user's, or found on a batch of several)
    compile_again: CompileAgain
    compiled: Optional[torch.fx.GraphModule] = None  # its report is updated on the first batch
    # what compiling again needs (fxdp.runtime.structure): the model compiled, how, and what the graph reads
    original: Optional[nn.Module] = None
    loss_reduction: str = "mean"
    with_example_inputs: bool = False
    paths: Tuple[str, ...] = ()  # the layers and parameters the graph calls or reads
    objects: Optional[dict] = None  # root name -> {path or prefix of one: the object there at compile time}
    # a graph torch.export captured: the graphs captured for each input shape seen, as (class, __dict__),
    # shared by their re-analyses (a copy of the model keeps only its current graph and captures again)
    captured: bool = False
    captures: Optional[list] = None
    training: bool = True  # the mode the graph was captured in (functional dropout keeps it)

    def __getstate__(self):  # the compiled model holds this: a pickled copy must not hold it back
        return {**vars(self), "compiled": None, "captures": None}

    def relink(self, model: torch.fx.GraphModule, guard: BatchGuard) -> None:
        """A copy of the compiled model (deepcopy, pickle): its report and its watch are the copy's own."""
        self.compiled = model
        if self.original is not None:
            watch_model(model, self.original, self.loss_reduction, self.with_example_inputs, guard)

    def layouts_for(self, guard: BatchGuard, inputs: Tuple[Any, ...]) -> AnalysedLayouts:
        """The layouts of the sites for input shapes not analysed yet (the first batch without example_inputs)."""
        first = self.compiled is not None and all(p.name != "batch_dim" for p in _report(self.compiled).passes)
        result = self._batch_dim(inputs, first)
        shapes = ", ".join(str(tuple(x.shape)) for x in inputs if isinstance(x, torch.Tensor))
        when = "" if first else (f" (found when the model ran on inputs of shapes {shapes}, which the analysis had "
                                 "not seen: fxdp re-ran it for them)")
        refuse_if_not_private([result.report], when)
        problems, layouts, changes = site_layouts(self.analysed, guard, self.batch_dim)
        index, dim = meta.batch_source([n for n in self.analysed.graph.nodes if n.op == "placeholder"], self.batch_dim)
        if problems and isinstance(inputs[index], torch.Tensor) and inputs[index].shape[dim] == 1:
            # a batch of one leaves layouts ambiguous ((N*T, d) with N = 1 is also (T, d)), but every tensor
            # then is the one sample's: each site reads its tensors whole
            return one_sample_layouts(guard, index, dim)
        if problems:
            fix = ("train with the input shapes the model was analysed for, or compile again with example_inputs of "
                   "these shapes so that fxdp can choose another engine up front")
            causes = [f for f in result.report.findings if f.severity is not Severity.INFO]
            raise NotPrivateError([*causes, *(dataclasses.replace(f, fix=fix) for f in problems)],
                                  f"fxdp cannot follow the batch through the model for inputs of shapes {shapes}"
                                  + ("" if first else ", which the analysis had not seen (fxdp re-ran it for them)")
                                  + "; per-sample gradients would be wrong, so this forward is refused:")
        if first:
            self._report_first_batch(result.report, changes)
        self.pin_batch_inputs(inputs, layouts.input_index, layouts.dim)
        return layouts

    def _batch_dim(self, inputs: Tuple[Any, ...], first: bool):
        """The batch_dim pass on ``inputs``; where it fails, the error the model's own forward would raise."""
        try:
            return propagate_batch_dim(self.analysed, tuple(inputs), batch_dim=self.batch_dim, strict=self.strict,
                                       batch_inputs=self.batch_inputs)
        except BatchDimAnalysisError as exc:
            if isinstance(exc.__cause__, ExportShapeError):  # a captured graph's sizes do not fit: its own error
                raise exc.__cause__
            if not first and exc.__cause__ is not None and not isinstance(exc.__cause__, FxdpError):
                # an op of an analysed model fails on these inputs: the error its own forward raises
                raise exc.__cause__
            raise  # on the first batch, the analysis's error (the one example_inputs of that shape would give)

    def _report_first_batch(self, batch_dim: PassReport, changes) -> None:
        previous = _report(self.compiled)
        reports = [*[p for p in previous.passes if p.name not in ("batch_dim", "per_sample")], batch_dim,
                   PassReport("per_sample", tuple(changes), previous.pass_report("per_sample").findings)]
        notes = [n for n in previous.notes if n != NO_INPUTS_NOTE] + ["batch_dim: run on the first batch"]
        setattr(self.compiled, REPORT_ATTR, dataclasses.replace(previous, passes=tuple(reports), notes=tuple(notes),
                                                               fallback_reason=None, fallback_location=None))

    def pin_batch_inputs(self, values, input_index: int, dim: int) -> None:
        """Once found on a batch of several samples, the batched inputs stay the same for other shapes (with
        one sample, a (1, T) input cannot be told from a batched one)."""
        if self.batch_inputs is None and batch_size_of(values, input_index, dim) > 1:
            self.batch_inputs = batched_input_names(self.analysed)

    def rebuild(self, compiled: torch.fx.GraphModule, why: str, args: tuple, kwargs: dict) -> None:
        """``compiled`` changed since it was compiled (``why``). Bring what was replaced on it over to the model it
        was compiled from, compile that again with the same settings and sink, and put the new graph in
        ``compiled``'s place; parameters the model no longer uses are retired in the sink (a DP optimizer still
        holding one refuses to step). Raises instead where the result would not be a graph."""
        guard = getattr(compiled, GUARD_ATTR)
        _copy_replacements(compiled, self)
        inputs = _call_inputs(self.original, args, kwargs) if self.with_example_inputs else None
        sink = sink_of(compiled)
        new = self.compile_again(self.original, inputs, batch_dim=self.batch_dim, loss_reduction=self.loss_reduction,
                                 strict=self.strict, sink=sink, batch_inputs=self.batch_inputs)
        rep = _report(new)
        if rep.engine != "fx" or not isinstance(new, torch.fx.GraphModule):
            _remove_hooks(new)
            raise ModelChangedError(
                f"fxdp: {why} since the model was compiled. Compiled again, it needs the {rep.engine} engine "
                f"({rep.fallback_reason}), which cannot take the compiled graph's place: compile the changed model "
                "again with fxdp.compile_for_dp (or call make_private again with it)")
        if sink is not None:  # the parameters as compiled, against the new graph's
            sink.retire([p for _, _, p, _ in guard.watch.entries if isinstance(p, nn.Parameter)], new.parameters(), why)
        note = f"compiled again before a forward: {why}"
        setattr(new, REPORT_ATTR, dataclasses.replace(rep, notes=(*rep.notes, note)))
        _take_place(compiled, type(new), new.__dict__)
        getattr(compiled, GUARD_ATTR).fxdp_relink(compiled)
        # forward calls go on being numbered: a call before the change and one after, then one backward, hold
        # different samples (the sink keeps their rows apart by call)
        getattr(compiled, GUARD_ATTR).calls = guard.calls
        warnings.warn(f"fxdp: {why}: the model was compiled again before this forward (fxdp.report(model) says "
                      "how). A DP optimizer trains a new parameter only if it holds it, and "
                      "refuses to step while it holds one the model no longer uses", stacklevel=6)

    def judge_loss(self, graph: torch.fx.GraphModule, values: Sequence[Any], outputs: Sequence[Tuple[int, tuple]],
                   batch_size: int, shared: Sequence[int] = (), guessed: Sequence[int] = ()) -> PassReport:
        """The loss pass on a loss recorded from the model's output (:mod:`fxdp.runtime.loss_probe`): the output
        tensors it reads get the layouts the analysis found for them, shared tensors none."""
        structure = self._output_layouts()
        layouts: List[Any] = [None] * len(values)
        for position, path in outputs:
            layouts[position] = _layout_at(structure, path, values[position], batch_size)
        for position in shared:
            layouts[position] = UNBATCHED_LAYOUT
        return analyse_loss(graph, values, layouts, [position for position, _ in outputs], batch_size, self.batch_dim,
                            guessed)

    def judge_criterion(self, criterion, args: Sequence[Any], batch_size: int) -> Optional[PassReport]:
        """The loss pass on ``criterion(*args)`` traced by torch.fx, ``args[0]`` the model's output; None where it
        cannot be traced (the loss probe judges it on the first backward then)."""
        graph, _ = trace_criterion(criterion, len(args))
        if graph is None:
            return None
        layouts = [_layout_at(self._output_layouts(), (), args[0], batch_size)] + [None] * (len(args) - 1)
        return analyse_loss(graph, list(args), layouts, [0], batch_size, self.batch_dim)

    def _output_layouts(self):
        output = next(n for n in reversed(self.analysed.graph.nodes) if n.op == "output")
        return output.meta.get(meta.BATCH_LAYOUT)

    def recapture(self, compiled: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
        """Before each forward of a graph torch.export captured: see :func:`_recapture`."""
        if self.captured:
            _recapture(compiled, args, kwargs)


def _layout_at(structure, path: tuple, value, batch_size: int):
    """The layout the analysis found at ``path`` in the model's output, where it fits ``value``; else None (the
    loss pass then reads it from the shape)."""
    for key in path:
        try:
            structure = structure[key]
        except (KeyError, IndexError, TypeError):
            return None
    if isinstance(structure, BatchLayout) and isinstance(value, torch.Tensor) and structure.kind == BATCHED:
        fits = value.dim() > structure.dim and value.shape[structure.dim] == batch_size
        return structure if fits else None
    return structure if isinstance(structure, BatchLayout) and structure.kind != BATCHED else None


def _report(compiled: nn.Module):
    return getattr(compiled, REPORT_ATTR)


def _remove_hooks(model: nn.Module) -> None:
    remove = getattr(model, "remove_hooks", None)
    if callable(remove):
        remove()


def _take_place(compiled: torch.fx.GraphModule, cls: type, body: dict) -> None:
    """``compiled`` becomes the compiled model of class ``cls`` and attributes ``body``, keeping its hooks and mode
    (the user's too)."""
    mine = {k: v for k, v in compiled.__dict__.items() if "hook" in k or k == "training"}
    compiled.__dict__.clear()
    compiled.__dict__.update(body)
    compiled.__dict__.update(mine)
    compiled.__class__ = cls


def _call_inputs(original: nn.Module, args: tuple, kwargs: dict):
    """The inputs of a call of ``original``, as example inputs (keywords ``forward`` takes through ``**kwargs`` by
    their own names, as the capture takes them)."""
    if not kwargs:
        return args[0] if len(args) == 1 else tuple(args)
    named = keyword_inputs(original.forward, args, kwargs)
    if named is None:
        raise ExportShapeError(
            f"fxdp: {type(original).__name__} was called with positional inputs that its forward takes through "
            f"*args, and keywords ({', '.join(kwargs)}), which fxdp cannot capture together: pass every input by "
            "keyword, or every input by position")
    return named


def install_guards(gm: torch.fx.GraphModule, analysed: torch.fx.GraphModule, model: nn.Module, example_inputs, *,
                   batch_dim: int, strict: bool, batch_inputs, loss_reduction: str,
                   compile_again: CompileAgain) -> None:
    """Let the compiled model check at every forward that its layouts were analysed for the input shapes it
    gets, and re-run the analysis (or refuse) for new ones (:mod:`fxdp.runtime.guards`); and notice that
    ``model`` changed since (:func:`watch_model`)."""
    guard = getattr(gm, GUARD_ATTR)
    pinned = None if batch_inputs is None else tuple(
        (batch_inputs,) if isinstance(batch_inputs, (str, int)) else batch_inputs)
    captured = isinstance(getattr(gm, _INPUT_SHAPES, None), ExportShapeGuard)
    guard.reanalysis = reanalysis = GraphReanalysis(analysed, batch_dim, strict, pinned, compile_again, gm,
                                                    captured=captured, training=gm.training if captured else True)
    guard.symbolic_batch = symbolic_batch(gm) if batch_dim == guard.dim else None
    if example_inputs is not None:  # analysed at compile time: these shapes need no second analysis
        values = tuple(bind_inputs(analysed, example_inputs))
        reanalysis.pin_batch_inputs(values, guard.input_index, guard.dim)
        guard.remember(input_signature(values), values)
    watch_model(gm, model, loss_reduction, example_inputs is not None)
    setattr(gm, LOSS_WATCH_ATTR, LossWatch())  # the loss is judged on the first step (fxdp.runtime.loss_probe)


def watch_model(gm: torch.fx.GraphModule, model: nn.Module, loss_reduction: str, with_example_inputs: bool,
                guard: Optional[BatchGuard] = None) -> None:
    """Let the compiled model notice, before each forward, that a layer or parameter its graph uses was
    replaced (on it or on ``model``) or that a frozen parameter it cannot train was unfrozen, and then be
    compiled again in place (:meth:`GraphReanalysis.rebuild`)."""
    guard = guard if guard is not None else getattr(gm, GUARD_ATTR)
    reanalysis = guard.reanalysis
    reanalysis.original, reanalysis.loss_reduction, reanalysis.with_example_inputs = model, loss_reduction, \
        with_example_inputs
    reanalysis.paths = tuple(dict.fromkeys(
        str(node.target) for node in gm.graph.nodes if node.op in ("call_module", "get_attr")
        and isinstance(_resolve(gm, str(node.target)), (nn.Module, nn.Parameter))))
    watch = StructureWatch()
    reanalysis.objects = {}
    for root, name in ((gm, _COMPILED), (model, _ORIGINAL)):
        reanalysis.objects[name] = {prefix: _resolve(root, prefix) for path in reanalysis.paths
                                    for prefix in _prefixes(path)}
        for path in reanalysis.paths:
            end = watch.add_path(root, path, name)
            if isinstance(end, nn.Module):
                watch.add_subtree(end, path, name, sizes=False)  # a stock layer's forward finds no new one
    for use in guard.frozen:
        watch.add_frozen(use.param, use.name)
    guard.watch = watch


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


def _copy_replacements(compiled: torch.fx.GraphModule, reanalysis: GraphReanalysis) -> None:
    """A layer or parameter replaced on the compiled model is replaced on the model it was compiled from too
    (they share layers and parameters; checkpoints hold the latter's), so that compiling that again sees it."""
    done: List[str] = []
    original, objects = reanalysis.original, reanalysis.objects
    for prefix in sorted(objects[_COMPILED], key=lambda p: p.count(".")):
        if any(prefix.startswith(d + ".") for d in done):
            continue
        now, then = _resolve(compiled, prefix), objects[_COMPILED][prefix]
        if now is then:
            continue
        where = prefix.rpartition(".")
        parent = _resolve(original, where[0]) if where[0] else original
        theirs = _resolve(original, prefix)
        if now is None or not isinstance(parent, nn.Module) or (
                theirs is not objects[_ORIGINAL].get(prefix) and theirs is not now):
            raise ModelChangedError(
                f"fxdp: '{prefix}' was {'removed from' if now is None else 'replaced on'} the compiled model"
                + ("" if now is None or theirs is objects[_ORIGINAL].get(prefix) else
                   " and replaced by another object on the model it was compiled from")
                + ", which fxdp cannot follow: change the model you passed to compile_for_dp (make_private) and "
                "compile it again")
        setattr(parent, where[2], now)
        done.append(prefix)


def _recapture(compiled: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """For inputs whose sizes the captured graph does not hold (another sequence length), or keyword inputs it was
    not captured with (a model captured from a tuple batch's first item, then called with the batch's items as
    keywords), put in the graph captured for them (kept from an earlier capture, or captured now, with the same
    settings and the same sink: the parameters are the same, so their per-sample norms and clipped sums go on
    accumulating where they did). Each graph keeps its own guards and its analysis; the forward calls go on being
    numbered across them. Inputs a forward pre-hook takes out of the call before the graph runs (one that says so
    in ``fxdp_outside_inputs``: labels, whose loss is computed outside the graph) are left out."""
    outside = {k for hook in compiled._forward_pre_hooks.values() for k in getattr(hook, "fxdp_outside_inputs", ())}
    kwargs = {k: v for k, v in kwargs.items() if k not in outside}
    inputs = flat_inputs(compiled, args, kwargs)
    if inputs is not None and getattr(compiled, _INPUT_SHAPES).mismatch(inputs) is None:
        return  # fits
    guard = getattr(compiled, GUARD_ATTR)
    reanalysis = guard.reanalysis
    if reanalysis.original is None or (inputs is None and not _binds(reanalysis.original, args, kwargs)):
        return  # a call the model's own forward refuses: the captured graph's code says what is wrong
    if reanalysis.captures is None:
        reanalysis.captures = [(type(compiled), dict(compiled.__dict__))]
    captures = reanalysis.captures
    entry = next((e for e in captures if _fits(e, args, kwargs)), None)
    if entry is None:
        entry = _capture_again(compiled, reanalysis, inputs, args, kwargs)
        captures.append(entry)
    rep = _report(compiled)
    shapes = "; ".join(body["_modules"][_INPUT_SHAPES].describe() for _, body in captures)
    notes = [n for n in rep.notes if not n.startswith(_CAPTURES_NOTE)]
    note = f"{_CAPTURES_NOTE} seen ({len(captures)} graphs, kept: {shapes})"
    calls = guard.calls
    _take_place(compiled, entry[0], entry[1])
    setattr(compiled, REPORT_ATTR, dataclasses.replace(rep, notes=(*notes, note)))
    for name, module in compiled._modules.items():  # the graph's own guards take the model's mode (its layers are
        if name.startswith("fxdp_") and isinstance(module, nn.Module):  # the user's, in the mode they are in)
            module.training = compiled.training
    now = getattr(compiled, GUARD_ATTR)
    if now.reanalysis.compiled is not compiled:  # its report and its watch are the compiled model's
        now.fxdp_relink(compiled)
    now.calls = calls  # a call before the switch and one after, then one backward, hold different samples


def _binds(original: nn.Module, args: tuple, kwargs: dict) -> bool:
    try:
        inspect.signature(original.forward).bind(*args, **kwargs)
        return True
    except TypeError:
        return False


def _fits(entry: Tuple[type, dict], args: tuple, kwargs: dict) -> bool:
    """Whether a kept capture (class, __dict__ of its compiled graph) takes this call: its inputs bind to the
    graph's and have the sizes it holds."""
    cls, body = entry
    graph = object.__new__(cls)  # (GraphModule.__new__ would make another class; reads only, the body kept)
    graph.__dict__.update(body)
    inputs = flat_inputs(graph, args, kwargs)
    return inputs is not None and body["_modules"][_INPUT_SHAPES].mismatch(inputs) is None


def _capture_again(compiled: torch.fx.GraphModule, reanalysis: GraphReanalysis, inputs, args: tuple,
                   kwargs: dict) -> Tuple[type, dict]:
    """The model captured again for these inputs, as (class, __dict__) of the compiled graph; raises where the
    result would not be one graph. ``inputs`` is None for a call with other inputs than the graph's: which of
    them carry the batch is then found afresh (the names pinned for the graph are not all of them)."""
    original = reanalysis.original
    # in the mode the first graph was captured in, whatever the mode now: every graph then treats dropout
    # as the first does (a layer's follows train()/eval(); functional dropout keeps the captured mode, and
    # the graph refuses eval() if it is on)
    modes = [(m, m.training) for m in original.modules()]
    original.train(reanalysis.training)
    try:
        new = reanalysis.compile_again(
            original, _capture_inputs(original, args, kwargs, reanalysis.batch_dim), batch_dim=reanalysis.batch_dim,
            loss_reduction=reanalysis.loss_reduction, strict=reanalysis.strict, sink=sink_of(compiled),
            batch_inputs=reanalysis.batch_inputs if inputs is not None else None)
    finally:
        for m, mode in modes:
            m.training = mode
    rep = _report(new)
    if rep.engine != "fx" or not isinstance(getattr(new, _INPUT_SHAPES, None), ExportShapeGuard):
        _remove_hooks(new)
        shape_guard = getattr(compiled, _INPUT_SHAPES)
        if inputs is not None:
            name, _, shape = shape_guard.mismatch(inputs)
            given, do = f"input '{name}' has shape {shape}", ("give it inputs of the shapes it was captured for (pad "
                                                               "every batch to one length, padding='max_length')")
            if isinstance(shape, str):  # an input that is no tensor, of another value
                given, do = f"input '{name}' has the {shape}", "give it the value it was captured with"
        else:
            given = f"this call passes {', '.join([*(['positional'] if args else []), *kwargs])}"
            do = ("call it with the inputs it was captured with, or make it private with example_inputs= a dict of "
                  "every keyword your training loop passes (make_private / compile_for_dp)")
        raise ExportShapeError(
            f"fxdp: {rep.model} was captured with torch.export for inputs of shapes {shape_guard.describe()}; "
            f"{given}, and captured again for it the model needs the {rep.engine} "
            f"engine ({rep.fallback_reason or 'not one graph'}), which cannot take the graph's place: {do}")
    getattr(new, GUARD_ATTR).reanalysis.captures = reanalysis.captures
    return type(new), dict(new.__dict__)


def _capture_inputs(original: nn.Module, args: tuple, kwargs: dict, batch_dim: int):
    """The inputs to capture ``original`` with, as the call gives them; a batch of one repeated to two samples
    (torch.export fixes a size of one: the graph would run batches of one only)."""
    inputs = _call_inputs(original, args, kwargs)
    leaves = [x for x in torch.utils._pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > batch_dim]
    if leaves and leaves[0].shape[batch_dim] == 1:
        inputs = torch.utils._pytree.tree_map(
            lambda x: torch.cat([x, x], batch_dim) if isinstance(x, torch.Tensor) and x.dim() > batch_dim
            and x.shape[batch_dim] == 1 else x, inputs)
    return inputs
