"""The loss pass: what the user's loss does with the model's output, judged by the batch rules.

DP-SGD bounds one sample's influence only when sample i's gradient depends on sample i alone, and the loss,
written between the model's output and ``backward()``, decides that as much as the model does. The loss reaches
this pass as a graph whose inputs are the model's outputs (with the layouts the batch_dim pass found for them)
and the other tensors the loss reads (labels, masks, class weights): traced from the criterion
(:func:`trace_criterion`), or recorded from the user's own code on the first step
(:mod:`fxdp.runtime.loss_probe`). The batch_dim pass's interpreter runs it with the same rules as the model, and
this pass reads its findings as a loss must be read:

- a **sum or mean over the batch** (``loss.mean()``, a loss function with ``reduction="mean"``, ``"sum"`` or
  ``"batchmean"``) is how per-sample losses become the batch's loss: not a finding. Its result is a *total*;
  adding totals, scaling one by a constant, viewing or converting it keeps it one;
- an op that **mixes samples** (``z @ z.T``, a softmax over the batch, ``x - x.mean(0)``), a total combined with
  each sample's values, or a total put through anything but a linear map (``total ** 2``): one sample then moves
  every other sample's gradient, and the clipped sum's sensitivity is no longer C. An error
  (:class:`~fxdp.errors.SampleMixingError`);
- a **normaliser set by the batch**: the loss (or each sample's loss) divided or multiplied by a statistic of the
  batch's data that carries no gradient (``loss.sum() / mask.sum()``, ``F.cross_entropy(..., weight=w)`` with
  ``reduction="mean"``, which divides by the batch's sum of ``w[y]``, or a mean over the targets of several
  tokens per sample, which divides by the number of targets not ``ignore_index`` in the whole batch). Removing
  one sample rescales every other contribution. A warning, with the fix (:func:`fxdp.per_sample_mean`);
- ops with no batch rule: unverified, a warning, as in the model.

Moves of the batch (``logits.view(-1, V)``) are not findings here: no layer with parameters follows them.
"""

from __future__ import annotations

import inspect
from typing import Any, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
from torch import nn

from fxdp import meta
from fxdp.diagnostics import Finding, Kind, PassReport, Severity
from fxdp.frontends.fx import source_location
from fxdp.layout import UNBATCHED_LAYOUT, BatchLayout
from fxdp.passes.batch_dim import interpret
from fxdp.passes.batch_rules import carries_batch, is_inplace, stores_item, tensor_pairs

PASS_NAME = "loss"

#: Reductions that make the batch's loss out of per-sample losses when they run over the batch.
_BATCH_SUMS = {"sum", "mean", "nansum", "nanmean"}
#: Loss functions: with a reduction other than "none" over per-sample values, a sum or mean over the batch.
_LOSSES = set(
    "cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy "
    "binary_cross_entropy_with_logits kl_div poisson_nll_loss gaussian_nll_loss soft_margin_loss "
    "margin_ranking_loss hinge_embedding_loss cosine_embedding_loss triplet_margin_loss "
    "triplet_margin_with_distance_loss multilabel_margin_loss multilabel_soft_margin_loss multi_margin_loss "
    "ctc_loss cross_entropy_loss nll_loss_nd nll_loss2d".split())
#: Of those, the ones whose mean divides by a count the batch's targets set (class weights, ignore_index).
_COUNTING_LOSSES = {"cross_entropy", "nll_loss", "cross_entropy_loss", "nll_loss_nd", "nll_loss2d"}
#: Ops that scale one operand by another.
_SCALES = {"mul", "truediv", "div", "true_divide", "multiply", "divide", "floordiv", "mul_", "div_"}
#: Linear ops: applied to totals (and constants), their result is a total again.
_LINEAR = {"add", "sub", "subtract", "neg", "negative", "pos", "sum", "mean", "nansum", "nanmean", "view",
           "reshape", "squeeze", "unsqueeze", "flatten", "to", "float", "double", "half", "bfloat16", "type",
           "type_as", "clone", "contiguous", "stack", "cat", "concat", "concatenate", "add_", "sub_", "view_as",
           "reshape_as", "expand", "expand_as", "detach", "getitem", "squeeze_", "unsqueeze_"}

