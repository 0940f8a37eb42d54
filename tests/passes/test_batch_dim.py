"""The batch_dim pass: where the batch is at every node, which ops move it, which mix samples.

The catalogue (tests/batch_models.py) drives most tests: every mixing op is found at its marked
line, no benign model is flagged, every batch move is found at its line with the right recorded
layout. Recorded layouts are checked against real computation: changing one sample's input may only
change that sample's slice of every per-sample value (located with the recorded layout).
"""

from __future__ import annotations

import operator
from typing import Dict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import fxdp
from batch_models import CATALOGUE, N, T, D, E, BatchNormTraining, by_category, by_name, marker_line
from fxdp import meta
from fxdp.diagnostics import Kind, PassResult, Severity, render_findings
from fxdp.grad_sample.registry import register_grad_sampler
from fxdp.layout import BatchLayout, UNBATCHED_LAYOUT, UNKNOWN_LAYOUT
from fxdp.passes import batch_rules
from fxdp.passes.batch_dim import (
    BatchDimAnalysisError,
    MissingBatchRuleError,
    _bind_inputs,
    find_batch_dim_violations,
    propagate_batch_dim,
)
from fxdp.passes.batch_rules import find_batch_rule, keeps_layout, layout_through, op_name, parse_einsum, register_batch_rule, reshape_map
from fxdp.tracing import trace


def analyse(entry_or_model, inputs=None, batch_dim=0, strict=False):
    """(graph module, findings) for a catalogue entry or a model with inputs."""
    if inputs is None:
        model, inputs = entry_or_model.build()
        batch_dim = entry_or_model.batch_dim
    else:
        model = entry_or_model
    gm = trace(model).graph_module
    result = propagate_batch_dim(gm, inputs, batch_dim=batch_dim, strict=strict)
    return gm, list(result.report.findings)


