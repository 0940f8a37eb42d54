"""Pass 3, batch_dim: where is the batch dimension at every node, and which ops move it or mix samples.

The pass interprets the graph on fake tensors (``FakeTensorMode``: shapes and dtypes, no data, no
real compute). The model's parameters and buffers are swapped for fake copies while it runs and put
back afterwards, so the user's model is left as it was. For every node it writes

- ``node.meta[fxdp.meta.BATCH_LAYOUT]``: a :class:`fxdp.layout.BatchLayout` (a tuple for tuple outputs,
  None for values that are not tensors), the per_sample pass's map of where each sample's rows are;
- ``node.meta[fxdp.meta.FAKE_VALUE]``: the fake output.

The interpreter is generic: it names no op. The per-op knowledge lives in
:mod:`fxdp.passes.batch_rules`: each op's rule (``find_batch_rule(op)(call) -> Verdict``), and what
the interpreter asks about a node besides its rule (:mod:`fxdp.passes.batch_rules.nodes`: sizes equal
to the batch size, elements of tuple outputs, in-place writes). Findings (each with the user's line
and the path from the batched input):

- ``MOVES_BATCH`` (warning): the op changed where the batch sits (transpose(0, 1), permute, a
  reshape merging the batch with time, unsqueeze(0), ...) and did not put it back where it was;
- ``MIXES_SAMPLES`` (error): the op lets samples influence each other (a reduction over the batch,
  batch norm in training, softmax over the batch, ...): no DP guarantee survives it;
- ``UNVERIFIED`` (warning): a per-sample tensor reached an op with no rule; strict mode raises.

Which inputs are batched is decided in :mod:`fxdp.passes.batch_inputs` from all inputs and the graph
(or named by the user with ``batch_inputs=``); within a batched input a tensor is batched when its
size at ``batch_dim`` is ``N``, broadcast when it is 1 (position ids of shape ``(1, T)``) and
unbatched otherwise. Shared inputs are broadcast (size 1) or unbatched (a ``(T, T)`` mask).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import networkx as nx
import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_aggregate
from torch.nn.utils.stateless import _reparametrize_module
from torch.nn.utils.rnn import PackedSequence

from fxdp import meta
from fxdp.diagnostics import (
    BatchDimAnalysisError, Finding, Kind, MissingBatchRuleError, PassReport, PassResult, Severity, op_name,
)
from fxdp.grad_sample.moe import fake_output
from fxdp.grad_sample.transformer import stack_fake_output
from fxdp.layout import BROADCAST, PACKED, UNBATCHED_LAYOUT, UNKNOWN, UNKNOWN_LAYOUT, BatchLayout
from fxdp.passes.batch_inputs import (
    _bind_inputs,
    _first_tensor,
    _input_layout,
    _shared_layout,
    choose_batch_inputs,
    input_name,
    named_batch_inputs,
    output_verdict,
    packed_inputs,
)
from fxdp.passes.batch_rules import (
    Facts,
    OpCall,
    Verdict,
    element_layout,
    find_batch_rule,
    is_inplace,
    keeps_sample_index,
    mirror,
    carries_batch,
    reads_facts,
    record_facts,
    selects_element,
    stores_item,
    tensor_pairs,
)
from fxdp.frontends.fx import source_location, trace

PASS_NAME = "batch_dim"

try:  # ops whose output shape depends on the data cannot run on fake tensors
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    _DATA_DEPENDENT: Tuple[type, ...] = (
        DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
except ImportError:  # pragma: no cover - older torch
    _DATA_DEPENDENT = ()


class _Unknown:
    """The value of a node that could not run on fake tensors (its shape depends on the data)."""

    def __repr__(self) -> str:
        return "<unknown>"


_UNKNOWN_VALUE = _Unknown()

# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _to_fake(value, mode: FakeTensorMode):
    if isinstance(value, torch.Tensor):
        return value if isinstance(value, FakeTensor) else mode.from_tensor(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fake(v, mode) for v in value)
    if isinstance(value, dict):
        return {k: _to_fake(v, mode) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------


class _Raw:
    """A finding before its path is known."""

    __slots__ = ("node", "op", "kind", "severity", "message", "fix")

    def __init__(self, node, op, kind, severity, message, fix):
        self.node, self.op, self.kind, self.severity, self.message, self.fix = node, op, kind, severity, message, fix


class BatchDimInterpreter(torch.fx.Interpreter):
    """Runs the graph on fake tensors; records each node's batch layout and the findings."""

    def __init__(self, gm: torch.fx.GraphModule, mode: Optional[FakeTensorMode],
                 input_layouts: Dict[torch.fx.Node, Any], batch_size: int, home: BatchLayout, strict: bool):
        super().__init__(gm)
        # our errors name the node and the user's line; torch's extra traceback would paste its own
        # frames into their message
        self.extra_traceback = False
        self.mode = mode
        self.input_layouts = input_layouts
        self.batch_size = batch_size
        self.home = home
        self.strict = strict
        self.layouts: Dict[torch.fx.Node, Any] = {}
        self.facts = Facts()
        self.raw: List[_Raw] = []
        self.data_dependent = False  # an op's output shape depended on the data (fake tensors cannot run it)
        self._fake_constants: Dict[int, torch.Tensor] = {}
        # batch moves travel with the values they produced until an op computes with them (then they
        # are reported) or a rearranging op puts the batch back home (then they are dropped)
        self.pending: Dict[torch.fx.Node, Tuple[_Raw, ...]] = {}
        self._emitted: set = set()
        self._rearranged: set = set()

    # -- running ---------------------------------------------------------------------------

    def run_node(self, n: torch.fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if _contains_unknown(args) or _contains_unknown(kwargs):
                out = _UNKNOWN_VALUE
            else:
                try:
                    out = getattr(self, n.op)(n.target, args, kwargs)
                except _DATA_DEPENDENT as exc:
                    out = _UNKNOWN_VALUE
                    self.data_dependent = True
                    if self._any_per_sample(n):
                        self._report(n, Kind.UNVERIFIED, Severity.WARNING,
                                     "its output's shape depends on the data (boolean masks, nonzero, "
                                     f"item(), ...): fxdp cannot follow the batch past it ({type(exc).__name__})",
                                     "Use shape-preserving ops (torch.where, masked_fill) instead of "
                                     "data-dependent selection.")
                except Exception as exc:
                    raise self._error(n, exc) from exc
            layout = self._layout(n, args, kwargs, out)
        self.layouts[n] = layout
        if n in self._rearranged:
            self._carry_moves(n, layout)
        elif n.op != "placeholder" and (_has_tensor(out) or n.op == "output" or stores_item(n)):
            for a in _flat_nodes(n):  # an op computing with moved values: their moves count now
                self._emit(self.pending.get(a, ()))
        n.meta[meta.BATCH_LAYOUT] = layout
        n.meta[meta.FAKE_VALUE] = None if out is _UNKNOWN_VALUE else out
        return out

    def call_module(self, target, args, kwargs):
        # a mixture-of-experts block picks rows by data (shapes no fake tensor knows): its output is like its input;
        # so is a stock transformer stack's, which asks whether a mask is causal (values fake tensors do not hold)
        module = self.fetch_attr(target)
        out = fake_output(module, args)
        out = out if out is not None else stack_fake_output(module, args, kwargs)
        return out if out is not None else super().call_module(target, args, kwargs)

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        # constants that are not parameters or buffers (tensors stored on modules) become fake too
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and self.mode is not None:
            key = id(value)
            if key not in self._fake_constants:
                self._fake_constants[key] = self.mode.from_tensor(value)
            value = self._fake_constants[key]
        return value

    def _error(self, n: torch.fx.Node, exc: BaseException) -> BatchDimAnalysisError:
        loc = source_location(n)
        where = f" at {loc}" + (f" ({loc.code})" if loc and loc.code else "") if loc else ""
        return BatchDimAnalysisError(
            f"fxdp batch_dim: running {self._op_label(n)} (node {n.name}){where} on the example inputs' "
            f"shapes failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n"
            f"  node: {n.format_node()}\n"
            "Check that example_inputs have the shapes and dtypes the model is trained with.")

    # -- layouts ---------------------------------------------------------------------------

    def _arg_layout(self, a):
        return map_aggregate(a, lambda x: self.layouts.get(x) if isinstance(x, torch.fx.Node) else None)

    def _any_per_sample(self, n: torch.fx.Node) -> bool:
        found = []
        map_aggregate((n.args, n.kwargs), lambda x: found.append(x) if isinstance(x, torch.fx.Node) else None)
        return any(_has_per_sample(self.layouts.get(x)) for x in found)

    def _layout(self, n: torch.fx.Node, args, kwargs, out):
        if n.op == "placeholder":
            return self.input_layouts.get(n)
        if n.op == "get_attr":
            return mirror(out, UNBATCHED_LAYOUT)
        if n.op == "output":
            return self._arg_layout(n.args[0])
        if out is _UNKNOWN_VALUE:
            return UNKNOWN_LAYOUT
        record_facts(n, args, self.layouts, self.facts)
        if selects_element(n, args):  # an element of a tuple output, or .values
            self._rearranged.add(n)
            return element_layout(n, self._arg_layout(n.args[0]), args, out)

        arg_layouts = self._arg_layout(n.args)
        kwarg_layouts = self._arg_layout(n.kwargs)
        module = self.fetch_attr(n.target) if n.op == "call_module" else None
        op = module if module is not None else n.target
        call = OpCall(op, args, kwargs, arg_layouts, kwarg_layouts, out, self.batch_size, self.home, n, self.facts)
        pairs = call.operands()
        writes = stores_item(n)
        if not _has_tensor(out) and not writes:
            return mirror(out, None)
        if any(isinstance(lay, BatchLayout) and lay.kind == UNKNOWN for _, lay in pairs):
            return mirror(out, UNKNOWN_LAYOUT)  # the op that lost the batch was reported already
        per = any(carries_batch(lay) for _, lay in pairs)
        uses_facts = reads_facts(n, _flat_nodes(n), self.facts)
        broadcast = any(isinstance(lay, BatchLayout) and lay.kind == BROADCAST for _, lay in pairs)
        packed = any(_is_packed(lay) for _, lay in pairs)

        rule = find_batch_rule(op)
        if packed and not getattr(rule, "reads_packed", False):
            self._unverified(n, pairs, f"{op_name(op)} receives the samples' entries packed one after another, "
                                       "which only the offsets beside them tell apart")
            return mirror(out, UNKNOWN_LAYOUT)
        if rule is None:
            if per:
                self._unverified(n, pairs, f"fxdp has no batch rule for {op_name(op)}, so it cannot tell whether it "
                                           "keeps samples apart or where the batch is afterwards")
                return mirror(out, UNKNOWN_LAYOUT)
            return mirror(out, UNBATCHED_LAYOUT)
        if not (per or uses_facts or broadcast or packed):
            return mirror(out, UNBATCHED_LAYOUT)  # nothing per-sample flows in: nothing to mix or move
        try:
            verdict = rule(call)
        except Exception as exc:  # a rule that cannot handle these arguments is a reported outcome
            if self.strict:
                raise self._error(n, exc) from exc
            if per:
                self._report(n, Kind.UNVERIFIED, Severity.WARNING,
                             f"fxdp's batch rule for {op_name(op)} could not handle this call "
                             f"({type(exc).__name__}: {exc}), so the op is unverified",
                             "Report this at fxdp with the op and its arguments; meanwhile check the op by hand.")
            return mirror(out, UNKNOWN_LAYOUT if per else UNBATCHED_LAYOUT)
        return self._apply(n, call, verdict, per or packed, rule)

    def _apply(self, n: torch.fx.Node, call: OpCall, verdict: Verdict, per: bool, rule):
        if getattr(rule, "rearranges", False):
            self._rearranged.add(n)
        if verdict.mixes:
            self._report(n, Kind.MIXES_SAMPLES, Severity.ERROR, verdict.mixes, verdict.fix)
        elif verdict.moves:
            move = _Raw(n, self._op_label(n), Kind.MOVES_BATCH, Severity.WARNING, verdict.moves, verdict.fix)
            if n in self._rearranged:
                self.pending[n] = (move,)
            else:
                self._emit((move,))
        elif per and _first_layout(verdict.layout) is not None and _first_layout(verdict.layout).kind == UNKNOWN:
            self._unverified(n, call.operands(), f"fxdp's rule for {call.name} cannot tell where the batch is "
                                                 "after this call")
        target = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if target is not None:
            if verdict.updates_input is not None:
                self.layouts[target] = verdict.updates_input  # later readers of the written tensor see it
            elif is_inplace(n) and isinstance(verdict.layout, BatchLayout):
                self.layouts[target] = verdict.layout
            if (target in self.facts.sample_index and keeps_sample_index(n)
                    and not verdict.mixes and carries_batch(verdict.layout)):
                self.facts.sample_index.add(n)
        return verdict.layout

    # -- findings --------------------------------------------------------------------------

    def _op_label(self, n: torch.fx.Node) -> str:
        if n.op == "call_module":
            return op_name(self.fetch_attr(n.target))
        if n.op == "call_function" and n.target is builtins.getattr and len(n.args) > 1:
            return f"Tensor.{n.args[1]}"
        if n.op in ("call_function", "call_method"):
            return op_name(n.target)
        return n.op

    def _report(self, n, kind, severity, message, fix) -> None:
        self.raw.append(_Raw(n, self._op_label(n), kind, severity, message, fix))

    def _carry_moves(self, n: torch.fx.Node, layout) -> None:
        """A rearranging op passes on the moves behind its inputs unless the batch is back home."""
        carried = [m for a in _flat_nodes(n) for m in self.pending.get(a, ())] + list(self.pending.get(n, ()))
        lay = _first_layout(layout)
        if carried and lay is not None and lay != self.home and (carries_batch(lay) or lay.kind == UNKNOWN):
            self.pending[n] = tuple(dict.fromkeys(carried))
        else:
            self.pending.pop(n, None)

    def _emit(self, moves) -> None:
        for m in moves:
            if id(m) not in self._emitted:
                self._emitted.add(id(m))
                self.raw.append(m)

    def _unverified(self, n: torch.fx.Node, pairs, message: str) -> None:
        lays = ", ".join(str(lay) for _, lay in pairs if carries_batch(lay) or _is_packed(lay))
        if self.strict:
            loc = source_location(n)
            raise MissingBatchRuleError(
                f"fxdp batch_dim (strict): {message}. It receives a per-sample tensor ({lays}) at node "
                f"{n.name}" + (f", {loc} ({loc.code})" if loc else "") + f".\n  node: {n.format_node()}\n"
                f"Register a rule with fxdp.register_batch_rule(...) or run with "
                "strict=False to report the op as unverified.")
        self._report(n, Kind.UNVERIFIED, Severity.WARNING,
                     f"{message}; it receives a per-sample tensor ({lays})",
                     "Register a batch rule for it (fxdp.register_batch_rule), or check "
                     "by hand that it treats samples independently.")


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _contains_unknown(value) -> bool:
    found = []
    map_aggregate(value, lambda x: found.append(x) if x is _UNKNOWN_VALUE else None)
    return bool(found)


def _has_tensor(value) -> bool:
    return any(True for _ in tensor_pairs(value, None))


def _has_per_sample(layout) -> bool:
    if isinstance(layout, (tuple, list)):
        return any(_has_per_sample(x) for x in layout)
    if isinstance(layout, dict):
        return any(_has_per_sample(x) for x in layout.values())
    return carries_batch(layout)


def _first_layout(layout) -> Optional[BatchLayout]:
    if isinstance(layout, BatchLayout):
        return layout
    if isinstance(layout, (tuple, list)):
        for x in layout:
            found = _first_layout(x)
            if found is not None:
                return found
    return None


def _flat_nodes(n: torch.fx.Node) -> List[torch.fx.Node]:
    found: List[torch.fx.Node] = []
    map_aggregate((n.args, n.kwargs), lambda x: found.append(x) if isinstance(x, torch.fx.Node) else None)
    return found


def _paths(gm: torch.fx.GraphModule, sources: List[str], layouts) -> Dict[str, List[str]]:
    """Shortest path (node names) from the nearest batched input to every node reachable from one.

    Paths follow per-sample values first (not shape arithmetic such as ``x.size(0)``); a node reached
    only through other values gets its shortest path in the whole graph.
    """
    data, full = nx.DiGraph(), nx.DiGraph()
    for node in gm.graph.nodes:
        for g in (data, full):
            g.add_node(node.name)
        for user in node.users:
            full.add_edge(node.name, user.name)
            if _has_per_sample(layouts.get(node)):
                data.add_edge(node.name, user.name)
    if not sources:
        return {}
    _, paths = nx.multi_source_dijkstra(full, set(sources))
    _, data_paths = nx.multi_source_dijkstra(data, set(sources))
    paths.update(data_paths)
    return paths


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


# torch loggers that print a traceback of an op failing on fake tensors (example inputs of the wrong
# shape) before the exception reaches the pass, which raises its own error for it
_NOISY_TORCH_LOGGERS = ("torch._subclasses.fake_tensor",)


@contextlib.contextmanager
def quiet_torch_logs():
    """Keep torch's logged tracebacks off the user's terminal while the analysis runs: the loggers'
    levels are raised for the duration and restored after; nothing else about logging is touched."""
    loggers = [logging.getLogger(name) for name in _NOISY_TORCH_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def propagate_batch_dim(gm: torch.fx.GraphModule, example_inputs, *, batch_dim: int = 0,
                        strict: bool = False, batch_inputs: Optional[Sequence[Union[str, int]]] = None) -> PassResult:
    """Record where the batch is at every node (``meta.BATCH_LAYOUT``, ``meta.FAKE_VALUE``) and report
    the ops that move it (warnings), mix samples (errors) or have no rule (unverified warnings).

    ``example_inputs``: a tensor, a tuple/list of positional inputs, or a dict of inputs by name.
    ``batch_dim``: where the batch sits in the batched inputs (1 for time-major ``(T, N, ...)``).
    ``strict``: raise :class:`MissingBatchRuleError` on an op with no rule instead of reporting it.
    ``batch_inputs``: the names (or positions) of the inputs that carry the batch; the others are shared
    by all samples. Without it fxdp finds them (:mod:`fxdp.passes.batch_inputs`).
    """
    if not isinstance(batch_dim, int) or batch_dim < 0:
        raise ValueError(f"fxdp batch_dim: batch_dim must be a non-negative int, got {batch_dim!r}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = _bind_inputs(placeholders, example_inputs)
    for node, value in zip(placeholders, values):
        if isinstance(value, PackedSequence):
            raise BatchDimAnalysisError(
                f"fxdp batch_dim: input '{node.target}' is a PackedSequence, which the compiled graph does not take "
                "yet; use grad_sample_mode='hooks' (or 'functorch'), which trains recurrent layers on packed "
                "sequences, or pass padded tensors and pack them inside forward (the model then runs on the hooks "
                "engine)")
    packed = packed_inputs(gm, placeholders, values)
    # a packed input's length is no batch size: the hypotheses are made without it
    sized = [None if i in packed else v for i, v in enumerate(values)]
    first = _first_tensor(sized)
    if first is None:
        raise BatchDimAnalysisError("fxdp batch_dim: example_inputs contain no tensor; give at least the "
                                    "batched input (a tensor with the batch at batch_dim).")
    last: list = []  # the hypothesis analysed last, and its run: not repeated if it is chosen
    if batch_inputs is not None:
        chosen = named_batch_inputs(placeholders, sized, batch_inputs, batch_dim)
    else:
        if first.dim() <= batch_dim:
            raise BatchDimAnalysisError(
                f"fxdp batch_dim: the first tensor input has shape {tuple(first.shape)}, which has no dimension "
                f"{batch_dim} to hold the batch; pass batch_dim=<where the batch is> (0 for batch-first).")

        why: dict = {}  # hypothesis -> why it does not hold together, for a refusal

        def verdict(hypothesis) -> str:
            interpreter, layouts = _interpret(gm, placeholders, values, *hypothesis, batch_dim, False, packed)
            last[:] = [hypothesis, (interpreter, layouts)]
            mixing = next((r for r in interpreter.raw if r.kind is Kind.MIXES_SAMPLES), None)
            if mixing is not None:
                why[hypothesis] = _mixes_at(mixing.op, mixing.node)
                return "no"
            output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
            why[hypothesis] = f"the model's output does not carry the batch at dimension {batch_dim}"
            return output_verdict(interpreter.layouts.get(output), batch_dim)

        chosen = choose_batch_inputs(placeholders, sized, batch_dim, verdict, lambda h: why.get(h, ""))
    n, batched = chosen
    if not strict and last and last[0] == chosen:
        interpreter, input_layouts = last[1]
    else:
        interpreter, input_layouts = _interpret(gm, placeholders, values, n, batched, batch_dim, strict, packed)

    findings: Tuple[Finding, ...] = ()
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    interpreter.raw.sort(key=lambda r: order[r.node])
    if interpreter.raw:
        sources = [p.name for p in placeholders if _has_per_sample(input_layouts.get(p))]
        paths = _paths(gm, sources, interpreter.layouts)
        findings = tuple(
            Finding(PASS_NAME, r.node.name, r.op, r.kind, r.severity, r.message, r.fix,
                    source_location(r.node), tuple(paths.get(r.node.name, ())))
            for r in interpreter.raw)
    return PassResult(gm, PassReport(PASS_NAME, (), findings))


def _mixes_at(op: str, node: torch.fx.Node) -> str:
    """``op`` (the node ``node``) mixes samples, with the user's line where known."""
    loc = source_location(node)
    where = "" if loc is None else f" at {loc.where}" + (f" ({loc.code.strip()})" if loc.code else "")
    return f"{op}{where} mixes samples"


def _is_packed(layout) -> bool:
    return isinstance(layout, BatchLayout) and layout.kind == PACKED


def _interpret(gm, placeholders, values, n: int, batched: FrozenSet[int], batch_dim: int, strict: bool,
               packed: FrozenSet[int] = frozenset()):
    """Run the interpreter with the inputs at ``batched`` (placeholder positions) carrying ``n`` samples, and
    those at ``packed`` their entries one after another."""
    input_layouts = {p: BatchLayout.packed(0) if i in packed else _input_layout(v, batch_dim, n) if i in batched
                     else _shared_layout(v, batch_dim) for i, (p, v) in enumerate(zip(placeholders, values))}
    return interpret(gm, values, input_layouts, n, BatchLayout.at(batch_dim), strict), input_layouts


def interpret(gm: torch.fx.GraphModule, values: Sequence[Any], input_layouts: Dict[torch.fx.Node, Any], n: int,
              home: BatchLayout, strict: bool = False, real: bool = False) -> "BatchDimInterpreter":
    """Run the interpreter on fake copies of ``values`` (one per placeholder) whose layouts are ``input_layouts``,
    with ``n`` samples whose home is ``home``; every node's layout and fake value is written to its meta.
    ``real``: on ``values`` themselves, without gradients (a loss, whose ops may depend on the data: CTC)."""
    if real:
        interpreter = BatchDimInterpreter(gm, None, input_layouts, n, home, strict)
        with torch.no_grad(), quiet_torch_logs():
            interpreter.run(*values)
        return interpreter
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_values = [_to_fake(v, mode) for v in values]
    # fake copies of every parameter and buffer, under every name (tied ones stay tied)
    state = {name: mode.from_tensor(t) for name, t in
             list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))}
    interpreter = BatchDimInterpreter(gm, mode, input_layouts, n, home, strict)
    with _reparametrize_module(gm, state), mode, quiet_torch_logs():
        interpreter.run(*fake_values)
    return interpreter


def bind_inputs(gm: torch.fx.GraphModule, example_inputs) -> List[Any]:
    """One value per input of ``gm``'s forward (defaults filled in), as the compiled model receives them."""
    return _bind_inputs([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs)


def batched_input_names(gm: torch.fx.GraphModule) -> Tuple[str, ...]:
    """The inputs the last analysis of ``gm`` found carrying the batch."""
    return tuple(input_name(p) for p in gm.graph.nodes
                 if p.op == "placeholder" and _has_per_sample(p.meta.get(meta.BATCH_LAYOUT)))


def find_batch_dim_violations(model: nn.Module, example_inputs, batch_dim: int = 0,
                              batch_inputs: Optional[Sequence[Union[str, int]]] = None) -> List[Finding]:
    """Trace ``model`` and return what the batch_dim pass finds: ops that mix samples (errors), ops that
    move the batch dimension (warnings) and per-sample ops it cannot verify, each with your source line."""
    result = trace(model, example_inputs, batch_dim)
    if not result.ok:
        where = f" at {result.location} ({result.location.code})" if result.location else ""
        raise BatchDimAnalysisError(
            f"fxdp: cannot analyse {type(model).__name__}: torch.fx cannot trace it{where}: {result.reason}. "
            "The batch-dimension analysis needs a traceable forward(); move data-dependent Python control "
            "flow out of it, or check per-sample gradients with fxdp.check_per_sample_gradients_are_correct."
        ) from result.error
    return list(propagate_batch_dim(result.graph_module, example_inputs, batch_dim=batch_dim,
                                    batch_inputs=batch_inputs).report.findings)
