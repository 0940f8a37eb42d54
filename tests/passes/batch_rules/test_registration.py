"""fxdp.register_batch_rule: a user's rule for a custom op or a layer is used by the analysis (and serves
subclasses); strict mode points at it; the worked example in docs/batch_dim.md runs and prints what it says."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdp
from fxdp.diagnostics import Kind, Severity
from fxdp.layout import BatchLayout
from fxdp.passes.batch_rules import OpCall, Verdict, carries_batch, find_batch_rule, restore_batch_rules, snapshot_batch_rules


@pytest.fixture
def restore_batch_rule_registry():
    saved = snapshot_batch_rules()
    yield
    restore_batch_rules(saved)


@torch.fx.wrap
def mix_rows(x, dim):
    """A custom op torch.fx keeps as one node: a softmax along ``dim``."""
    return torch.softmax(x, dim)


class UsesMixRows(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(mix_rows(x, self.dim))


def test_a_rule_registered_through_fxdp_is_used_by_find_batch_dim_violations(restore_batch_rule_registry):
    x = torch.randn(4, 6)
    before = fxdp.find_batch_dim_violations(UsesMixRows(dim=1), x)
    assert [(f.kind, f.node) for f in before] == [(Kind.UNVERIFIED, "mix_rows")]
    assert "fxdp.register_batch_rule" in before[0].fix

    calls = []

    @fxdp.register_batch_rule(mix_rows)
    def mix_rows_rule(call: OpCall) -> Verdict:
        calls.append(call.arg(1, "dim"))
        layout = call.arg_layouts[0]
        if carries_batch(layout) and layout.dim == call.arg(1, "dim") % call.args[0].dim():
            return Verdict(layout, mixes="normalises across samples", fix="use dim=-1")
        return Verdict(layout)

    assert find_batch_rule(mix_rows) is mix_rows_rule
    assert fxdp.find_batch_dim_violations(UsesMixRows(dim=1), x) == []
    mixing = fxdp.find_batch_dim_violations(UsesMixRows(dim=0), x)
    assert [(f.kind, f.severity, f.node, f.message, f.fix) for f in mixing] == [
        (Kind.MIXES_SAMPLES, Severity.ERROR, "mix_rows", "normalises across samples", "use dim=-1")]
    assert calls == [1, 0]
    assert "register_batch_rule" in fxdp.__all__


def test_strict_mode_points_at_fxdp_register_batch_rule():
    from fxdp.passes.batch_dim import MissingBatchRuleError, propagate_batch_dim
    from fxdp.frontends.fx import trace

    gm = trace(UsesMixRows(dim=1)).graph_module
    with pytest.raises(MissingBatchRuleError, match=re.escape("Register a rule with fxdp.register_batch_rule(")):
        propagate_batch_dim(gm, torch.randn(4, 6), strict=True)


def test_a_layer_rule_registered_for_a_base_class_serves_subclasses(restore_batch_rule_registry):
    class MyLinear(nn.Linear):
        pass

    @fxdp.register_batch_rule(nn.Linear)
    def my_rule(call):
        return Verdict(BatchLayout.at(0))

    assert find_batch_rule(MyLinear(2, 2)) is my_rule


def test_the_worked_example_in_the_docs_runs_and_prints_what_it_says(restore_batch_rule_registry, capsys):
    doc = (Path(__file__).resolve().parents[3] / "docs" / "batch_dim.md").read_text()
    example = re.search(r"```python\n(import torch\nfrom torch import nn\n.*?)```", doc, re.S).group(1)
    expected = [line.rsplit("# ", 1)[1] for line in example.splitlines() if line.startswith("print(")]
    exec(compile(example, "docs/batch_dim.md", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out.splitlines() == expected == ["['unverified']", "[]", "['mixes samples']"]