def node_named(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def at_line(findings, model, marker):
    file, line = marker_line(model, marker)
    return [f for f in findings if f.location is not None and f.location.file == file and f.location.line == line]


def ids(entries):
    return [e.name for e in entries]


# --------------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------------


def test_catalogue_has_at_least_30_models_of_every_kind_and_every_marker_is_on_one_line():
    assert len(CATALOGUE) >= 30
    assert len({e.name for e in CATALOGUE}) == len(CATALOGUE)
    for category in ("benign", "moves", "mixes"):
        assert len(by_category(category)) >= 10, category
    for entry in CATALOGUE:
        for expect in entry.expect:
            file, line = marker_line(entry.factory(), expect.marker)
            assert file.endswith("batch_models.py") and line > 0


@pytest.mark.parametrize("entry", by_category("benign"), ids=ids(by_category("benign")))
def test_benign_model_has_no_findings(entry):
    gm, findings = analyse(entry)
    assert findings == [], render_findings(findings)
    for n in gm.graph.nodes:  # every node got both keys
        assert meta.BATCH_DIM in n.meta and meta.FAKE_VALUE in n.meta, n.name
        if isinstance(n.meta[meta.FAKE_VALUE], torch.Tensor):
            assert isinstance(n.meta[meta.FAKE_VALUE], FakeTensor), n.name


@pytest.mark.parametrize("entry", by_category("mixes"), ids=ids(by_category("mixes")))
def test_mixing_op_is_an_error_at_its_source_line_with_a_path_from_the_input(entry):
    gm, findings = analyse(entry)
    model = entry.factory()
    here = [f for f in at_line(findings, model, entry.marker) if f.kind is Kind.MIXES_SAMPLES]
    assert here, render_findings(findings)
    f = here[0]
    assert f.severity is Severity.ERROR and f.pass_name == "batch_dim"
    assert f.message and f.fix and f.op
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    assert f.path and f.path[0] in placeholders and f.path[-1] == f.node
    assert batch_rules.per_sample(node_named(gm, f.path[0]).meta[meta.BATCH_DIM])
    for a, b in zip(f.path, f.path[1:]):  # consecutive nodes are graph edges
        assert node_named(gm, b) in node_named(gm, a).users
    # nothing else in the model is unverified
    assert not [x for x in findings if x.kind is Kind.UNVERIFIED], render_findings(findings)


@pytest.mark.parametrize("entry", by_category("moves"), ids=ids(by_category("moves")))
def test_batch_move_is_reported_at_its_line_with_the_layout_it_leaves(entry):
    gm, findings = analyse(entry)
    model = entry.factory()
    assert not [f for f in findings if f.kind is not Kind.MOVES_BATCH], render_findings(findings)
    expected_lines = set()
    for expect in entry.expect:
        here = at_line(findings, model, expect.marker)
        assert len(here) == 1, (expect.marker, render_findings(findings))
        f = here[0]
        assert f.severity is Severity.WARNING and f.path and f.path[-1] == f.node
        assert node_named(gm, f.node).meta[meta.BATCH_DIM] == expect.layout
        expected_lines.add(f.location.line)
    assert {f.location.line for f in findings} == expected_lines


def test_messages_say_what_happened_in_plain_words():
    _, findings = analyse(by_name("center_with_batch_mean"))
    assert findings[0].message == "reduces over the batch dimension (dim 0): the result combines all samples"
    assert "per-sample dimension" in findings[0].fix
    _, findings = analyse(by_name("reshape_merge_n_t"))
    assert findings[0].message.startswith("merges the batch (dim 0) with other dimensions into dim 0 "
                                          f"(shape ({N}, {T}, {D}) -> ({N * T}, {D}))")
    _, findings = analyse(by_name("batchnorm_training"))
    assert findings[0].op == "nn.BatchNorm1d" and "GroupNorm" in findings[0].fix
    _, findings = analyse(by_name("lstm_wrong_batch_first"))
    assert "batch_first=True" in findings[0].fix and "sequence dimension" in findings[0].message
    text = render_findings(findings)
    assert f"{marker_line(by_name('lstm_wrong_batch_first').factory(), 'MIX')[1]}" in text


# --------------------------------------------------------------------------------------------
# Recorded layouts against real computation
# --------------------------------------------------------------------------------------------


class _Record(torch.fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: Dict[torch.fx.Node, object] = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n] = out
        return out


def _run_real(gm, inputs):
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rec = _Record(gm)
    with torch.no_grad():
        rec.run(*_bind_inputs(placeholders, inputs))
    return rec.values


def _perturb_sample(inputs, j: int, batch_dim: int):
    def change(v):
        if not (isinstance(v, torch.Tensor) and v.dim() > batch_dim and v.shape[batch_dim] == N):
            return v
        v = v.clone()
        if v.is_floating_point():
            v.select(batch_dim, j).add_(1.0)
        else:  # indices stay in range: take another sample's
            v.select(batch_dim, j).copy_(v.select(batch_dim, (j + 1) % N))
        return v

    if isinstance(inputs, dict):
        return {k: change(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(change(v) for v in inputs)
    return change(inputs)


@pytest.mark.parametrize("entry", by_category("benign") + by_category("moves"),
                         ids=ids(by_category("benign") + by_category("moves")))
def test_changing_one_sample_changes_only_its_slice_where_the_layout_says(entry):
    gm, findings = analyse(entry)
    model, inputs = entry.build()
    j = 2
    before = _run_real(gm, inputs)
    after = _run_real(gm, _perturb_sample(inputs, j, entry.batch_dim))
    others = [i for i in range(N) if i != j]
    moved = {f.node for f in findings}
    checked = 0
    for n, value in before.items():
        lay = n.meta[meta.BATCH_DIM]
        if not (isinstance(value, torch.Tensor) and isinstance(lay, BatchLayout)):
            continue
        if lay.is_batched:
            a, b = lay.to_batch_first(value, N), lay.to_batch_first(after[n], N)
            assert torch.equal(a[others], b[others]), f"{n.name} ({lay}) changed other samples"
            if n.name in moved and value.is_floating_point():
                assert not torch.equal(a[j], b[j]), f"{n.name} ({lay}): sample {j}'s slice did not change"
            checked += 1
        else:  # broadcast / unbatched values must not depend on any sample
            assert torch.equal(value, after[n]), f"{n.name} is {lay} but depends on the samples"
    assert checked >= 2


def _sample(inputs, i: int, batch_dim: int):
    def take(v):
        if isinstance(v, torch.Tensor):
            v = v.double() if v.is_floating_point() else v
            if v.dim() > batch_dim and v.shape[batch_dim] == N:
                return v.narrow(batch_dim, i, 1)
        return v

    if isinstance(inputs, dict):
        return {k: take(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(take(v) for v in inputs)
    return take(inputs)


def _as_double(inputs):
    if isinstance(inputs, dict):
        return {k: _as_double(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_as_double(v) for v in inputs)
    return inputs.double() if isinstance(inputs, torch.Tensor) and inputs.is_floating_point() else inputs


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


@pytest.mark.parametrize("entry", by_category("benign") + by_category("moves"),
                         ids=ids(by_category("benign") + by_category("moves")))
def test_benign_and_moving_models_compute_each_sample_as_if_it_were_alone(entry):
    """What the per-sample gradient checks rely on: these models keep samples apart for any batch
    size (also 1), and their output has the batch where the analysis says."""
    gm, _ = analyse(entry)
    out_layout = [n for n in gm.graph.nodes if n.op == "output"][0].meta[meta.BATCH_DIM]
    model, inputs = entry.build()
    model = model.double()
    with torch.no_grad():
        batch = out_layout.to_batch_first(_call(model, _as_double(inputs)), N)
        for i in range(N):
            alone = out_layout.to_batch_first(_call(model, _sample(inputs, i, entry.batch_dim)), 1)
            torch.testing.assert_close(batch[i:i + 1], alone)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 3), min_size=2, max_size=3),
    ops=st.lists(st.sampled_from(["transpose", "permute", "merge", "flatten", "unsqueeze", "movedim",
                                  "unflatten", "reshape_any", "squeeze"]), min_size=1, max_size=3),
    seed=st.integers(0, 10_000),
)
def test_view_chains_record_where_each_sample_really_is(sizes, ops, seed):
    """A chain of views applied to a tensor holding each sample's index: the recorded layout must put
    sample i's entries (and only them) at index i of to_batch_first, or be unknown (batch torn apart)."""
    n = 5
    rng = torch.Generator().manual_seed(seed)

    def pick(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=rng))

    steps = []  # (method, args), chosen on concrete shapes
    x = torch.empty(n, *sizes)
    for op in ops:
        if op == "transpose":
            step = ("transpose", (pick(x.dim()), pick(x.dim())))
        elif op == "permute":
            step = ("permute", tuple(torch.randperm(x.dim(), generator=rng).tolist()))
        elif op == "merge" and x.dim() >= 2:
            k = pick(x.dim() - 1)
            step = ("reshape", (*x.shape[:k], x.shape[k] * x.shape[k + 1], *x.shape[k + 2:]))
        elif op == "flatten":
            step = ("flatten", (pick(x.dim()),))
        elif op == "unsqueeze":
            step = ("unsqueeze", (pick(x.dim() + 1),))
        elif op == "movedim":
            step = ("movedim", (pick(x.dim()), pick(x.dim())))
        elif op == "unflatten" and x.shape[-1] % 2 == 0 and x.shape[-1] > 2:
            step = ("unflatten", (-1, (2, x.shape[-1] // 2)))
        elif op == "reshape_any":  # may tear the batch apart
            divisors = [d for d in range(1, x.numel() + 1) if x.numel() % d == 0]
            step = ("reshape", (divisors[pick(min(4, len(divisors)))], -1))
        else:
            step = ("squeeze", ())
        steps.append(step)
        x = getattr(x, step[0])(*step[1])

    class Chain(nn.Module):
        def forward(self, x):
            for method, args in steps:
                x = getattr(x, method)(*args)
            return x

    gm = trace(Chain()).graph_module
    result = propagate_batch_dim(gm, torch.randn(n, *sizes))
    lay = [x for x in gm.graph.nodes if x.op == "output"][0].meta[meta.BATCH_DIM]
    if lay.kind == "unknown":
        assert any(f.kind is Kind.MOVES_BATCH and "splits the batch dimension" in f.message
                   for f in result.report.findings), steps
        return
    sample_ids = torch.arange(n, dtype=torch.float64).view(n, *[1] * len(sizes)).expand(n, *sizes)
    real = Chain()(sample_ids)
    bf = lay.to_batch_first(real, n)
    for i in range(n):
        assert torch.all(bf[i] == i), (steps, lay, tuple(real.shape))


# --------------------------------------------------------------------------------------------
# Inputs: several, by keyword, unbatched and broadcast, time-major
# --------------------------------------------------------------------------------------------


def test_keyword_inputs_by_name_with_defaults_and_unbatched_extras():
    gm, findings = analyse(by_name("keyword_inputs"))
    assert findings == []
    layouts = {n.name: n.meta[meta.BATCH_DIM] for n in gm.graph.nodes if n.op == "placeholder"}
    assert layouts == {"x": BatchLayout.at(0), "bias": UNBATCHED_LAYOUT, "scale": None}
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert out.meta[meta.BATCH_DIM] == BatchLayout.at(0)


def test_position_ids_broadcast_and_masks_unbatched_and_two_batched_inputs():
    gm, _ = analyse(by_name("position_ids_1_T"))
    layouts = {n.name: n.meta[meta.BATCH_DIM] for n in gm.graph.nodes}
    assert layouts["tokens"] == BatchLayout.at(0)
    assert layouts["positions"] == BatchLayout.broadcast(0)
    assert layouts["pos"] == BatchLayout.broadcast(0)  # the position embedding is the same for all
    assert layouts["add"] == BatchLayout.at(0)
    gm, _ = analyse(by_name("unbatched_mask_input"))
    assert node_named(gm, "mask").meta[meta.BATCH_DIM] == UNBATCHED_LAYOUT
    gm, _ = analyse(by_name("two_inputs"))
    assert [n.meta[meta.BATCH_DIM] for n in gm.graph.nodes if n.op == "placeholder"] == [BatchLayout.at(0)] * 2


def test_time_major_inputs_with_batch_dim_1():
    gm, findings = analyse(by_name("time_major_lstm_batch_dim_1"))
    assert findings == []
    assert node_named(gm, "x").meta[meta.BATCH_DIM] == BatchLayout.at(1)
    lstm = node_named(gm, "lstm").meta[meta.BATCH_DIM]
    assert lstm[0] == BatchLayout.at(1) and lstm[1] == (BatchLayout.at(1), BatchLayout.at(1))
    assert node_named(gm, "lin").args[0].meta[meta.BATCH_DIM] == BatchLayout.at(0)  # out[-1]: (N, E)
    # the same model analysed as if the batch were first: the LSTM runs over the batch
    model, x = by_name("time_major_lstm_batch_dim_1").build()
    findings = find_batch_dim_violations(model, x, batch_dim=0)
    assert [f.kind for f in findings] == [Kind.MIXES_SAMPLES] and findings[0].op == "nn.LSTM"


def test_with_batch_size_one_every_size_one_input_counts_as_batched():
    """The documented ambiguity: with N = 1 a (1, T) input cannot be told from a batched one."""
    model, (tokens, positions) = by_name("position_ids_1_T").build()
    gm, _ = analyse(model, (tokens[:1], positions))
    assert node_named(gm, "positions").meta[meta.BATCH_DIM] == BatchLayout.at(0)


def test_input_errors_name_the_input_and_what_to_do():
    model = by_name("keyword_inputs").factory()
    gm = trace(model).graph_module
    with pytest.raises(BatchDimAnalysisError, match="no value for the model input 'x'"):
        propagate_batch_dim(gm, {"bias": torch.ones(D)})
    with pytest.raises(BatchDimAnalysisError, match=r"names \['mask'\], which forward\(\) does not take"):
        propagate_batch_dim(gm, {"x": torch.randn(N, D), "mask": torch.ones(2)})
    with pytest.raises(BatchDimAnalysisError, match="contain no tensor"):
        propagate_batch_dim(gm, {"x": 3})
    with pytest.raises(BatchDimAnalysisError, match=r"shape \(4, 8\), which has no dimension 2"):
        propagate_batch_dim(gm, torch.randn(N, D), batch_dim=2)
    with pytest.raises(ValueError, match="non-negative"):
        propagate_batch_dim(gm, torch.randn(N, D), batch_dim=-1)


def test_inputs_of_the_wrong_shape_fail_with_the_node_and_line():
    model = by_name("mlp").factory()
    gm = trace(model).graph_module
    with pytest.raises(BatchDimAnalysisError) as info:
        propagate_batch_dim(gm, torch.randn(N, D + 1))
    text = str(info.value)
    assert "nn.Linear (node net_0)" in text and "example_inputs have the shapes" in text
    assert isinstance(info.value.__cause__, Exception)


# --------------------------------------------------------------------------------------------
# Unverified ops, strict mode, custom rules
# --------------------------------------------------------------------------------------------


class Spectral(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = self.lin(x)
        f = torch.fft.rfft(h)  # NO RULE
        return f.abs() + 1


def test_op_without_rule_is_unverified_and_what_follows_is_unknown():
    model = Spectral()
    gm, findings = analyse(model, torch.randn(N, D))
    assert [(f.kind, f.severity, f.op) for f in findings] == [(Kind.UNVERIFIED, Severity.WARNING, "torch.fft.rfft")]
    assert findings[0].location.line == marker_line(model, "NO RULE")[1]
    assert "no batch rule for torch.fft.rfft" in findings[0].message and "batch@0" in findings[0].message
    assert findings[0].path == ("x", "lin", "fft_rfft")
    assert node_named(gm, "fft_rfft").meta[meta.BATCH_DIM] == UNKNOWN_LAYOUT
    assert node_named(gm, "add").meta[meta.BATCH_DIM] == UNKNOWN_LAYOUT


def test_strict_mode_raises_on_an_op_without_rule_naming_node_op_and_line():
    model = Spectral()
    line = marker_line(model, "NO RULE")[1]
    with pytest.raises(MissingBatchRuleError) as info:
        analyse(model, torch.randn(N, D), strict=True)
    text = str(info.value)
    assert "no batch rule for torch.fft.rfft" in text and "node fft_rfft" in text
    assert f"test_batch_dim.py:{line}" in text and "register_batch_rule" in text


class MaskSelect(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x, keep):
        h = self.lin(x)
        picked = h[keep]  # DATA DEPENDENT
        return picked.sum(-1)


def test_data_dependent_shapes_are_unverified_not_a_crash():
    model = MaskSelect()
    gm, findings = analyse(model, (torch.randn(N, D), torch.tensor([True, False, True, True])))
    assert [f.kind for f in findings] == [Kind.UNVERIFIED]
    assert findings[0].location.line == marker_line(model, "DATA DEPENDENT")[1]
    assert "depends on the data" in findings[0].message
    assert node_named(gm, "getitem").meta[meta.FAKE_VALUE] is None
    assert node_named(gm, "sum_1").meta[meta.BATCH_DIM] == UNKNOWN_LAYOUT


class ScaleBase(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(E))

    def forward(self, x):
        return x * self.scale


class Scale(ScaleBase):
    pass


def _scale_grad_sampler(module, activations, backprops):
    return {module.scale: (activations[0] * backprops).reshape(backprops.shape[0], -1, E).sum(1)}


class UsesScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)
        self.scale = Scale()

    def forward(self, x):
        return self.scale(self.lin(x))


def test_a_registered_rule_for_a_base_class_serves_its_subclasses():
    from fxdp.grad_sample.registry import _GRAD_SAMPLERS

    register_grad_sampler(Scale)(_scale_grad_sampler)  # makes Scale a layer the graph calls whole
    try:
        model = UsesScale()
        # no batch rule yet: the per-sample rule's contract (batch in dimension 0, in and out) is used
        gm, findings = analyse(model, torch.randn(N, D))
        assert findings == []
        assert node_named(gm, "scale").meta[meta.BATCH_DIM] == BatchLayout.at(0)
        assert find_batch_rule(Scale()) is batch_rules.core._registered_layer
        register_batch_rule(ScaleBase)(keeps_layout)
        gm, findings = analyse(model, torch.randn(N, D))
        assert findings == []
        assert node_named(gm, "scale").meta[meta.BATCH_DIM] == BatchLayout.at(0)
        assert find_batch_rule(Scale()) is keeps_layout
    finally:
        _GRAD_SAMPLERS.pop(Scale, None)
        batch_rules.core._LAYER_RULES.entries.pop(ScaleBase, None)


def test_registry_lookup_walks_the_mro_and_names_ops():
    class MyLinear(nn.Linear):
        pass

    assert find_batch_rule(MyLinear(2, 3)) is find_batch_rule(nn.Linear(2, 3)) is not None
    assert find_batch_rule("transpose") is find_batch_rule(torch.transpose)
    assert find_batch_rule(torch.fft.rfft) is None
    assert [op_name(o) for o in (torch.sum, F.softmax, operator.add, "transpose", nn.BatchNorm1d(3), MyLinear)] == [
        "torch.sum", "F.softmax", "operator.add", "transpose", "nn.BatchNorm1d", "MyLinear"]


# --------------------------------------------------------------------------------------------
# The user's model is untouched; the pass's result
# --------------------------------------------------------------------------------------------


def test_analysis_leaves_the_model_untouched_and_computes_nothing_real():
    torch.manual_seed(0)
    model = BatchNormTraining()
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    findings = find_batch_dim_violations(model, torch.randn(N, D))
    assert [f.kind for f in findings] == [Kind.MIXES_SAMPLES]
    assert model.training and model.bn.num_batches_tracked.item() == 0
    for name, (p, value) in params.items():
        current = dict(model.named_parameters())[name]
        assert current is p and type(p) is nn.Parameter and not isinstance(p, FakeTensor)
        assert torch.equal(p, value) and p.grad is None
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]) and not isinstance(b, FakeTensor)
    for m in model.modules():
        assert not any(isinstance(v, FakeTensor) for v in vars(m).values())


def test_pass_result_is_the_same_graph_module_with_a_batch_dim_report():
    model, x = by_name("transpose_0_1").build()
    gm = trace(model).graph_module
    before = [(n.op, n.target, n.args) for n in gm.graph.nodes]
    result = propagate_batch_dim(gm, x)
    assert isinstance(result, PassResult) and result.graph_module is gm
    assert result.report.name == "batch_dim" and result.report.changes == () and not result.report.modified
    assert [(n.op, n.target, n.args) for n in gm.graph.nodes] == before
    assert fxdp.find_batch_dim_violations is find_batch_dim_violations


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        if x.sum() > 0:  # UNTRACEABLE
            return self.lin(x)
        return -self.lin(x)


def test_untraceable_model_gets_a_clear_error_with_its_line():
    model = Untraceable()
    with pytest.raises(BatchDimAnalysisError) as info:
        find_batch_dim_violations(model, torch.randn(N, D))
    text = str(info.value)
    assert "cannot analyse Untraceable: torch.fx cannot trace it" in text
    assert f"test_batch_dim.py:{marker_line(model, 'UNTRACEABLE')[1]}" in text
    assert info.value.__cause__ is not None


# --------------------------------------------------------------------------------------------
# Rule building blocks
# --------------------------------------------------------------------------------------------


def test_reshape_maps_merge_and_split_the_batch():
    merged = layout_through(reshape_map((N, T, D), (N * T, D)), (N, T, D), BatchLayout.at(0), N)
    assert merged == BatchLayout.merged(0, T)
    time_major = layout_through(reshape_map((T, N, D), (T * N, D)), (T, N, D), BatchLayout.at(1), N)
    assert time_major == BatchLayout.merged(0, 1)
    back = layout_through(reshape_map((N * T, D), (N, T, D)), (N * T, D), BatchLayout.merged(0, T), N)
    assert back == BatchLayout.at(0)
    split_out = layout_through(reshape_map((T * N, D), (T, N, D)), (T * N, D), BatchLayout.merged(0, 1), N)
    assert split_out == BatchLayout.at(1)
    torn = layout_through(reshape_map((N, D), (2, N // 2, D)), (N, D), BatchLayout.at(0), N)
    assert torn == UNKNOWN_LAYOUT


def test_einsum_equations_with_ellipsis_and_implicit_output():
    labels, out = parse_einsum("...ij,jk", [(2, 3, 4, 5), (5, 6)])
    assert labels == [(("...", 0), ("...", 1), "i", "j"), ("j", "k")]
    assert out == (("...", 0), ("...", 1), "i", "k")
    labels, out = parse_einsum("bij, bjk -> bik", [(2, 3, 4), (2, 4, 5)])
    assert out == ("b", "i", "k")


# --------------------------------------------------------------------------------------------
# One op at a time: the families' rules on inputs with the batch at dim 0 (N=4)
# --------------------------------------------------------------------------------------------


class Apply(nn.Module):
    """Runs ``fn(self, x)``; ``layer`` is a submodule the graph calls whole."""

    def __init__(self, fn, layer=None):
        super().__init__()
        self.fn = fn
        self.layer = layer

    def forward(self, x):
        return self.fn(self, x)


class Apply2(Apply):
    def forward(self, x, y):
        return self.fn(self, x, y)


B0, B1, B2 = BatchLayout.at(0), BatchLayout.at(1), BatchLayout.at(2)
MIXES, MOVES = {Kind.MIXES_SAMPLES}, {Kind.MOVES_BATCH}
x2, x3, x4 = (lambda: torch.randn(N, D)), (lambda: torch.randn(N, T, D)), (lambda: torch.randn(N, C_, 6, 6))
C_ = 3

OPS = [
    # (name, fn, layer, inputs, layout of the output, kinds of findings)
    ("repeat_features", lambda s, x: x.repeat(1, 2), None, x2, B0, set()),
    ("repeat_batch_merges", lambda s, x: x.repeat(2, 1) + 1, None, x2, BatchLayout.merged(0, 1), MOVES),
    ("tile_leading", lambda s, x: torch.tile(x, (2, 1, 1)) * 2, None, x2, B1, MOVES),
    ("repeat_interleave_batch", lambda s, x: x.repeat_interleave(3, dim=0) * 2, None, x2, BatchLayout.merged(0, 3), MOVES),
    ("expand_new_leading", lambda s, x: x.expand(2, N, D) * 2, None, x2, B1, MOVES),
    ("squeeze_keeps", lambda s, x: x.unsqueeze(1).squeeze(1), None, x2, B0, set()),
    ("select_time", lambda s, x: x.select(1, 0), None, x3, B0, set()),
    ("select_batch", lambda s, x: x.select(0, 1), None, x3, UNBATCHED_LAYOUT, MIXES),
    ("narrow_time", lambda s, x: x.narrow(1, 1, 2), None, x3, B0, set()),
    ("narrow_batch", lambda s, x: x.narrow(0, 1, 2), None, x3, UNBATCHED_LAYOUT, MIXES),
    ("index_select_time", lambda s, x: x.index_select(1, torch.tensor([0, 2])), None, x3, B0, set()),
    ("gather_batch_index_per_sample", lambda s, x, i: torch.gather(x, 1, i), None,
     lambda: (torch.randn(N, D), torch.zeros(N, 2, dtype=torch.long)), B0, set()),
    ("scatter_features", lambda s, x: torch.zeros_like(x).scatter(1, torch.zeros(N, 1, dtype=torch.long), x), None,
     x2, B0, set()),
    ("scatter_batch", lambda s, x: torch.zeros_like(x).scatter_add(0, torch.zeros(N, D, dtype=torch.long), x), None,
     x2, UNBATCHED_LAYOUT, MIXES),
    ("take_flat", lambda s, x: torch.take(x, torch.tensor([0, 5])), None, x2, UNBATCHED_LAYOUT, MIXES),
    ("cosine_similarity_features", lambda s, x: F.cosine_similarity(x, x + 1), None, x2, B0, set()),
    ("cosine_similarity_batch", lambda s, x: F.cosine_similarity(x, x + 1, dim=0), None, x2, UNBATCHED_LAYOUT, MIXES),
    ("pairwise_distance", lambda s, x: F.pairwise_distance(x, x * 2), None, x2, B0, set()),
    ("tensordot_features", lambda s, x: torch.tensordot(x, torch.ones(D, 5), dims=1), None, x2, B0, set()),
    ("tensordot_batch", lambda s, x: torch.tensordot(x, torch.ones(N, 5), dims=([0], [0])), None, x2,
     UNBATCHED_LAYOUT, MIXES),
    ("outer_pairs", lambda s, x: torch.outer(x[:, 0], x[:, 1]), None, x2, B0, MIXES),
    ("addmm", lambda s, x: torch.addmm(torch.zeros(5), x, torch.ones(D, 5)), None, x2, B0, set()),
    ("functional_linear", lambda s, x: F.linear(x, torch.ones(5, D), torch.zeros(5)), None, x3, B0, set()),
    ("bilinear_layer", lambda s, x: s.layer(x, x), nn.Bilinear(D, D, 3), x2, B0, set()),
    ("functional_conv", lambda s, x: F.conv2d(x, torch.ones(2, C_, 3, 3)), None, x4, B0, set()),
    ("functional_pool", lambda s, x: F.max_pool2d(x, 2), None, x4, B0, set()),
    ("pool_with_indices", lambda s, x: F.max_pool2d(x, 2, return_indices=True)[0], None, x4, B0, set()),
    ("pool_batch_in_space", lambda s, x: F.avg_pool1d(x.T.unsqueeze(0), 2), None, x2, B2, MIXES | MOVES),
    ("interpolate", lambda s, x: F.interpolate(x, scale_factor=2.0), None, x4, B0, set()),
    ("pad_space", lambda s, x: F.pad(x, (1, 1)), None, x4, B0, set()),
    ("pad_batch", lambda s, x: F.pad(x, (0, 0, 1, 0)), None, x2, UNKNOWN_LAYOUT, MIXES),
    ("zero_pad_layer", lambda s, x: s.layer(x), nn.ZeroPad2d(1), x4, B0, set()),
    ("pixel_shuffle", lambda s, x: F.pixel_shuffle(x.repeat(1, 4, 1, 1)[:, :4], 2), None, x4, B0, set()),
    ("group_norm", lambda s, x: F.group_norm(x, 1), None, x4, B0, set()),
    ("instance_norm_layer", lambda s, x: s.layer(x), nn.InstanceNorm2d(C_), x4, B0, set()),
    ("instance_norm_batch_in_space", lambda s, x: s.layer(x.T.unsqueeze(0)), nn.InstanceNorm1d(D), x2, B2, MIXES | MOVES),
    ("layer_norm_module", lambda s, x: s.layer(x), nn.LayerNorm(D), x3, B0, set()),
    ("local_response_norm_batch", lambda s, x: s.layer(x.transpose(0, 1)), nn.LocalResponseNorm(2), x4, B1,
     MIXES | MOVES),
    ("embedding_functional", lambda s, x: F.embedding(x, torch.ones(10, 3)), None,
     lambda: torch.randint(0, 10, (N, T)), B0, set()),
    ("one_hot", lambda s, x: F.one_hot(x, 10).float(), None, lambda: torch.randint(0, 10, (N, T)), B0, set()),
    ("embedding_bag", lambda s, x: s.layer(x), nn.EmbeddingBag(10, 3), lambda: torch.randint(0, 10, (N, T)), B0, set()),
    ("split_features", lambda s, x: torch.split(x, 3, dim=1)[1], None, x2, B0, set()),
    ("unbind_time", lambda s, x: x.unbind(1)[0], None, x3, B0, set()),
    ("unbind_batch", lambda s, x: x.unbind(0)[0], None, x3, UNBATCHED_LAYOUT, MIXES),
    ("where_clamp", lambda s, x: torch.where(x > 0, x, torch.zeros(D)).clamp(-1, 1), None, x2, B0, set()),
    ("data_attribute", lambda s, x: x.data * 2, None, x2, B0, set()),
    ("lstm_cell", lambda s, x: s.layer(x)[0], nn.LSTMCell(D, 3), x2, B0, set()),
    ("flatten_layer_from_0", lambda s, x: s.layer(x) * 2, nn.Flatten(0), x3, BatchLayout.merged(0, T * D), MOVES),
    ("unflatten_layer", lambda s, x: s.layer(x), nn.Unflatten(1, (2, 4)), x2, B0, set()),
    ("softmax_layer_batch", lambda s, x: s.layer(x), nn.Softmax(dim=0), x2, B0, MIXES),
    ("softmax_implicit_dim", lambda s, x: F.softmax(x, dim=None), None, x2, B0, set()),
    ("cosine_similarity_layer", lambda s, x: s.layer(x, x), nn.CosineSimilarity(), x2, B0, set()),
    ("loss_reduction_none", lambda s, x: s.layer(x, torch.zeros(N, D)), nn.MSELoss(reduction="none"), x2, B0, set()),
    ("loss_mean_layer", lambda s, x: s.layer(x, torch.zeros(N, D)), nn.L1Loss(), x2, UNBATCHED_LAYOUT, MIXES),
    ("new_zeros_batch_sized", lambda s, x: x.new_zeros(x.size(0), 3), None, x2, B0, set()),
    ("arange_sample_index", lambda s, x: torch.arange(x.shape[0]), None, x2, B0, set()),
    ("full_unbatched", lambda s, x: x.new_full((2, 3), 1.0), None, x2, UNBATCHED_LAYOUT, set()),
    # the in-place add makes the zeros per-sample: summing them over the batch then mixes samples
    ("inplace_add_then_mix", lambda s, x: [b := x.new_zeros(N, D), b.add_(x), b.sum(0)][-1], None, x2,
     UNBATCHED_LAYOUT, MIXES),
    ("stack_time", lambda s, x: torch.stack([x, x], dim=1), None, x2, B0, set()),
    ("cat_two_layouts", lambda s, x: torch.cat([x[:, :N], x[:, :N].T], 1), None, x2, UNKNOWN_LAYOUT, MIXES | MOVES),
    ("baddbmm", lambda s, x: torch.baddbmm(torch.zeros(T, T), x, x.transpose(1, 2)), None, x3, B0, set()),
    ("matmul_vector", lambda s, x: x @ torch.ones(D), None, x3, B0, set()),
    ("einsum_implicit_output", lambda s, x: torch.einsum("ntd,de", x, torch.ones(D, 2)), None, x3, B1, set()),
]


@pytest.mark.parametrize("name, fn, layer, inputs, layout, kinds", OPS, ids=[o[0] for o in OPS])
def test_rule_gives_the_output_layout_and_findings(name, fn, layer, inputs, layout, kinds):
    example = inputs()
    model = (Apply2 if isinstance(example, tuple) else Apply)(fn, layer)
    gm, findings = analyse(model, example)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].meta[meta.BATCH_DIM]
    assert out == layout, render_findings(findings)
    assert {f.kind for f in findings} == kinds, render_findings(findings)


class InPlaceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, E)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.a(x)
        out += x
        out = self.act(out)
        out[:, 0] = x[:, 1]
        y = self.b(out)
        y.clamp_(min=0)
        w = y.clone()
        w[1:] = y[:-1]  # MIX
        return w


def test_graph_rewritten_by_the_inplace_pass_is_analysed_like_the_original():
    from fxdp.passes.inplace import remove_inplace_ops

    model = InPlaceBlock()
    x = torch.randn(N, D)
    _, direct = analyse(model, x)
    gm = remove_inplace_ops(trace(model).graph_module).graph_module
    rewritten = list(propagate_batch_dim(gm, x).report.findings)
    line = marker_line(model, "MIX")[1]
    for findings in (direct, rewritten):
        assert [(f.kind, f.location.line) for f in findings] == [(Kind.MIXES_SAMPLES, line)], render_findings(findings)
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert out.meta[meta.BATCH_DIM] == B0
    assert all(n.meta[meta.BATCH_DIM] is not None for n in gm.graph.nodes
               if isinstance(n.meta[meta.FAKE_VALUE], torch.Tensor))
