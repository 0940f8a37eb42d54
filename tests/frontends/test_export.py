"""The second front end (fxdp/frontends/export.py): models torch.fx cannot trace, captured by torch.export."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import fxdp
from fxdp.diagnostics import Kind
from fxdp.errors import ExportShapeError, UnsupportedInputError
from fxdp.passes.batch_rules import keeps_layout, restore_batch_rules, snapshot_batch_rules
from fxdp.sinks.bookkeeping import BookkeepingSink
from tests.support.source_lines import line_of


class LoopOverTime(nn.Module):
    """torch.fx cannot trace ``range(x.shape[1])``; torch.export unrolls the loop."""

    def __init__(self, post=None):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.out = nn.Linear(8, 2)
        self.post = post

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 8)
        for t in range(x.shape[1]):  # the line torch.fx stops at
            h = torch.tanh(self.inp(x[:, t]) + h) * self.scale
        if self.post is not None:
            h = self.post(h)
        return self.out(h)


class Centre(nn.Module):
    def forward(self, h):
        return h - h.mean(0)  # mixes samples


def _x(n=3, t=4, seed=0):
    return torch.randn(n, t, 4, generator=torch.Generator().manual_seed(seed))


def _check_against_batches_of_one(model, compiled, x):
    compiled(x).sum().backward()
    for name, p in model.named_parameters():
        rows = [torch.autograd.grad(model(x[i:i + 1]).sum(), p)[0] for i in range(len(x))]
        torch.testing.assert_close(p.grad_sample, torch.stack(rows), msg=name)
        del p.grad_sample
    model.zero_grad()


def test_a_model_torch_fx_cannot_trace_is_captured_by_torch_export():
    torch.manual_seed(0)
    model = LoopOverTime()
    compiled = fxdp.compile_for_dp(model, example_inputs=_x(), loss_reduction="sum")
    report = fxdp.report(compiled)
    assert (report.engine, report.front_end) == ("fx", "torch.export")
    where = f"{__file__}:{line_of(LoopOverTime.forward, 'for t in range')}"
    assert report.front_end_reason == (f"torch.fx could not trace the model at {where} (TypeError: "
                                       "'_InplaceRecordingProxy' object cannot be interpreted as an integer)")
    assert str(report).splitlines()[1:4] == [
        "traced: yes (torch.export); engine: fx",
        f"front end: torch.export, because {report.front_end_reason}",
        "torch.export: the graph runs inputs of shapes x (N, 4, 4) (N: any batch size); inputs of other sizes are "
        "captured again before their forward (once per shape)"]
    # the ATen calls of the stock layers are the layers again: their hand-written rules serve them
    rules = {site.target: site.rule for site in compiled.fxdp_batch_guard.sites}
    assert rules["inp"] == "Linear" and rules["out"] == "Linear"
    assert "aten.mul.Tensor" in rules and rules["aten.mul.Tensor"] == "generic"  # `* self.scale`
    # the per_sample changes point at the user's lines
    mul = next(c for c in report.changes if c.op == "dp_aware_function")
    assert mul.location.line == line_of(LoopOverTime.forward, "torch.tanh")
    _check_against_batches_of_one(model, compiled, _x())


def test_other_batch_sizes_run_and_other_built_in_sizes_are_captured_again_once_each():
    torch.manual_seed(0)
    model = LoopOverTime()
    compiled = fxdp.compile_for_dp(model, example_inputs=_x(n=3), loss_reduction="sum")
    for n in (5, 1, 3):  # the batch dimension is dynamic in the captured graph
        _check_against_batches_of_one(model, compiled, _x(n=n, seed=n))
    first = type(compiled)
    _check_against_batches_of_one(model, compiled, _x(t=6))  # the loop was unrolled for 4 time steps: again for 6
    six = type(compiled)
    assert six is not first and compiled.fxdp_input_shapes.shapes == [(None, 6, 4)]
    _check_against_batches_of_one(model, compiled, _x(n=2, seed=7))  # back to 4: the graph kept is put back
    assert type(compiled) is first
    _check_against_batches_of_one(model, compiled, _x(n=1, t=6, seed=8))
    assert type(compiled) is six
    assert fxdp.report(compiled).notes[-1] == ("torch.export: captured once per input shape seen (2 graphs, kept: "
                                               "x (N, 4, 4); x (N, 6, 4))")
    with pytest.raises(ExportShapeError, match=r"LoopOverTime was captured with torch.export for inputs of shapes x "
                                               r"\(N, 6, 4\); input 'x' has shape \(3, 6\), and captured again for it "
                                               r"the model needs the hooks engine \(.*\), which cannot take"):
        compiled(_x(t=6)[:, :, 0])  # an input the model cannot be captured for: refused before anything runs
    assert type(compiled) is six and fxdp.report(compiled).notes[-1].startswith("torch.export: captured once per "
                                                                                  "input shape seen (2 graphs")


def test_batchnorm_in_a_captured_graph_is_refused_as_in_traced_ones():
    with pytest.raises(fxdp.errors.NotPrivateError, match="BatchNorm1d"):
        fxdp.compile_for_dp(LoopOverTime(post=nn.BatchNorm1d(8)).train(), example_inputs=_x())


def test_mixing_in_a_captured_graph_is_refused_with_the_users_line():
    with pytest.raises(fxdp.errors.BatchMixingError) as info:
        fxdp.compile_for_dp(LoopOverTime(post=Centre()), example_inputs=_x())
    finding = next(f for f in info.value.findings if f.kind is Kind.MIXES_SAMPLES)
    assert finding.op == "aten.mean.dim" and finding.location.line == line_of(Centre.forward, "h.mean(0)")


class PairsEveryTwo(nn.Module):
    def forward(self, h):
        return (h @ h.T) @ h  # every sample with every other: torch.export records aten.numpy_T


def test_a_transpose_by_dot_T_in_a_captured_graph_is_followed_and_its_mixing_refused():
    with pytest.raises(fxdp.errors.BatchMixingError) as info:
        fxdp.compile_for_dp(LoopOverTime(post=PairsEveryTwo()), example_inputs=_x())
    finding = next(f for f in info.value.findings if f.kind is Kind.MIXES_SAMPLES)
    assert finding.op == "aten.matmul.default" and finding.location.line == line_of(PairsEveryTwo.forward, "h.T")
    assert not [f for f in info.value.findings if f.kind is Kind.UNVERIFIED]


class SpecialOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        for t in range(x.shape[1]):
            x = x + torch.special.entr(self.fc(x[:, t])).unsqueeze(1)
        return x


def test_an_aten_op_without_a_rule_is_unverified_until_a_rule_is_registered():
    x = torch.rand(3, 2, 4)
    findings = fxdp.find_batch_dim_violations(SpecialOp(), x)
    assert [(f.kind, f.op) for f in findings] == [(Kind.UNVERIFIED, "aten.special_entr.default")] * 1
    saved = snapshot_batch_rules()
    try:
        fxdp.register_batch_rule(torch.ops.aten.special_entr.default)(keeps_layout)
        assert fxdp.find_batch_dim_violations(SpecialOp(), x) == []
    finally:
        restore_batch_rules(saved)


def test_captured_models_survive_copies_with_their_output_and_report():
    torch.manual_seed(0)
    model = LoopOverTime()
    compiled = fxdp.compile_for_dp(model, example_inputs=_x(), loss_reduction="sum")
    for copied in (copy.deepcopy(compiled), pickle.loads(pickle.dumps(compiled))):
        torch.testing.assert_close(copied(_x()), compiled(_x()))
        assert fxdp.report(copied).front_end == "torch.export"


def test_bookkeeping_norms_on_a_captured_graph_match_the_materialised_ones():
    torch.manual_seed(0)
    model = LoopOverTime()
    sink = BookkeepingSink()
    compiled = fxdp.compile_for_dp(model, example_inputs=_x(), loss_reduction="sum", sink=sink)
    compiled(_x()).sum().backward()
    params = [p for p in model.parameters()]
    norms = sink.squared_norms(params)
    sink.clear(params)
    twin = copy.deepcopy(model)
    fxdp.compile_for_dp(twin, example_inputs=_x(), loss_reduction="sum")(_x()).sum().backward()
    for p, q in zip(params, twin.parameters()):
        torch.testing.assert_close(norms[p], q.grad_sample.flatten(1).pow(2).sum(1))


class CountsCalls(LoopOverTime):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1  # a buffer written in forward (an in-place ATen op in the captured graph)
        return super().forward(x)


def test_buffer_writes_in_a_captured_graph_are_refused():
    with pytest.raises(fxdp.errors.NotPrivateError) as info:
        fxdp.compile_for_dp(CountsCalls(), example_inputs=_x())
    finding = next(f for f in info.value.findings if f.kind is Kind.CANNOT_BE_PRIVATE)
    assert finding.op == "aten.add_.Tensor" and "writes into buffer `calls` in place" in finding.message
    assert finding.location.line == line_of(CountsCalls.forward, "self.calls += 1")


class ReluInPlace(LoopOverTime):
    def forward(self, x):
        return torch.relu_(super().forward(x) * 2)


def test_in_place_aten_ops_are_rewritten_out_of_place():
    torch.manual_seed(0)
    model = ReluInPlace()
    compiled = fxdp.compile_for_dp(model, example_inputs=_x(), loss_reduction="sum")
    change = next(c for c in fxdp.report(compiled).changes if c.pass_name == "inplace")
    assert (change.op, change.location.line) == ("aten.relu_.default → aten.relu.default",
                                                 line_of(ReluInPlace.forward, "torch.relu_"))
    _check_against_batches_of_one(model, compiled, _x())


class Doubled(nn.Module):
    """A layer of the user's, with a per-sample rule of the user's."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 8) / 3)

    def forward(self, h):
        return 2 * (h @ self.weight.t())


