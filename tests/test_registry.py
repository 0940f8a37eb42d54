"""The registry helper (fxdp.registry.TypeRegistry) and the public batch-rule registration."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdp
from fxdp.diagnostics import Kind, Severity
from fxdp.layout import BatchLayout
from fxdp.passes.batch_rules import (
    OpCall,
    Verdict,
    find_batch_rule,
    per_sample,
    restore_batch_rules,
    snapshot_batch_rules,
)
from fxdp.registry import TypeRegistry, find_in


@pytest.fixture
def restore_batch_rule_registry():
    saved = snapshot_batch_rules()
    yield
    restore_batch_rules(saved)


# --------------------------------------------------------------------------------------------
# TypeRegistry
# --------------------------------------------------------------------------------------------


class Base:
    pass


class Child(Base):
    pass


class GrandChild(Child):
    pass


def test_register_accepts_a_type_or_a_collection_and_lookup_walks_the_mro():
    registry = TypeRegistry()
    registry.register(Base)("base rule")
    assert registry.find(GrandChild()) == "base rule"  # an instance
    assert registry.find(Child) == "base rule"  # a class
    assert registry.owner(GrandChild) is Base
    registry.register([Child, int])("child rule")
    assert registry.find(GrandChild) == "child rule" and registry.find(3) == "child rule"
    assert registry.find(Base()) == "base rule"
    assert registry.find("text") is None and registry.owner(str) is None


def test_the_last_registration_wins_and_snapshots_restore():
    registry = TypeRegistry()
    registry.register((Base,))("first")
    saved = registry.snapshot()
    registry.register({Base})("second")
    assert registry.find(Child) == "second"
    registry.restore(saved)
    assert registry.find(Child) == "first"


def test_a_base_class_restricts_what_may_be_registered():
    registry = TypeRegistry(nn.Module, "only modules, got {!r}")
    with pytest.raises(TypeError, match=re.escape("only modules, got <class 'int'>")):
        registry.register([nn.Linear, int])
    with pytest.raises(TypeError, match="only modules"):
        registry.register("nn.Linear")
    assert registry.find(nn.Linear) is None  # nothing of a refused registration is kept


def test_find_in_prefers_the_most_specific_class_then_the_first_registry():
    own, parent = TypeRegistry(), TypeRegistry()
    parent.register(Child)("parent's child rule")
    own.register(Base)("own base rule")
    parent.register(GrandChild)("parent's grandchild rule")
    own.register(GrandChild)("own grandchild rule")
    assert find_in([own, parent], GrandChild) == "own grandchild rule"
    assert find_in([own, parent], Child) == "parent's child rule"  # more specific beats own registry
    assert find_in([own, parent], Base) == "own base rule"


def test_a_lookup_is_remembered_only_until_the_registrations_change():
    """find() remembers its answer per class; any change to the registrations (register, restore, the dict
    edited directly as tests do) is seen by the next lookup."""
    registry = TypeRegistry(unless_overridden="forward")
    registry.register(Base)("base rule")
    assert registry.find(GrandChild) == "base rule"
    registry.register(Child)("child rule")  # more specific, after the first lookup
    assert registry.find(GrandChild()) == "child rule"
    saved = registry.snapshot()
    registry.entries[Child] = "edited rule"
    assert registry.find(GrandChild) == "edited rule"
    del registry.entries[Child]
    assert registry.find(GrandChild) == "base rule"
    registry.entries.pop(Base)
    assert registry.find(GrandChild) is None
    registry.restore(saved)
    assert registry.find(GrandChild) == "child rule"


def test_an_instance_that_replaced_the_method_is_not_answered_from_its_class():
    class Layer(nn.Linear):
        pass

    registry = TypeRegistry(unless_overridden="forward")
    registry.register(nn.Linear)("linear rule")
    plain, patched = Layer(2, 2), Layer(2, 2)
    assert registry.find(plain) == "linear rule"
    patched.forward = lambda x: 2 * x
    assert registry.find(patched) is None
    assert registry.find(plain) == "linear rule"


def test_a_class_whose_method_is_replaced_after_a_lookup_is_looked_up_again():
    class Layer(nn.Linear):
        pass

    class Deeper(Layer):
        pass

    registry = TypeRegistry(unless_overridden="forward")
    registry.register(nn.Linear)("linear rule")
    assert registry.find(Deeper(2, 2)) == "linear rule" and registry.find(Layer) == "linear rule"
    Layer.forward = lambda self, x: 2 * x  # now computes something else: the Linear rule no longer applies
    assert registry.find(Deeper(2, 2)) is None and registry.find(Layer) is None
    del Layer.forward
    assert registry.find(Deeper) == "linear rule"


def test_grad_sampler_registry_keeps_its_type_check():
    with pytest.raises(TypeError, match="register_grad_sampler expects nn.Module subclasses"):
        fxdp.register_grad_sampler(torch.Tensor)


# --------------------------------------------------------------------------------------------
# fxdp.register_batch_rule
# --------------------------------------------------------------------------------------------


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
        if per_sample(layout) and layout.dim == call.arg(1, "dim") % call.args[0].dim():
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
    from fxdp.tracing import trace

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
    doc = (Path(__file__).resolve().parents[1] / "docs" / "batch_dim.md").read_text()
    example = re.search(r"```python\n(import torch\nfrom torch import nn\n.*?)```", doc, re.S).group(1)
    expected = [line.rsplit("# ", 1)[1] for line in example.splitlines() if line.startswith("print(")]
    exec(compile(example, "docs/batch_dim.md", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out.splitlines() == expected == ["['unverified']", "[]", "['mixes samples']"]
