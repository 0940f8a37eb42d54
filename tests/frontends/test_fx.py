"""The torch.fx front end: tracing records the user's lines, says why a model cannot be traced (and where),
and traces an input defaulting to None as None; the report renders what the passes found; a failing pass is
named."""


import pytest
import torch
from torch import nn

import fxdp
from fxdp import compiler
from fxdp.frontends.fx import source_location, trace
from tests.support.source_lines import line_of


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.fc(x)
        out += x
        return self.act(out)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.mean() > 0:
            x = x * 2
        return self.fc(x)


def test_every_node_knows_the_users_line():
    gm = trace(Residual()).graph_module
    lines = {n.name: source_location(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    assert lines["fc"].file == __file__ and lines["fc"].line == line_of(Residual.forward, "out = self.fc(x)")
    assert lines["iadd"].line == line_of(Residual.forward, "out += x")
    assert lines["iadd"].code == "out += x"
    assert lines["act"].line == line_of(Residual.forward, "return self.act(out)")


def test_an_untraceable_model_gives_the_reason_and_the_line():
    result = trace(DataDependent())
    assert not result.ok
    assert "TraceError" in result.reason and "control flow" in result.reason
    assert result.location.file == __file__
    assert result.location.line == line_of(DataDependent.forward, "if x.mean() > 0:")


def test_the_report_renders_passes_changes_and_findings():
    rep = fxdp.inspect(Residual(), torch.randn(3, 4))
    text = str(rep)
    assert text.startswith("fxdp compile report for Residual\ntraced: yes (torch.fx); engine: fx")
    for name in ("validate", "inplace", "batch_dim"):
        assert name in text
    line = line_of(Residual.forward, "out += x")
    assert "`out += x` rewritten as `out = out + x`" in text
    assert [c.location.line for c in rep.pass_report("inplace").changes if c.op.startswith("operator.iadd")] == [line]


def test_the_report_of_an_untraceable_model_says_so():
    text = str(fxdp.inspect(DataDependent(), torch.randn(3, 4)))
    assert "traced: no, falling back to the hooks engine (GradSampleModule)" in text
    assert f"at {__file__}:{line_of(DataDependent.forward, 'if x.mean() > 0:')}" in text


def test_a_failing_pass_is_named_and_keeps_its_cause(monkeypatch):
    def broken(gm, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(compiler, "remove_inplace_ops", broken)
    with pytest.raises(fxdp.errors.PassError, match="fxdp pass 'inplace' failed: KeyError") as info:
        fxdp.compile_for_dp(Residual(), torch.randn(3, 4))
    assert isinstance(info.value.__cause__, KeyError)


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, mask=None):
        if mask is not None:
            x = x * mask
        return self.fc(x)


def test_an_input_defaulting_to_none_is_traced_as_none_and_said_so():
    x = torch.randn(3, 4)
    compiled = fxdp.compile_for_dp(OptionalMask(), x)
    assert "traced with mask = None" in str(fxdp.report(compiled))
    compiled(x).sum().backward()
    with pytest.raises(AssertionError, match="mask has been specialized to have value None"):
        compiled(x, torch.ones(3, 4))


def test_an_input_defaulting_to_none_that_the_example_gives_is_traced():
    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    model = OptionalMask()
    compiled = fxdp.compile_for_dp(model, (x, mask))
    assert "traced with" not in str(fxdp.report(compiled))
    torch.testing.assert_close(compiled(x, mask), model(x, mask))
