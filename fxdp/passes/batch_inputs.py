"""Which model inputs carry the batch: the input binding of the batch_dim pass.

The user says where the batch sits in a batched input (``batch_dim``); which inputs are batched is
found, not assumed. An input is *batched* when it holds one row per sample at ``batch_dim``;
every other input is *shared* by all samples (a ``(T, T)`` mask, a ``(1, T)`` position input, which
is broadcast). Shared data is never "the batch" and never a reason to report mixing.

Without ``batch_inputs=`` fxdp decides from all inputs (positional and keyword) and the graph:

1. each distinct size at ``batch_dim`` among the tensor inputs is a candidate batch size N (1 only
   when no larger size fits: against a larger size, a size of 1 is broadcasting); the hypothesis
   for N makes every input with that size batched;
2. a hypothesis is *consistent* when the analysis finds no op mixing samples and the model's
   output carries the batch where its inputs do (dimension ``batch_dim``) — the loss is then a sum
   over samples; it is *not* when an op mixes samples or the output has no batch or has it elsewhere;
3. one consistent hypothesis: taken. Several: an error asks the user to name the batched inputs with
   ``batch_inputs=``. None: N is the first tensor input's size, every input of that size batched (or the
   first reading where the analysis lost the batch rather than contradicted it), and the analysis reports
   what is wrong -- unless the model would hold together with some inputs of size N read as shared
   (tried in smaller groups, :func:`_smaller_groups`): then fxdp refuses, naming the inputs, their shapes
   and the op that mixes samples, and asks for ``batch_inputs=``.

**An input with the batch's number of rows is never read as shared unless the user names the batched
inputs.** Read as batched, an input is checked to be read row by row (at worst a refusal); read as
shared, an input that holds one row per sample gives wrong per-sample gradients with no error (a
two-tower model returning ``(u @ v.T, u, v)`` holds together with its text input read as shared). A
``(T, T)`` mask with T == N by coincidence is refused the same way: its shape cannot show it is shared.

A model with a single batched-looking input costs one analysis, as before.

*Packed* inputs (:func:`packed_inputs`) hold the samples' entries one after another, grouped by another
input: the flat indices of ``nn.EmbeddingBag(input, offsets)``, the classic text classifier's ``(ids,
offsets)``. Their length is no batch size; the offsets (one per sample) carry the batch.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any, Callable, FrozenSet, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx

from fxdp.diagnostics import BatchDimAnalysisError
from fxdp.layout import UNBATCHED_LAYOUT, UNKNOWN, BatchLayout
from fxdp.passes.batch_rules import tensor_pairs

Hypothesis = Tuple[int, FrozenSet[int]]  # (batch size N, positions of the batched inputs)

_MAX_GROUP = 4  # inputs of one size tried in smaller groups: at most 2**4 analyses

def _bind_inputs(placeholders: List[torch.fx.Node], example_inputs) -> List[Any]:
    """One value per placeholder, from a tensor, a tuple/list of positional inputs, or a dict by name."""
    if isinstance(example_inputs, dict):
        values = []
        known = set()
        for p in placeholders:
            name = str(p.target).lstrip("*")
            known.update((name, p.name))
            if name in example_inputs:
                values.append(example_inputs[name])
            elif p.name in example_inputs:
                values.append(example_inputs[p.name])
            elif p.args:  # a parameter with a default value
                values.append(p.args[0])
            else:
                raise BatchDimAnalysisError(
                    f"fxdp batch_dim: example_inputs has no value for the model input '{name}'; "
                    f"give one for each of {[str(q.target) for q in placeholders]}.")
        extra = sorted(set(example_inputs) - known)
        if extra:
            raise BatchDimAnalysisError(
                f"fxdp batch_dim: example_inputs names {extra}, which forward() does not take; "
                f"its inputs are {[str(q.target) for q in placeholders]}.")
        return values
    values = list(example_inputs) if isinstance(example_inputs, (tuple, list)) else [example_inputs]
    if len(values) > len(placeholders):
        raise BatchDimAnalysisError(
            f"fxdp batch_dim: {len(values)} example inputs for a forward() that takes "
            f"{len(placeholders)} ({[str(p.target) for p in placeholders]}).")
    for p in placeholders[len(values):]:
        if not p.args:
            raise BatchDimAnalysisError(
                f"fxdp batch_dim: example_inputs has no value for the model input '{p.target}'.")
        values.append(p.args[0])
    return values


def packed_inputs(gm: torch.fx.GraphModule, placeholders: List[torch.fx.Node], values: List[Any]) -> FrozenSet[int]:
    """Positions of the 1-D inputs that an ``nn.EmbeddingBag`` called with offsets takes as its indices or
    per-sample weights: they are packed (:data:`fxdp.layout.PACKED`), the offsets say whose entry is whose."""
    grouped_by = {}  # input position -> the offsets nodes its bag layers group it by
    position = {p: i for i, p in enumerate(placeholders)}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), torch.nn.EmbeddingBag):
            continue
        call = dict(zip(("input", "offsets", "per_sample_weights"), node.args), **node.kwargs)
        if not isinstance(call.get("offsets"), torch.fx.Node):
            continue
        for key in ("input", "per_sample_weights"):
            i = position.get(call.get(key))
            if i is not None and isinstance(values[i], torch.Tensor) and values[i].dim() == 1:
                grouped_by.setdefault(i, set()).add(call["offsets"])
    # grouped two ways, whose entries a sample owns would depend on the layer: no reading is the packed one
    return frozenset(i for i, offsets in grouped_by.items() if len(offsets) == 1)


def _first_tensor(values) -> Optional[torch.Tensor]:
    for v in values:
        for t, _ in tensor_pairs(v, None):
            return t
    return None


def _input_layout(value, batch_dim: int, n: int):
    """Batched if the size at batch_dim is N, broadcast if it is 1, unbatched otherwise."""
    if isinstance(value, torch.Tensor):
        if value.dim() > batch_dim and value.shape[batch_dim] == n:
            return BatchLayout.at(batch_dim)
        if value.dim() > batch_dim and value.shape[batch_dim] == 1:
            return BatchLayout.broadcast(batch_dim)
        return UNBATCHED_LAYOUT
    if isinstance(value, (list, tuple)):
        return tuple(_input_layout(v, batch_dim, n) for v in value)
    if isinstance(value, dict):
        return {k: _input_layout(v, batch_dim, n) for k, v in value.items()}
    return None


def _shared_layout(value, batch_dim: int):
    """An input shared by all samples: broadcast where its size at batch_dim is 1, else unbatched."""
    if isinstance(value, torch.Tensor):
        if value.dim() > batch_dim and value.shape[batch_dim] == 1:
            return BatchLayout.broadcast(batch_dim)
        return UNBATCHED_LAYOUT
    if isinstance(value, (list, tuple)):
        return tuple(_shared_layout(v, batch_dim) for v in value)
    if isinstance(value, dict):
        return {k: _shared_layout(v, batch_dim) for k, v in value.items()}
    return None


def input_name(placeholder: torch.fx.Node) -> str:
    return str(placeholder.target).lstrip("*")


def _sizes(value, batch_dim: int) -> List[int]:
    return [t.shape[batch_dim] for t, _ in tensor_pairs(value, None) if t.dim() > batch_dim]


def _holders(values, n: int, batch_dim: int) -> FrozenSet[int]:
    return frozenset(i for i, v in enumerate(values) if n in _sizes(v, batch_dim))


def named_batch_inputs(placeholders, values, batch_inputs: Sequence[Union[str, int]], batch_dim: int) -> Hypothesis:
    """The hypothesis the user gave: ``batch_inputs`` names (or positions) of the batched inputs."""
    if isinstance(batch_inputs, (str, int)):
        batch_inputs = (batch_inputs,)
    names = [input_name(p) for p in placeholders]
    chosen = set()
    for entry in batch_inputs:
        if isinstance(entry, int) and 0 <= entry < len(names):
            chosen.add(entry)
        elif entry in names:
            chosen.add(names.index(entry))
        else:
            raise BatchDimAnalysisError(
                f"fxdp batch_dim: batch_inputs names {entry!r}, which is not an input of forward(); "
                f"its inputs are {names}.")
    sizes = {i: _sizes(values[i], batch_dim) for i in sorted(chosen)}
    for i, s in sizes.items():
        if not s:
            raise BatchDimAnalysisError(
                f"fxdp batch_dim: batch_inputs names '{names[i]}', but it holds no tensor with a dimension "
                f"{batch_dim} (batch_dim); name the inputs that hold one row per sample there.")
    distinct = sorted({x for s in sizes.values() for x in s if x != 1}) or [1]
    if len(distinct) > 1:
        listing = ", ".join(f"'{names[i]}' {s}" for i, s in sizes.items())
        raise BatchDimAnalysisError(
            f"fxdp batch_dim: the inputs named in batch_inputs disagree on the batch size at dimension "
            f"{batch_dim} ({listing}); every batched input holds one row per sample.")
    return distinct[0], frozenset(chosen)


YES, MAYBE, NO = "yes", "maybe", "no"  # is a hypothesis consistent? (maybe: the analysis lost the batch)


def _shapes(placeholders, values, positions) -> str:
    names = [input_name(p) for p in placeholders]
    return ", ".join(f"'{names[i]}' {_shape_of(values[i])}" for i in positions)


def _shape_of(value) -> str:
    tensors = [tuple(t.shape) for t, _ in tensor_pairs(value, None)]
    return str(tensors[0]) if len(tensors) == 1 else str(tensors)


def _name_them(names: List[str], group) -> str:
    listed = [repr(names[i]) for i in sorted(group)]
    return f"batch_inputs=({listed[0]},)" if len(listed) == 1 else f"batch_inputs=({', '.join(listed)})"


def choose_batch_inputs(placeholders, values, batch_dim: int, verdict: Callable[[Hypothesis], str],
                        explain: Callable[[Hypothesis], str] = lambda h: "") -> Hypothesis:
    """Decide which inputs carry the batch (see the module docstring); ``verdict(hypothesis)`` runs the
    analysis under a hypothesis and says whether it holds together (YES, MAYBE or NO); ``explain(hypothesis)``
    says why one that was analysed does not (the op that mixes samples and its line), for the refusal."""
    first = _first_tensor(values)
    default = (first.shape[batch_dim], _holders(values, first.shape[batch_dim], batch_dim))
    sizes = list(dict.fromkeys(s for v in values for s in _sizes(v, batch_dim)))
    if len(sizes) == 1 and len(default[1]) == 1:
        return default  # one way to read the inputs: the analysis itself reports what is wrong
    verdicts = {}

    def consistent(h: Hypothesis) -> bool:
        verdicts[h] = verdict(h)
        return verdicts[h] == YES

    found: List[Hypothesis] = []
    tried: List[Hypothesis] = []
    # a size of 1 against a larger one is broadcasting: a batch of one is tried only when no larger fits
    for candidates in ([s for s in sizes if s != 1], [1] if 1 in sizes else []):
        full = [(n, _holders(values, n, batch_dim)) for n in candidates]
        tried += full
        found = [h for h in full if consistent(h)]
        if found:
            break
    names = [input_name(p) for p in placeholders]
    if len(found) > 1:
        readings = "; ".join(f"{', '.join(repr(names[i]) for i in sorted(group))} as the batch (N={n})"
                             for n, group in found)
        raise BatchDimAnalysisError(
            f"fxdp batch_dim: cannot tell which inputs carry the batch; the model is consistent with {readings} "
            f"(its inputs: {_shapes(placeholders, values, range(len(values)))}). Name the inputs that hold one row "
            f"per sample, e.g. compile_for_dp(model, example_inputs, {_name_them(names, found[0][1])}) (or "
            "make_private(..., batch_inputs=...)); the other inputs are then shared by all samples.")
    if found:
        return found[0]
    # no reading holds together: the first that does not contradict itself (the analysis lost the batch), else
    # the first tensor's; the analysis then reports what is wrong, unless the model holds together only with
    # some inputs of the batch's size read as shared by all samples: that is never assumed, the user says
    chosen = next((h for h, v in verdicts.items() if v == MAYBE), default)
    if verdicts.get(chosen) == MAYBE:
        return chosen
    for n, group in tried:  # (a batch of one too: the engine a reading chooses keeps it for later batches)
        for reading in _smaller_groups(n, group, consistent):
            _refuse_shared_rows(placeholders, values, batch_dim, (n, group), reading, explain((n, group)))
    return chosen


def _refuse_shared_rows(placeholders, values, batch_dim: int, whole: Hypothesis, smaller: Hypothesis,
                        why: str) -> None:
    """The model holds together only with inputs that have the batch's number of rows read as shared: refuse."""
    names = [input_name(p) for p in placeholders]
    (n, group), shared = whole, sorted(whole[1] - smaller[1])
    listed = ", ".join(repr(names[i]) for i in shared)
    raise BatchDimAnalysisError(
        f"fxdp batch_dim: cannot tell which inputs carry the batch. The inputs "
        f"{_shapes(placeholders, values, sorted(group))} {'both' if len(group) == 2 else 'all'} have {n} "
        f"row{'s' if n != 1 else ''} at dimension {batch_dim} (batch_dim). "
        f"Read as the batch, {why or 'they do not hold together'}; the model holds together only with {listed} "
        f"read as shared by all samples (the same for every sample), which fxdp never assumes of an input with "
        f"the batch's number of rows: if {listed} held one row per sample, that reading would give wrong "
        "per-sample gradients. Name the inputs that hold one row per sample: compile_for_dp(model, example_inputs, "
        f"{_name_them(names, group)}) (make_private(..., batch_inputs=...)), and fxdp reports what mixes "
        f"samples; or {_name_them(names, smaller[1])} if {listed} really "
        f"{'is' if len(shared) == 1 else 'are'} the same for every sample (or analyse with a batch whose size "
        f"differs from the rows of {listed}).")


def _smaller_groups(n: int, group: FrozenSet[int], consistent) -> List[Hypothesis]:
    """The largest proper subsets of ``group`` that are consistent as the batched inputs."""
    if not 2 <= len(group) <= _MAX_GROUP:
        return []
    for k in range(len(group) - 1, 0, -1):
        hits = [(n, frozenset(c)) for c in combinations(sorted(group), k) if consistent((n, frozenset(c)))]
        if hits:
            return hits
    return []


def output_verdict(layout, batch_dim: int) -> str:
    """YES when the first per-sample tensor of the model's output has the batch at ``batch_dim``, MAYBE
    when the analysis lost track of it (unknown), NO otherwise (elsewhere, or no per-sample output)."""
    for lay in _leaves(layout):
        if isinstance(lay, BatchLayout) and lay.kind == UNKNOWN:
            return MAYBE
        if isinstance(lay, BatchLayout) and lay.is_batched:
            return YES if lay == BatchLayout.at(batch_dim) else NO
    return NO


def _leaves(layout) -> List[Any]:
    if isinstance(layout, (tuple, list)):
        return [x for item in layout for x in _leaves(item)]
    if isinstance(layout, dict):
        return [x for item in layout.values() for x in _leaves(item)]
    return [layout]