_FIX_MIXING = ("Compute each sample's loss from its own output only, then sum or average over the batch. "
               "For contrastive learning, contrast each sample only with its own augmented views, or with "
               "negatives that are public or fixed (a bank drawn from public data), never with the other samples "
               "of the batch. Batch statistics cannot be private: use each sample's own.")
_FIX_NORMALISER = ("Give each sample's loss its own normaliser, then take the mean over the batch: "
                   "fxdp.per_sample_mean(per_element_losses, weights) (each sample's weighted mean over its own "
                   "elements, e.g. weights=(labels != -100) for tokens, then the mean over the batch); or use "
                   "reduction='sum' divided by a constant (the expected batch size).")


def loss_name(node: torch.fx.Node) -> str:
    """The op a node of a loss graph runs, as one word: ``"sum"``, ``"truediv"``, ``"cross_entropy"`` (a loss graph
    calls no module: the recording sees functions, and the criterion's tracer traces into every module)."""
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    if hasattr(target, "_opname"):  # an ATen op
        name = target._opname
    return name


def _reduction(node: torch.fx.Node, fn) -> Optional[str]:
    """The reduction a call of a loss function asks for (its default where the call does not say)."""
    try:
        bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return node.kwargs.get("reduction", "mean")
    bound.apply_defaults()
    return bound.arguments.get("reduction", "mean")


def _argument(node: torch.fx.Node, fn, name: str, position: int):
    try:
        return inspect.signature(fn).bind(*node.args, **node.kwargs).arguments.get(name)
    except (TypeError, ValueError):
        return node.args[position] if len(node.args) > position else node.kwargs.get(name)


