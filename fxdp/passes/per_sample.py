"""Pass 4, per_sample: replace every parametrised call with a DP-aware op from :mod:`fxdp.runtime`.

- ``call_module`` nodes of layers with trainable parameters become
  ``dp_aware_layer(self.<layer>, self.fxdp_site_<node>, batch_size, *args)``;
- torch functions and Tensor methods that take a trainable parameter directly (``F.linear(x, self.w)``,
  ``x * self.scale``, ``x + self.pos_embedding``, ``x @ self.proj``) become
  ``dp_aware_function(self.fxdp_site_<node>, batch_size, *args)`` (the site holds the function).

Each site records where the batch sits in the call's inputs and output (from the batch_dim pass, or
the default ``batch@<batch_dim>`` until the first batch fills it in), so per-sample gradients stay
right when a layer sees its input time-major, merged ``(N*T, d)`` or broadcast ``(1, T)``. Every site
holds the model's gradient sink (``gm.fxdp_sink``), where its op delivers what it sees in backward.

A parametrised op no site can serve is a finding (a warning): the compiler then runs the whole model
as one DP-aware op (:mod:`fxdp.engines.whole_model`, engine ``fx+whole-model``), or refuses it under
``strict``.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxdp import meta, runtime
from fxdp.diagnostics import WHOLE_MODEL, Finding, Kind, PassReport, PassResult, Severity, op_name
from fxdp.grad_sample.recurrent import recurrent_rule_applies
from fxdp.grad_sample.registry import rule_name
from fxdp.grad_sample.transformer import in_projection, transformer_rule_applies
from fxdp.sinks.contract import SINK_ATTR, GradientSink, GradSampleSink
from fxdp.layout import BATCHED, BROADCAST, MERGED, UNBATCHED, UNKNOWN, BatchLayout
from fxdp.frontends.fx import source_location

PASS_NAME = "per_sample"
_WHOLE_MODEL = f"fxdp runs the whole model as one op (per-sample engine {WHOLE_MODEL}) instead"


def _inputs_reach(graph: torch.fx.Graph) -> Set[torch.fx.Node]:
    """Nodes whose value depends on a model input (the others are parameters and constants)."""
    reached: Set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def _parameter(gm: torch.fx.GraphModule, node) -> Optional[nn.Parameter]:
    """The parameter a ``get_attr`` node reads, if it reads one."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        try:
            return gm.get_parameter(node.target)
        except AttributeError:
            return None
    return None


def _layout_of(node, default: BatchLayout, reached: Set[torch.fx.Node]) -> BatchLayout:
    layout = node.meta.get(meta.BATCH_LAYOUT, default) if isinstance(node, torch.fx.Node) else default
    if isinstance(layout, (tuple, list)):  # tuple outputs: the first tensor's layout
        layout = next((lay for lay in pytree.tree_leaves(layout) if isinstance(lay, BatchLayout)), default)
    if layout is None or (meta.BATCH_LAYOUT not in node.meta and node not in reached):
        return BatchLayout(UNBATCHED)
    return layout


def _site_layouts(node, default, reached, inputs=None) -> Tuple[List[BatchLayout], BatchLayout]:
    # one layout per tensor argument, in the order the runtime meets them (ints from x.size(0) are not)
    args = [a for a in pytree.tree_leaves((node.args, node.kwargs) if inputs is None else inputs)
            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get(meta.FAKE_VALUE, torch.empty(0)), torch.Tensor)]
    return [_layout_of(a, default, reached) for a in args], _layout_of(node, default, reached)


def _out_layouts(node, first: BatchLayout, default: BatchLayout) -> List[BatchLayout]:
    """Layouts of every tensor output (tuple outputs: MultiheadAttention, LSTM), the first as checked."""
    recorded = node.meta.get(meta.BATCH_LAYOUT)
    rest = [lay for lay in pytree.tree_leaves(recorded) if isinstance(lay, BatchLayout)][1:]
    return [first] + [lay if lay.kind != UNKNOWN else default for lay in rest]


def _finding(node, message: str, fix: str, kind=Kind.NOT_YET_SUPPORTED, severity=Severity.ERROR, op="") -> Finding:
    return Finding(PASS_NAME, node.name, op or op_name(node.target), kind, severity, message, fix,
                   source_location(node))