def test_a_layer_with_a_registered_rule_keeps_its_rule_in_a_captured_graph():
    from fxdp.grad_sample.registry import GRAD_SAMPLERS

    saved = GRAD_SAMPLERS.snapshot()
    try:
        @fxdp.register_grad_sampler(Doubled)
        def doubled_rule(layer, activations, backprops):
            return {layer.weight: 2 * torch.einsum("no,ni->noi", backprops, activations[0])}

        torch.manual_seed(0)
        model = LoopOverTime()
        model.out = Doubled()
        compiled = fxdp.compile_for_dp(model, example_inputs=_x(), loss_reduction="sum")
        assert {site.target: site.rule for site in compiled.fxdp_batch_guard.sites}["out"] == "Doubled"
        _check_against_batches_of_one(model, compiled, _x())
    finally:
        GRAD_SAMPLERS.restore(saved)


class WithDropout(LoopOverTime):
    def __init__(self):
        super().__init__(post=nn.Dropout(0.5))


def test_a_dropout_layer_follows_train_and_eval_in_a_captured_graph():
    model = WithDropout()
    compiled = fxdp.compile_for_dp(model, example_inputs=_x())
    assert "post" in {n.target for n in compiled.graph.nodes if n.op == "call_module"}
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(_x()), model.eval()(_x()))