class _Judge:
    """Reads the interpreter's findings and layouts as a loss's (see the module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, interpreter, outputs: Set[torch.fx.Node], n: int,
                 guessed: Set[torch.fx.Node] = frozenset()):
        self.gm, self.layouts, self.n = gm, interpreter.layouts, n
        self.guessed = {p: set([p]) for p in guessed}  # a tensor read as batched from its shape -> what reads it
        self.raw = {}
        for r in interpreter.raw:
            self.raw.setdefault(r.node, r)
        self.grad = set(outputs)  # nodes computed from the model's output (they carry its gradient)
        self.totals: Set[torch.fx.Node] = set()  # values summed over the batch
        self.findings: List[Finding] = []
        self.mixed: Set[torch.fx.Node] = set()  # reported as mixing samples

    def run(self) -> List[Finding]:
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            inputs = node.all_input_nodes
            if any(a in self.grad for a in inputs):
                self.grad.add(node)
            for derived in self.guessed.values():
                if any(a in derived for a in inputs):
                    derived.add(node)
            self._judge(node, inputs)
        return self.findings

    def _per_sample(self, a: torch.fx.Node) -> bool:
        return any(carries_batch(lay) for _, lay in tensor_pairs(a.meta.get(meta.FAKE_VALUE),
                                                                   self.layouts.get(a)))

    def _judge(self, node: torch.fx.Node, inputs: List[torch.fx.Node]) -> None:
        name = loss_name(node)
        raw = self.raw.get(node)
        if any(a in self.mixed for a in inputs):
            self.mixed.add(node)
            return
        totals = [a for a in inputs if a in self.totals]
        if raw is not None and raw.kind is Kind.MIXES_SAMPLES and not totals:
            if name in _BATCH_SUMS or name in _LOSSES:  # the batch's loss made out of per-sample ones
                self.totals.add(node)
                if name in _COUNTING_LOSSES:
                    self._counting_loss(node)
                return
            self._add(node, Kind.MIXES_SAMPLES, Severity.ERROR, f"{raw.message}: in the loss, one sample then moves "
                      "every other sample's gradient, so clipping each sample's gradient to C no longer bounds its "
                      "influence", _FIX_MIXING)
            return
        if raw is not None and raw.kind is Kind.UNVERIFIED:
            self._add(node, Kind.UNVERIFIED, Severity.WARNING, raw.message, raw.fix)
        if not totals:
            return
        self.totals.add(node)  # computed from a total: one too, unless a finding below says otherwise
        carrying = [a for a in totals if a in self.grad]
        statistics = [a for a in totals if a not in self.grad]  # of the batch's data: counts, label means
        per_sample = [a for a in inputs if a not in self.totals and self._per_sample(a)]
        if not carrying and not (per_sample and any(a in self.grad for a in per_sample)):
            return  # arithmetic on the batch's data alone (a count clamped, a mean of labels)
        if name in _SCALES and statistics and not (len(carrying) > 1 or (carrying and per_sample)):
            if not carrying:
                self.totals.discard(node)  # each sample's value rescaled: still one per sample
            what = "the loss" if carrying else "each sample's loss"
            self._add(node, Kind.NORMALISER, Severity.WARNING,
                      f"{name} scales {what} by a quantity computed from the whole batch's data (it carries no "
                      "gradient: a count or a sum of weights): removing one sample rescales every other sample's "
                      "contribution, so the clipped sum's sensitivity is more than C", _FIX_NORMALISER)
            return
        if per_sample:
            what = "a sum over the batch" if carrying else "a statistic of the batch's data"
            self._add(node, Kind.MIXES_SAMPLES, Severity.ERROR,
                      f"{name} combines {what} with each sample's own values: one sample then moves every other "
                      "sample's gradient (a loss normalised by batch statistics)", _FIX_MIXING)
        elif name in _SCALES and len(carrying) > 1:
            self._add(node, Kind.MIXES_SAMPLES, Severity.ERROR,
                      f"{name} multiplies or divides two sums over the batch: the loss is no sum of per-sample "
                      "losses, so one sample moves every other sample's gradient", _FIX_MIXING)
        elif name not in _LINEAR and name not in _SCALES:
            self._add(node, Kind.MIXES_SAMPLES, Severity.ERROR,
                      f"{name} is applied to a sum over the batch: the loss is no sum of per-sample losses, so one "
                      "sample moves every other sample's gradient", _FIX_MIXING)

    def _counting_loss(self, node: torch.fx.Node) -> None:
        """A cross-entropy or NLL mean that divides by a count (or a weight) the whole batch's targets set."""
        fn = node.target
        if _reduction(node, fn) != "mean":
            return
        weight = _argument(node, fn, "weight", 2)
        target = _argument(node, fn, "target", 1)
        target_value = target.meta.get(meta.FAKE_VALUE) if isinstance(target, torch.fx.Node) else None
        several = (isinstance(target_value, torch.Tensor) and not target_value.is_floating_point()
                   and target_value.numel() > self.n)
        if weight is None and not several:
            return
        if weight is not None:
            why = ("with class weights and reduction='mean', it divides by the batch's sum of weight[target], "
                   "which every sample's label sets")
            fix = ("keep the class weights as each sample's own factor: reduction='none', then .mean() over the "
                   "batch (or .sum() divided by the expected batch size); or fxdp.per_sample_mean(...)")
        else:
            why = (f"with reduction='mean' over {target_value.numel()} targets of {self.n} samples, it divides by the "
                   "number of targets that are not ignore_index in the whole batch, which the other samples' lengths "
                   "and padding set")
            fix = ("average each sample's own targets: fxdp.per_sample_mean(F.cross_entropy(logits.flatten(0, -2), "
                   "labels.flatten(), reduction='none').view(labels.shape), weights=labels != -100)")
        self._add(node, Kind.NORMALISER, Severity.WARNING,
                  f"{loss_name(node)}: {why}: removing one sample rescales every other sample's contribution, so the "
                  "clipped sum's sensitivity is more than C", fix)

    def _add(self, node, kind, severity, message, fix) -> None:
        if kind is Kind.MIXES_SAMPLES:  # reported here: what is computed from it is not reported again
            self.totals.discard(node)
            self.mixed.add(node)
            for p, derived in self.guessed.items():
                if node in derived:
                    value = p.meta.get(meta.FAKE_VALUE)
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else "?"
                    message += (f" (a tensor of shape {shape} the loss reads was taken as one row per sample, since "
                                f"it has the batch's {self.n} rows)")
                    fix = (f"If that tensor of shape {shape} is the same for every sample, mark it: "
                           f"fxdp.shared(tensor). Otherwise: {fix}")
        self.findings.append(Finding(PASS_NAME, node.name, loss_name(node), kind, severity, message, fix,
                                     source_location(node)))