def _check_layouts(node, ins: List[BatchLayout], out: BatchLayout) -> Tuple[Optional[BatchLayout], Optional[Finding]]:
    """Decide the output layout a site will see; a finding when per-sample gradients cannot be had."""
    if any(lay.kind == UNKNOWN for lay in ins) or out.kind == UNKNOWN:
        return None, _finding(
            node, "where the batch sits in this call's input or output is unknown (an op upstream has no batch rule)",
            f"see the batch_dim findings; {_WHOLE_MODEL}", Kind.UNVERIFIED, Severity.WARNING)
    if out.kind in (BATCHED, MERGED):
        return out, None
    if out.kind == BROADCAST and any(lay.kind == BROADCAST for lay in ins):
        # (1, T) position ids: expanding the input to N is invisible iff every consumer broadcasts it
        fake = node.meta.get(meta.FAKE_VALUE)
        for user in node.users:
            u = user.meta.get(meta.BATCH_LAYOUT)
            u_fake = user.meta.get(meta.FAKE_VALUE)
            if not (isinstance(u, BatchLayout) and u.kind == BATCHED and u.dim == out.dim
                    and fake is not None and u_fake is not None and u_fake.dim() == fake.dim()):
                return None, _finding(
                    node, f"this layer's input is broadcast over the batch, and its consumer '{user.name}' does "
                    "not simply broadcast the output against per-sample data",
                    f"expand the input to the batch size before the layer; {_WHOLE_MODEL}", severity=Severity.WARNING)
        return BatchLayout.at(out.dim), None
    return None, _finding(
        node, f"this layer's output carries no batch dimension ({out}), so no per-sample gradient can be read "
        "from its backward", f"feed the layer per-sample data; {_WHOLE_MODEL}",
        severity=Severity.WARNING)


def _recorded_layouts(node, default, reached,
                      inputs=None) -> Tuple[List[BatchLayout], List[BatchLayout], Optional[Finding]]:
    """The input and output layouts a site records for ``node`` (or for ``inputs`` in its place, when
    ops on parameters were folded into it), or a finding saying why it cannot."""
    ins, out = _site_layouts(node, default, reached, inputs)
    out, problem = _check_layouts(node, ins, out)
    if problem is not None:
        return [], [], problem
    return ins, _out_layouts(node, out, default), None


def insert_per_sample_ops(gm: torch.fx.GraphModule, *, loss_reduction: str = "mean", batch_dim: int = 0,
                          sink: Optional[GradientSink] = None) -> PassResult:
    """Make every parametrised call a DP-aware op delivering to ``sink`` (a new
    :class:`~fxdp.sinks.contract.GradSampleSink` if not given), stored as ``gm.fxdp_sink``."""
    graph = gm.graph
    sink = sink if sink is not None else GradSampleSink()
    setattr(gm, SINK_ATTR, sink)
    default = BatchLayout.at(batch_dim)
    reached = _inputs_reach(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders:
        raise ValueError("the model takes no inputs, so there is no batch to compute per-sample gradients over")

    guard = runtime.BatchGuard(*meta.batch_source(placeholders, batch_dim))
    setattr(gm, runtime.GUARD_ATTR, guard)
    with graph.inserting_after(placeholders[-1]):
        guard_node = _get_attr(graph, runtime.GUARD_ATTR)
    with graph.inserting_after(guard_node):
        n = graph.call_function(runtime.batch_size, (guard_node, *placeholders))
    n.name = "batch_size"

    changes: List[Finding] = []
    findings: List[Finding] = []
    folded: Dict[str, List[str]] = {}  # node -> its inputs after folding (the sites' layouts follow them)
    gm.fxdp_folded = guard.folded = folded
    inner: List[torch.fx.Node] = []
    folds = {node.name: _fold_parameter_prefix(gm, node, reached, folded, inner) for node in list(graph.nodes)
             if node in reached and node.op in ("call_function", "call_method") and _derived_inputs(gm, node, reached)}
    _erase_unused(graph, inner)
    for node in list(graph.nodes):
        # frozen parameters get sites too: the runtime skips them while frozen, and unfreezing works
        arg_params = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if _parameter(gm, a) is not None]
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if not arg_params and next(module.parameters(), None) is None:
                continue
            rule = (rule_name(module) if not arg_params else None) or "generic"
            if rule == "generic" and not arg_params and recurrent_rule_applies(module):
                rule = "recurrent"  # step by step, one Linear-like capture per projection (generic if the batch moved)
            elif rule == "generic" and not arg_params and transformer_rule_applies(module):
                rule = "transformer"  # each projection, feed-forward layer and norm a DP-aware call of its own
                for attention in module.modules():  # its in-projection made now: under torch.compile, made in
                    if isinstance(attention, nn.MultiheadAttention) and attention.in_proj_weight is not None:
                        in_projection(attention)  # the traced forward, a Module is a graph break per block
            target, call, fn = node.target, runtime.dp_aware_layer, None
            what = f"layer '{node.target}' ({type(module).__name__})"
        elif node.op in ("call_function", "call_method") and arg_params:
            if node not in reached:
                if any(_parameter(gm, a).requires_grad for a in arg_params):
                    findings.append(_finding(
                        node, f"parameter '{arg_params[0].target}' goes through '{node.name}' before it meets "
                        "per-sample data", "use the parameter directly in the op that consumes the input (e.g. "
                        f"`x @ self.w.t()` as `F.linear(x, self.w)`); {_WHOLE_MODEL}", severity=Severity.WARNING))
                continue
            target = node.target if isinstance(node.target, str) else (
                str(node.target) if isinstance(node.target, torch._ops.OpOverload) else torch.typename(node.target))
            rule, call, fn = "generic", runtime.dp_aware_function, node.target
            what = f"'{node.name}' using {', '.join(repr(p.target) for p in arg_params)}"
            if node.name in folded:
                target, fn = f"{target} (with the ops on its parameters)", folds[node.name]
        else:
            continue

        ins, outs, problem = _recorded_layouts(node, default, reached)
        if problem is not None:
            findings.append(problem)
            continue
        site = runtime.PerSampleSite(node.name, str(target), rule, loss_reduction, ins, outs, fn, what, sink, guard)
        guard.sites.append(site)
        site_attr = f"fxdp_site_{node.name}"
        setattr(gm, site_attr, site)
        with graph.inserting_before(node):
            head = (graph.get_attr(node.target),) if fn is None else ()
            site_node = _get_attr(graph, site_attr)
        # the node itself becomes the DP-aware op: it keeps its name, users and meta
        node.op, node.target = "call_function", call
        node.args = (*head, site_node, n, *node.args)
        node.meta[meta.PER_SAMPLE_RULE] = rule
        changes.append(_site_change(node, site, call.__name__))

    findings += _uncovered_parameters(gm)
    guard.frozen = _frozen_uses(gm)
    graph.lint()
    gm.recompile()
    return PassResult(gm, PassReport(PASS_NAME, tuple(changes), tuple(findings)))