class AttentionWithDropout(nn.Module):
    """Dropout as attention code writes it: a probability that depends on ``self.training``, not a layer."""

    def __init__(self, p=0.5, where="sdpa"):
        super().__init__()
        self.qkv, self.p, self.where = nn.Linear(4, 12), p, where

    def forward(self, x):
        for _ in range(x.shape[1] // x.shape[1]):  # torch.fx cannot trace this; torch.export can
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        p = self.p if self.training else 0.0
        if self.where == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return torch.nn.functional.dropout(q @ k.transpose(1, 2), p, self.training) @ v


@pytest.mark.parametrize("where", ["sdpa", "functional"])
def test_eval_of_a_graph_captured_with_dropout_on_is_refused_naming_the_dropout(where):
    model = AttentionWithDropout(where=where)
    compiled = fxdp.compile_for_dp(model, (_x(),))
    assert fxdp.report(compiled).front_end == "torch.export"
    compiled(_x()).sum().backward()  # training: dropout on, as captured
    compiled.eval()
    with pytest.raises(fxdp.errors.ExportModeError, match=r"captured with torch.export in training mode.*p=0\.5.*test_export\.py"):
        compiled(_x())


def test_a_graph_captured_with_dropout_zero_evaluates():
    model = AttentionWithDropout(p=0.0)
    compiled = fxdp.compile_for_dp(model, (_x(),))
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(_x()), model.eval()(_x()))


