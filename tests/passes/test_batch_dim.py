"""The batch_dim pass: where the batch is at every node, which ops move it, which mix samples.

The catalogue (tests/support/batch_models/) drives most tests: every mixing op is found at its marked
line, no benign model is flagged, every batch move is found at its line with the right recorded
layout. Recorded layouts are checked against real computation: changing one sample's input may only
change that sample's slice of every per-sample value (located with the recorded layout). The rules of
single ops, unverified ops and strict mode: tests/passes/batch_rules/test_rules.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import fxdp
from fxdp import meta
from fxdp.diagnostics import Kind, PassResult, Severity, render_findings
from fxdp.layout import BatchLayout, UNBATCHED_LAYOUT
from fxdp.passes import batch_rules
from fxdp.passes.batch_dim import BatchDimAnalysisError, _bind_inputs, find_batch_dim_violations, propagate_batch_dim
from fxdp.frontends.fx import trace
from tests.support.batch_dim_analysis import analyse, node_named
from tests.support.batch_models import CATALOGUE, N, T, D, E, BatchNormTraining, by_category, by_name, marker_line


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
            assert Path(file).parent.name == "batch_models" and line > 0


@pytest.mark.parametrize("entry", by_category("benign"), ids=ids(by_category("benign")))
def test_benign_model_has_no_findings(entry):
    gm, findings = analyse(entry)
    assert findings == [], render_findings(findings)
    for n in gm.graph.nodes:  # every node got both keys
        assert meta.BATCH_LAYOUT in n.meta and meta.FAKE_VALUE in n.meta, n.name
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
    assert batch_rules.carries_batch(node_named(gm, f.path[0]).meta[meta.BATCH_LAYOUT])
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
        assert node_named(gm, f.node).meta[meta.BATCH_LAYOUT] == expect.layout
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
        lay = n.meta[meta.BATCH_LAYOUT]
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
    out_layout = [n for n in gm.graph.nodes if n.op == "output"][0].meta[meta.BATCH_LAYOUT]
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
    lay = [x for x in gm.graph.nodes if x.op == "output"][0].meta[meta.BATCH_LAYOUT]
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
    layouts = {n.name: n.meta[meta.BATCH_LAYOUT] for n in gm.graph.nodes if n.op == "placeholder"}
    assert layouts == {"x": BatchLayout.at(0), "bias": UNBATCHED_LAYOUT, "scale": None}
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert out.meta[meta.BATCH_LAYOUT] == BatchLayout.at(0)


def test_position_ids_broadcast_and_masks_unbatched_and_two_batched_inputs():
    gm, _ = analyse(by_name("position_ids_1_T"))
    layouts = {n.name: n.meta[meta.BATCH_LAYOUT] for n in gm.graph.nodes}
    assert layouts["tokens"] == BatchLayout.at(0)
    assert layouts["positions"] == BatchLayout.broadcast(0)
    assert layouts["pos"] == BatchLayout.broadcast(0)  # the position embedding is the same for all
    assert layouts["add"] == BatchLayout.at(0)
    gm, _ = analyse(by_name("unbatched_mask_input"))
    assert node_named(gm, "mask").meta[meta.BATCH_LAYOUT] == UNBATCHED_LAYOUT
    gm, _ = analyse(by_name("two_inputs"))
    assert [n.meta[meta.BATCH_LAYOUT] for n in gm.graph.nodes if n.op == "placeholder"] == [BatchLayout.at(0)] * 2


def test_time_major_inputs_with_batch_dim_1():
    gm, findings = analyse(by_name("time_major_lstm_batch_dim_1"))
    assert findings == []
    assert node_named(gm, "x").meta[meta.BATCH_LAYOUT] == BatchLayout.at(1)
    lstm = node_named(gm, "lstm").meta[meta.BATCH_LAYOUT]
    assert lstm[0] == BatchLayout.at(1) and lstm[1] == (BatchLayout.at(1), BatchLayout.at(1))
    assert node_named(gm, "lin").args[0].meta[meta.BATCH_LAYOUT] == BatchLayout.at(0)  # out[-1]: (N, E)
    # the same model analysed as if the batch were first: the LSTM runs over the batch
    model, x = by_name("time_major_lstm_batch_dim_1").build()
    findings = find_batch_dim_violations(model, x, batch_dim=0)
    assert [f.kind for f in findings] == [Kind.MIXES_SAMPLES] and findings[0].op == "nn.LSTM"


def test_with_batch_size_one_every_size_one_input_counts_as_batched():
    """The documented ambiguity: with N = 1 a (1, T) input cannot be told from a batched one."""
    model, (tokens, positions) = by_name("position_ids_1_T").build()
    gm, _ = analyse(model, (tokens[:1], positions))
    assert node_named(gm, "positions").meta[meta.BATCH_LAYOUT] == BatchLayout.at(0)


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
    assert out.meta[meta.BATCH_LAYOUT] == BatchLayout.at(0)
    assert all(n.meta[meta.BATCH_LAYOUT] is not None for n in gm.graph.nodes
               if isinstance(n.meta[meta.FAKE_VALUE], torch.Tensor))