def input_layout(value: Any, n: int, batch_dim: int) -> Any:
    """The layout of a tensor the loss reads besides the model's output (labels, masks, weights): batched where
    it has ``n`` rows at ``batch_dim`` (or at 0), broadcast where it has one, shared by all samples otherwise."""
    if isinstance(value, torch.Tensor):
        for dim in dict.fromkeys((batch_dim, 0)):
            if value.dim() > dim and value.shape[dim] == n:
                return BatchLayout.at(dim)
        if value.dim() > batch_dim and value.shape[batch_dim] == 1 and n != 1:
            return BatchLayout.broadcast(batch_dim)
        return UNBATCHED_LAYOUT
    if isinstance(value, (list, tuple)):
        return tuple(input_layout(v, n, batch_dim) for v in value)
    return None


def analyse_loss(gm: torch.fx.GraphModule, values: Sequence[Any], layouts: Sequence[Any], outputs: Sequence[int],
                 n: int, batch_dim: int = 0, guessed: Sequence[int] = ()) -> PassReport:
    """Judge the loss graph ``gm`` (see the module docstring) on ``values`` (one per placeholder: the tensors the
    loss computed with; run on fake copies, or on these values where an op's shapes depend on the data);
    ``layouts``: their layouts (None: found from the shape with :func:`input_layout`); ``outputs``: the positions
    of the placeholders that are the model's outputs; ``n``: the batch size; ``guessed``: the positions of tensors
    whose layout was read from their shape alone (a finding they take part in says how to mark them shared)."""
    placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
    input_layouts = {p: lay if lay is not None else input_layout(v, n, batch_dim)
                     for p, v, lay in zip(placeholders, values, layouts)}
    try:
        interpreter = interpret(gm, values, input_layouts, n, BatchLayout.at(batch_dim))
        if interpreter.data_dependent:  # CTC, boolean masks: on the values (an input written in place: a copy)
            written = {a for node in gm.graph.nodes if is_inplace(node) or stores_item(node) for a in node.args[:1]}
            values = [v.clone() if p in written and isinstance(v, torch.Tensor) else v
                      for p, v in zip(placeholders, values)]
            interpreter = interpret(gm, values, input_layouts, n, BatchLayout.at(batch_dim), real=True)
        findings = _Judge(gm, interpreter, {placeholders[i] for i in outputs}, n,
                          {placeholders[i] for i in guessed if carries_batch(input_layouts[placeholders[i]])}).run()
    except Exception as exc:  # noqa: BLE001 - a loss fxdp cannot follow is reported, never a crash of backward()
        findings = [Finding(PASS_NAME, "<loss>", "loss", Kind.UNVERIFIED, Severity.WARNING,
                            f"fxdp could not analyse the loss ({type(exc).__name__}: {str(exc).strip()[:200]})",
                            "check by hand that each sample's loss reads only its own output; report this at fxdp")]
    return PassReport(PASS_NAME, (), tuple(findings))


class _ThroughLosses(torch.fx.Tracer):
    """Traces into torch's loss modules (a leaf for the model's tracer): the functional call inside says how the
    loss reduces, with its weights and ignore_index as the module holds them."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


class _Criterion(nn.Module):
    """The criterion as a module the tracer can own (its weights become the graph's attributes)."""

    def __init__(self, criterion):
        super().__init__()
        self.criterion = criterion


class _Call1(_Criterion):
    def forward(self, output):
        return self.criterion(output)


class _Call2(_Criterion):
    def forward(self, output, target):
        return self.criterion(output, target)


class _Call3(_Criterion):
    def forward(self, output, a, b):
        return self.criterion(output, a, b)


class _Call4(_Criterion):
    def forward(self, output, a, b, c):
        return self.criterion(output, a, b, c)


_CALLS = {1: _Call1, 2: _Call2, 3: _Call3, 4: _Call4}  # the criterion called with 1 to 4 tensors, output first


def trace_criterion(criterion, count: int) -> Tuple[Optional[torch.fx.GraphModule], str]:
    """``criterion`` (an ``nn.Module`` or a function) called with ``count`` tensors, the model's output first, as
    a graph; ``(None, why)`` where torch.fx cannot trace it."""
    if count not in _CALLS:
        return None, f"it takes {count} inputs (fxdp traces criteria of 1 to 4)"
    tracer, root = _ThroughLosses(), _CALLS[count](criterion)
    tracer.record_stack_traces = True  # each finding names the criterion's line
    try:
        graph = tracer.trace(root)
    except Exception as exc:  # noqa: BLE001 - anything torch.fx refuses: the run-time path judges the loss
        return None, f"torch.fx cannot trace it ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})"
    return torch.fx.GraphModule(root, graph), ""