def test_a_capture_again_in_eval_mode_is_made_in_the_first_captures_mode():
    """A new length first seen in eval(): captured in training mode like the first graph, so a dropout layer
    follows eval() and the functional dropout of attention is refused in eval() as in the first graph (and is
    on when training goes on at that length)."""
    layer = WithDropout()
    compiled = fxdp.compile_for_dp(layer, example_inputs=_x())
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(_x(t=6)), layer.eval()(_x(t=6)))
    assert compiled.fxdp_batch_guard.reanalysis.training and not layer.training  # the user's modes are as they were
    attention = AttentionWithDropout(p=1.0, where="functional")
    compiled = fxdp.compile_for_dp(attention, (_x(),))
    compiled.eval()
    modes = [m.training for m in attention.modules()]
    with pytest.raises(fxdp.errors.ExportModeError, match="captured with torch.export in training mode"):
        compiled(_x(t=6))
    assert [m.training for m in attention.modules()] == modes == [True, False]  # the root is not the compiled's
    assert compiled.fxdp_input_shapes.shapes == [(None, 6, 4)]
    compiled.train()
    assert (compiled(_x(t=6)) == 0).all()  # p = 1: everything dropped, as the model trains


def _counting_reanalyse(compiled):
    """Count the batch guard's re-runs of the batch_dim analysis (for input shapes it has not analysed)."""
    reanalysis, calls = compiled.fxdp_batch_guard.reanalysis, []
    original = reanalysis.layouts_for

    def counting(guard, inputs):
        calls.append(tuple(x.shape for x in inputs if isinstance(x, torch.Tensor)))
        return original(guard, inputs)

    reanalysis.layouts_for = counting
    return calls


def test_a_new_batch_size_of_a_captured_graph_reuses_its_analysis():
    """The captured graph is symbolic in the batch size: its layouts hold for every batch of two or more,
    so Poisson batches of new sizes run without a second analysis, with the right per-sample gradients.
    A batch of one is analysed on its own (with one sample a layout can be ambiguous)."""
    torch.manual_seed(0)
    model = LoopOverTime()
    compiled = fxdp.compile_for_dp(model, example_inputs=_x(n=3), loss_reduction="sum")
    assert compiled.fxdp_batch_guard.symbolic_batch.inputs == (True,)
    calls = _counting_reanalyse(compiled)
    for n in (5, 2, 7):
        _check_against_batches_of_one(model, compiled, _x(n=n, seed=n))
    assert calls == []
    _check_against_batches_of_one(model, compiled, _x(n=1, seed=1))
    assert calls == [((1, 4, 4),)]
    fresh = fxdp.compile_for_dp(model, example_inputs=_x(n=3), loss_reduction="sum")
    for copied in (copy.deepcopy(fresh), pickle.loads(pickle.dumps(fresh))):  # the knowledge travels with it
        assert copied.fxdp_batch_guard.symbolic_batch.admits(9)