def _derived_inputs(gm, node, reached) -> List[torch.fx.Node]:
    """Inputs of ``node`` computed from trainable parameters alone (``F.normalize(self.weight)``, a
    bias table indexed by a constant buffer), before they meet per-sample data in ``node``."""
    return [a for a in node.all_input_nodes
            if a not in reached and a.op in ("call_function", "call_method") and _trainable_ancestor(gm, a)]


def _trainable_ancestor(gm, node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        param = _parameter(gm, n)
        if param is not None and param.requires_grad:
            return True
        todo.extend(n.all_input_nodes)
    return False


def _fold_parameter_prefix(gm, node, reached, folded: Dict[str, List[str]],
                           all_inner: List[torch.fx.Node]) -> torch.fx.GraphModule:
    """Make ``node`` one call of a small graph holding it and the ops on parameters that feed it, so
    its site differentiates the parameters themselves (the chain rule through those ops is then the
    generic rule's vjp). ``node``'s arguments become that graph's inputs: the per-sample values and
    the parameters and buffers the folded ops read."""
    inner: List[torch.fx.Node] = []  # the ops on parameters, in graph order
    inputs: List[torch.fx.Node] = []
    todo = list(node.all_input_nodes)
    while todo:
        a = todo.pop()
        if a in inner or a in inputs:
            continue
        if a not in reached and a.op in ("call_function", "call_method"):
            inner.append(a)
            todo.extend(a.all_input_nodes)
        else:
            inputs.append(a)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    inner.sort(key=order.__getitem__)
    inputs.sort(key=order.__getitem__)
    sub = torch.fx.Graph()
    env = {a: sub.placeholder(f"in_{i}") for i, a in enumerate(inputs)}
    for n in inner + [node]:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(env[node])
    folded[node.name] = [a.name for a in inputs]
    all_inner.extend(inner)
    node.args, node.kwargs = tuple(inputs), {}
    return torch.fx.GraphModule(gm, sub, f"fold_{node.name}")


def _erase_unused(graph: torch.fx.Graph, folded: List[torch.fx.Node]) -> None:
    """Ops on parameters whose only consumers were folded into sites compute nothing any more."""
    folded_set = set(folded)
    for node in reversed(list(graph.nodes)):
        if node in folded_set and not node.users and not node.is_impure():
            graph.erase_node(node)


def _site_change(node, site: runtime.PerSampleSite, op: str, ins=None, outs=None) -> Finding:
    """The per_sample change of ``site`` at ``node``, with the layouts ``ins`` and ``outs`` (the site's own if not
    given)."""
    ins, outs = site.layouts if ins is None else ins, site.out_layouts if outs is None else outs
    return Finding(
        PASS_NAME, node.name, op, Kind.REWRITE, Severity.INFO,
        f"{site.description}: per-sample gradients by the {site.rule} rule; input {', '.join(map(str, ins)) or '-'}, "
        f"output {', '.join(map(str, outs))}", "", source_location(node))


_DP_OPS = (runtime.dp_aware_layer, runtime.dp_aware_function)


def _uncovered_parameters(gm: torch.fx.GraphModule) -> List[Finding]:
    """Every use of a trainable parameter must be a DP-aware op, or its per-sample gradient is lost."""
    problems = []
    for node in gm.graph.nodes:
        param = _parameter(gm, node)
        if param is None or not param.requires_grad:
            continue
        for user in node.users:
            if user.target not in _DP_OPS:
                problems.append(_finding(
                    user, f"parameter '{node.target}' reaches the loss through '{user.name}' ({user.target}), "
                    "which records no per-sample gradient", _WHOLE_MODEL,
                    severity=Severity.WARNING))
                break
    return problems


def _frozen_uses(gm: torch.fx.GraphModule) -> List[runtime.FrozenUse]:
    """Frozen parameters used by an op that is no DP-aware op (``self.w.t()``): were one unfrozen, its
    per-sample gradient would be lost, so the batch guard refuses the next forward (it names the use)."""
    uses = []
    for node in gm.graph.nodes:
        param = _parameter(gm, node)
        if param is None or param.requires_grad:
            continue
        user = next((u for u in node.users if u.target not in _DP_OPS), None)
        if user is not None:
            loc = source_location(user)
            where = f"{loc}" + (f": {loc.code}" if loc and loc.code else "") if loc else ""
            uses.append(runtime.FrozenUse(str(node.target), param, user.name, where))
    return uses


def _get_attr(graph: torch.fx.Graph, name: str) -> torch.fx.Node:
    # sites are plain Python objects on the GraphModule, not modules or tensors; FX warns about that
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return graph.get_attr(name)


def site_layouts(analysed: torch.fx.GraphModule, guard: runtime.BatchGuard,
                 batch_dim: int) -> Tuple[List[Finding], Optional[runtime.AnalysedLayouts], List[Finding]]:
    """The layouts the batch_dim pass found on ``analysed`` (a compiled graph before the per_sample pass) for the
    sites of that graph (``guard.sites``), and its batched input. Used by the re-analysis when the inputs have
    shapes not analysed yet (the first batch without example inputs). Returns (problems, the layouts, the
    per_sample changes with them); with problems, no layouts."""
    by_name = {node.name: node for node in analysed.graph.nodes}
    reached = _inputs_reach(analysed.graph)
    default = BatchLayout.at(batch_dim)
    problems, found = [], []
    for site in guard.sites:
        inputs = guard.folded.get(site.node)
        inputs = None if inputs is None else [by_name[name] for name in inputs]
        ins, outs, problem = _recorded_layouts(by_name[site.node], default, reached, inputs)
        if problem is not None:
            problems.append(problem)
        found.append((ins, outs))
    if problems:
        return problems, None, []
    placeholders = [n for n in analysed.graph.nodes if n.op == "placeholder"]
    changes = [_site_change(by_name[site.node], site, "dp_aware_layer" if site.fn is None else "dp_aware_function",
                            ins, outs) for site, (ins, outs) in zip(guard.sites, found)]
    return [], runtime.AnalysedLayouts(*meta.batch_source(placeholders, batch_dim), tuple(found)), changes


_WHOLE = BatchLayout.merged(0, 1)  # with N = 1: the whole tensor is the one sample's row


def one_sample_layouts(guard: runtime.BatchGuard, input_index: int, dim: int) -> runtime.AnalysedLayouts:
    """Layouts for a batch of one sample when the analysis cannot place the batch: every tensor that
    is (or may be) per-sample is read whole as that sample's (shared inputs stay shared)."""
    def whole(layout: BatchLayout) -> BatchLayout:
        return layout if layout.kind in (BROADCAST, UNBATCHED) else _WHOLE

    return runtime.AnalysedLayouts(input_index, dim, tuple(
        ([whole(lay) for lay in site.layouts], [_WHOLE for _ in site.out_layouts]) for site in guard.sites))
