"""The validate pass: per-node findings, with the module name and the user's line, for each rule."""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxdp.diagnostics import Kind, Severity
from fxdp.grad_sample.registry import register_grad_sampler
from fxdp.passes.validate import validate_graph
from fxdp.frontends.fx import DPTracer
from fxdp.validators import (
    IllegalModuleConfigurationError,
    ModuleValidator,
    ShouldReplaceModuleError,
    UnsupportedModuleError,
    register_module_validator,
)


def marker_line(marker: str) -> int:
    """Line number in this file of the line ending with ``# <marker>``."""
    lines, _ = inspect.getsourcelines(sys.modules[__name__])
    hits = [number for number, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def findings_of(model, *, strict=False, tracer=None, **kwargs):
    # Not fxdp.frontends.fx.trace: its gm.train(model.training) also resets the (shared) submodules' modes.
    gm = torch.fx.GraphModule(model, (tracer or DPTracer()).trace(model), type(model).__name__)
    gm.training = model.training
    code = gm.code
    kwargs.setdefault("validator_class", ModuleValidator)  # the rules the compiler hands the pass
    result = validate_graph(gm, strict=strict, **kwargs)
    assert result.graph_module is gm and gm.code == code  # the pass changes nothing
    assert result.report.name == "validate" and result.report.changes == ()
    return result.report.findings


def errors(findings):
    return [f for f in findings if f.severity is Severity.ERROR]


def assert_at(finding, marker):
    assert os.path.samefile(finding.location.file, __file__)
    assert finding.location.line == marker_line(marker)


# -- errors ------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.conv(x))  # <block norm>


class Net(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.block = Block(norm)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.block(x).mean((2, 3)))


def test_batch_norm_in_training_is_an_error_at_its_line():
    (finding,) = errors(findings_of(Net(nn.BatchNorm2d(4))))
    assert (finding.pass_name, finding.node, finding.op, finding.kind) == (
        "validate", "block_norm", "nn.BatchNorm2d", Kind.CANNOT_BE_PRIVATE)
    assert finding.message.startswith("`block.norm`: BatchNorm2d normalises each sample with statistics of the "
                                      "whole batch")
    assert "ModuleValidator.fix" in finding.fix
    assert_at(finding, "block norm")


def test_batch_norm_frozen_in_eval_is_fine():
    model = Net(nn.BatchNorm2d(4))
    model.block.norm.eval()
    assert errors(findings_of(model)) == []


def test_instance_norm_with_running_stats_is_an_error():
    (finding,) = errors(findings_of(Net(nn.InstanceNorm2d(4, track_running_stats=True))))
    assert (finding.node, finding.op, finding.kind) == ("block_norm", "nn.InstanceNorm2d", Kind.ILLEGAL_CONFIGURATION)
    assert "`block.norm`" in finding.message and "running_mean/running_var" in finding.message
    assert_at(finding, "block norm")


class FunctionalNorms(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        x = self.fc(x)
        if self.case == "F.batch_norm":
            x = F.batch_norm(x, None, None, training=True)  # <F.batch_norm>
        elif self.case == "torch.batch_norm":
            x = torch.batch_norm(x, None, None, None, None, True, 0.1, 1e-5, False)  # <torch.batch_norm>
        elif self.case == "eval batch norm":
            x = F.batch_norm(x, self.mean, self.var, training=False)
        elif self.case == "F.instance_norm":
            x = F.instance_norm(x.unsqueeze(-1), self.mean, self.var).squeeze(-1)  # <F.instance_norm>
        return x


@pytest.mark.parametrize("case, kind", [
    ("F.batch_norm", Kind.CANNOT_BE_PRIVATE), ("torch.batch_norm", Kind.CANNOT_BE_PRIVATE),
    ("F.instance_norm", Kind.ILLEGAL_CONFIGURATION),
])
def test_functional_norms_that_mix_or_store_batch_statistics(case, kind):
    (finding,) = errors(findings_of(FunctionalNorms(case)))
    assert (finding.op, finding.kind) == (case, kind)
    assert_at(finding, case)


def test_batch_norm_function_in_eval_is_fine():
    assert errors(findings_of(FunctionalNorms("eval batch norm"))) == []


def test_model_not_in_training_mode():
    (finding,) = errors(findings_of(Net(nn.GroupNorm(2, 4)).eval()))
    assert (finding.node, finding.op, finding.kind, finding.location) == (
        "<model>", "Net", Kind.ILLEGAL_CONFIGURATION, None)
    assert finding.fix == "call model.train() before making it private."


class BufferTracer(DPTracer):
    """Records buffers as get_attr nodes (DPTracer itself reads them as constants)."""

    def __init__(self):
        super().__init__()
        self.proxy_buffer_attributes = True


class CountsCalls(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(2))

    def forward(self, x):
        if self.how == "add_":
            self.calls.add_(1)  # <buffer add_>
        else:
            self.calls[0] = x.sum()  # <buffer setitem>
        return self.fc(x)


@pytest.mark.parametrize("how, marker", [("add_", "buffer add_"), ("setitem", "buffer setitem")])
def test_trainable_graph_writing_into_a_buffer_is_an_error(how, marker):
    model = CountsCalls(how)
    (finding,) = errors(findings_of(model, tracer=BufferTracer()))
    assert finding.kind is Kind.CANNOT_BE_PRIVATE
    assert finding.message.startswith("forward writes into buffer `calls` in place")
    assert_at(finding, marker)
    torch.testing.assert_close(model.calls, torch.zeros(2))  # tracing ran nothing


def test_frozen_graph_writing_into_a_buffer_is_not_flagged():
    model = CountsCalls("add_").requires_grad_(False)
    assert errors(findings_of(model, tracer=BufferTracer())) == []


class WritesParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            self.scale.mul_(0.9)  # <parameter write>
        return x * self.scale


def test_graph_writing_into_a_parameter_is_an_error():
    (finding,) = errors(findings_of(WritesParameter()))
    assert finding.op == "Tensor.mul_"
    assert finding.message.startswith("forward writes into parameter `scale` in place")
    assert_at(finding, "parameter write")


class RunningMean(nn.Module):
    """A custom layer with a per-sample rule that updates its buffer in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("running", torch.zeros(3))

    def forward(self, x):
        self.running.mul_(0.9).add_(0.1 * x.mean(0).detach())
        return self.lin(x)



class UsesRunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = RunningMean()

    def forward(self, x):
        return self.layer(x)  # <leaf with buffer>


def test_trainable_leaf_updating_its_buffers_is_an_error():
    register_grad_sampler(RunningMean)(lambda module, activations, backprops: {})  # a leaf for the tracer
    model = UsesRunningMean()
    (finding,) = errors(findings_of(model))
    assert (finding.node, finding.op, finding.kind) == ("layer", "RunningMean", Kind.CANNOT_BE_PRIVATE)
    assert finding.message == ("`layer` (RunningMean) has trainable parameters and updates its buffer `running` "
                               "in forward; state computed from the batch is released without noise.")
    assert_at(finding, "leaf with buffer")
    torch.testing.assert_close(model.layer.running, torch.zeros(3))  # checking it ran nothing


def test_strict_raises_listing_every_error():
    model = Net(nn.BatchNorm2d(4)).eval()
    model.block.norm.train()
    with pytest.raises(UnsupportedModuleError) as info:
        findings_of(model, strict=True)
    errs = info.value.errors
    assert [(type(e), e.module_name, e.type_name) for e in errs] == [
        (IllegalModuleConfigurationError, "<model>", "Net"),
        (UnsupportedModuleError, "block_norm", "nn.BatchNorm2d"),
    ]
    text = str(info.value)
    assert text.splitlines()[0] == "2 problem(s) prevent training Net with DP-SGD:"
    assert f"`block_norm` (nn.BatchNorm2d) at {__file__}:{marker_line('block norm')}: " in text


def test_strict_does_not_raise_for_notes_only():
    model = Net(nn.GroupNorm(2, 4))
    model.fc.requires_grad_(False)
    findings = findings_of(model, strict=True)
    assert findings and all(f.severity is Severity.INFO for f in findings)


def test_user_validators_run_on_called_modules():
    class Widget(nn.Module):
        def forward(self, x):
            return x * 2

    register_grad_sampler(Widget)(lambda module, activations, backprops: {})  # a leaf for the tracer

    class OwnRules(ModuleValidator):
        pass

    @register_module_validator(Widget, validator_class=OwnRules)
    def _no_widgets(module, **kwargs):
        return [ShouldReplaceModuleError("widgets are deprecated", fix="use a gadget")]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.widget = Widget()

        def forward(self, x):
            return self.widget(x)  # <widget>

    assert errors(findings_of(Model())) == []
    (finding,) = errors(findings_of(Model(), validator_class=OwnRules))
    assert (finding.node, finding.op, finding.kind, finding.message, finding.fix) == (
        "widget", "Widget", Kind.SHOULD_BE_REPLACED, "widgets are deprecated", "use a gadget")
    assert_at(finding, "widget")


# -- notes -------------------------------------------------------------------------------------------------


def notes(findings):
    return [f for f in findings if f.severity is Severity.INFO]


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(3, 3)
        self.decoder = nn.Linear(3, 3)
        self.decoder.weight = self.encoder.weight  # tied weights
        self.frozen = nn.Linear(3, 3).requires_grad_(False)
        self.twice = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = self.encoder(x)  # <encoder>
        h = self.decoder(h) + self.frozen(h)  # <decoder>
        h = self.twice(self.twice(h))  # <twice>
        return h * self.scale + self.scale  # <scale>


def test_frozen_and_shared_parameters_are_noted():
    findings = findings_of(Shared())
    assert errors(findings) == []
    by_message = {f.message: f for f in notes(findings)}
    frozen = by_message["`frozen` has frozen parameters (requires_grad=False): `weight`, `bias`; they get no "
                        "per-sample gradients and are not updated."]
    assert (frozen.node, frozen.op) == ("frozen", "nn.Linear")
    assert_at(frozen, "decoder")
    tied = by_message["parameter `encoder.weight` (also reachable as `decoder.weight`) is used by 2 node(s): "
                      "encoder, decoder; its per-sample gradient is the sum over these uses."]
    assert_at(tied, "encoder")
    twice_w = by_message["parameter `twice.weight` is used by 2 node(s): twice, twice_1; its per-sample gradient "
                         "is the sum over these uses."]
    assert_at(twice_w, "twice")
    assert "parameter `twice.bias` is used by 2 node(s): twice, twice_1; its per-sample gradient is the sum over " \
           "these uses." in by_message
    scale = by_message["parameter `scale` is used by 2 node(s): mul, add_1; its per-sample gradient is the sum "
                       "over these uses."]
    assert_at(scale, "scale")
    assert not any("encoder.bias" in m or "decoder.bias" in m for m in by_message)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.weight


class RuledCustom(Custom):
    pass



class KeepsCustomLeaves(DPTracer):
    def is_leaf_module(self, m, qualified_name):
        return isinstance(m, Custom) or super().is_leaf_module(m, qualified_name)


class TwoCustoms(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = Custom()
        self.ruled = RuledCustom()

    def forward(self, x):
        return self.ruled(self.plain(x))  # <customs>


def test_parametrised_leaf_without_a_rule_is_noted():
    register_grad_sampler(RuledCustom)(lambda module, activations, backprops: {})
    findings = findings_of(TwoCustoms(), tracer=KeepsCustomLeaves())
    (finding,) = [f for f in findings if "per-sample gradient rule" in f.message]
    assert (finding.node, finding.op, finding.kind, finding.severity) == ("plain", "Custom", Kind.NOTE, Severity.INFO)
    assert finding.message == ("`plain` (Custom) has no hand-written per-sample gradient rule; it will use the "
                               "generic functorch rule (correct, usually slower).")
    assert_at(finding, "customs")