class FixedBatch(nn.Module):
    """``int(x.shape[0])`` makes torch.export fix the batch size to the example's: no symbol is left."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        n = int(x.shape[0])
        return self.fc(x.reshape(n, -1))


def test_a_batch_size_torch_export_fixed_to_a_number_is_analysed_again():
    compiled = fxdp.compile_for_dp(FixedBatch(), example_inputs=torch.randn(4, 8))
    assert fxdp.report(compiled).front_end == "torch.export"
    assert compiled.fxdp_batch_guard.symbolic_batch is None
    calls = _counting_reanalyse(compiled)
    with pytest.raises(RuntimeError):  # the graph holds reshape(4, -1): the analysis meets the op's own error
        compiled(torch.randn(6, 8))
    assert calls == [((6, 8),)]


def test_a_batch_size_outside_what_the_capture_assumed_is_analysed_again():
    """Conditions torch.export recorded on the batch size (its range, divisibilities) decide which sizes
    reuse the analysis; any other size is analysed as if new."""
    import sympy

    from fxdp.runtime.guards import SymbolicBatch

    torch.manual_seed(0)
    model = LoopOverTime()
    compiled = fxdp.compile_for_dp(model, example_inputs=_x(n=4), loss_reduction="sum")
    s = sympy.Symbol("s0", integer=True, positive=True)
    compiled.fxdp_batch_guard.symbolic_batch = SymbolicBatch((True,), (s,), 2, 8, (sympy.Eq(sympy.Mod(s, 2), 0),))
    admitted = [compiled.fxdp_batch_guard.symbolic_batch.admits(n) for n in (1, 2, 5, 6, 10)]
    assert admitted == [False, True, False, True, False]
    calls = _counting_reanalyse(compiled)
    for n in (6, 5, 10):
        _check_against_batches_of_one(model, compiled, _x(n=n, seed=n))
    assert calls == [((5, 4, 4),), ((10, 4, 4),)]


class WithMask(LoopOverTime):
    def forward(self, x, mask=None):
        h = super().forward(x)
        return h if mask is None else h * mask


def test_a_keyword_the_capture_did_not_have_is_captured_again_and_one_the_model_does_not_take_is_refused():
    """torch.export fixes a captured graph's inputs to the example's: a call with a keyword the example did not pass
    (that the model's forward takes) has the model captured again for it, once, and its per-sample gradients are
    exact; a keyword the model's forward does not take either is refused, saying how to compile for it (before,
    torch's own TypeError from the graph's code, naming nothing to do)."""
    torch.manual_seed(0)
    model = WithMask()
    compiled = fxdp.compile_for_dp(model, example_inputs=(_x(),), loss_reduction="sum")
    assert fxdp.report(compiled).front_end == "torch.export"
    x, mask = _x(), torch.randn(3, 2)
    (compiled(x, mask=mask) * 1.0).sum().backward()
    for name, p in model.named_parameters():
        rows = [torch.autograd.grad(model(x[i:i + 1], mask=mask[i:i + 1]).sum(), p)[0] for i in range(len(x))]
        torch.testing.assert_close(p.grad_sample, torch.stack(rows), msg=name)
        del p.grad_sample
    model.zero_grad()
    assert fxdp.report(compiled).notes[-1] == ("torch.export: captured once per input shape seen (2 graphs, kept: "
                                               "x (N, 4, 4); x (N, 4, 4), mask (N, 2))")
    _check_against_batches_of_one(model, compiled, _x(seed=3))  # without the keyword: the first graph again
    with pytest.raises(UnsupportedInputError) as caught:
        compiled(_x(), weights=torch.ones(3, 2))
    assert str(caught.value).startswith(
        "fxdp: the compiled model takes the inputs of the example it was compiled from (x); this call passes 1 "
        "positional, weights= (got an unexpected keyword argument 'weights').")
    assert "example_inputs=dict(input_ids=..., attention_mask=...)" in str(caught.value)
    assert isinstance(caught.value, TypeError)  # what torch raised before, for code that catches it
