"""ModuleValidator: validate / is_valid / fix / fix_and_validate, the error taxonomy, registration."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from torch import nn

from fxdp.diagnostics import Kind, Severity
from fxdp.errors import BatchNormModuleError
from fxdp.validators import (
    IllegalModuleConfigurationError,
    ModuleFixWarning,
    ModuleValidator,
    NotYetSupportedModuleError,
    ShouldReplaceModuleError,
    UnsupportedError,
    UnsupportedModuleError,
    register_module_fixer,
    register_module_validator,
)
from fxdp.validators.batch_norm import LazyGroupNorm


class ConvBN(nn.Module):
    def __init__(self, norm=None, channels=8):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3)
        self.bn = norm if norm is not None else nn.BatchNorm2d(channels)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(channels, 2)

    def forward(self, x):
        return self.fc(self.act(self.bn(self.conv(x))).mean((2, 3)))


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(model, saved):
    now = model.state_dict()
    assert list(now) == list(saved)
    for key, value in saved.items():
        torch.testing.assert_close(now[key], value)


# -- validate -------------------------------------------------------------------------------------------


def test_batch_norm_in_training_cannot_be_made_private():
    errors = ModuleValidator.validate(ConvBN())
    (error,) = errors
    assert type(error) is BatchNormModuleError and isinstance(error, UnsupportedModuleError)
    # also the class Opacus's validator reports for a BatchNorm, for code written for Opacus that looks for it
    assert isinstance(error, ShouldReplaceModuleError) and isinstance(error, ValueError)
    assert error.module_name == "bn" and error.module_type is nn.BatchNorm2d
    assert error.kind is Kind.CANNOT_BE_PRIVATE
    assert "ModuleValidator.fix" in error.fix and "GroupNorm" in error.fix
    assert str(error).startswith("`bn` (nn.BatchNorm2d): BatchNorm2d normalises each sample with statistics of "
                                 "the whole batch")
    assert not ModuleValidator.is_valid(ConvBN())


@pytest.mark.parametrize("make", [
    lambda: nn.BatchNorm1d(8), lambda: nn.BatchNorm2d(8), lambda: nn.BatchNorm3d(8), lambda: nn.SyncBatchNorm(8),
    lambda: nn.LazyBatchNorm2d(),
])
def test_every_batch_norm_kind_is_flagged(make):
    model = nn.Sequential(nn.Linear(8, 8), make())
    (error,) = ModuleValidator.validate(model)
    assert error.module_name == "1" and isinstance(error, UnsupportedModuleError)


def test_subclass_of_batch_norm_is_covered():
    class MyBN(nn.BatchNorm2d):
        pass

    (error,) = ModuleValidator.validate(ConvBN(MyBN(8)))
    assert error.module_type is MyBN and error.type_name == "MyBN"
    fixed = ModuleValidator.fix(ConvBN(MyBN(8)))
    assert type(fixed.bn) is nn.GroupNorm


def test_batch_norm_frozen_with_running_statistics_is_allowed_but_not_without():
    model = ConvBN()
    model.bn.eval()  # uses its running statistics: each sample normalised on its own
    assert ModuleValidator.validate(model) == []
    no_stats = ConvBN(nn.BatchNorm2d(8, track_running_stats=False))
    no_stats.bn.eval()  # without running statistics it still normalises with the batch's
    (error,) = ModuleValidator.validate(no_stats)
    assert error.module_name == "bn"


def test_instance_norm_with_running_stats_is_an_illegal_configuration():
    (error,) = ModuleValidator.validate(ConvBN(nn.InstanceNorm2d(8, track_running_stats=True)))
    assert type(error) is IllegalModuleConfigurationError
    assert error.kind is Kind.ILLEGAL_CONFIGURATION and error.module_name == "bn"
    assert "track_running_stats=False" in error.fix
    assert ModuleValidator.validate(ConvBN(nn.InstanceNorm2d(8))) == []


def test_model_in_eval_mode_is_an_illegal_configuration():
    model = ConvBN(nn.GroupNorm(2, 8)).eval()
    (error,) = ModuleValidator.validate(model)
    assert type(error) is IllegalModuleConfigurationError
    assert error.module_name == "<model>" and error.module_type is ConvBN
    assert str(error) == ("`<model>` (ConvBN): the model is in eval mode; DP-SGD trains it, and layers such as "
                          "Dropout and the per-sample gradient computation need training mode. How to fix: call "
                          "model.train() before making it private.")


def test_strict_validation_raises_every_error_at_once():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.InstanceNorm2d(4, track_running_stats=True))
    model.eval()
    model[1].train()
    with pytest.raises(UnsupportedModuleError) as info:
        ModuleValidator.validate(model, strict=True)
    errors = info.value.errors
    assert [(type(e), e.module_name) for e in errors] == [
        (IllegalModuleConfigurationError, "<model>"), (BatchNormModuleError, "1"),
        (IllegalModuleConfigurationError, "2"),
    ]
    text = str(info.value)
    assert text.splitlines()[0].startswith("3 problem(s) prevent training this model with DP-SGD")
    assert "\n  - `1` (nn.BatchNorm2d): " in text and "\n  - `2` (nn.InstanceNorm2d): " in text


def test_valid_model_returns_no_errors_even_when_strict():
    model = ConvBN(nn.GroupNorm(2, 8))
    assert ModuleValidator.validate(model, strict=True) == []
    assert ModuleValidator.is_valid(model)


def test_error_taxonomy_maps_to_kinds_and_findings():
    for cls, kind in [(UnsupportedModuleError, Kind.CANNOT_BE_PRIVATE),
                      (ShouldReplaceModuleError, Kind.SHOULD_BE_REPLACED),
                      (IllegalModuleConfigurationError, Kind.ILLEGAL_CONFIGURATION),
                      (NotYetSupportedModuleError, Kind.NOT_YET_SUPPORTED)]:
        error = cls("msg", module_name="enc.lstm", module_type=nn.LSTM, fix="do this")
        assert isinstance(error, UnsupportedError) and isinstance(error, ValueError)
        assert error.kind is kind
        finding = error.to_finding()
        assert (finding.pass_name, finding.node, finding.op, finding.kind, finding.severity, finding.message,
                finding.fix) == ("validate", "enc.lstm", "nn.LSTM", kind, Severity.ERROR, "msg", "do this")
        assert str(error) == "`enc.lstm` (nn.LSTM): msg How to fix: do this"


# -- fix ----------------------------------------------------------------------------------------------------


def test_fix_replaces_batch_norm_with_group_norm_on_a_copy():
    model = ConvBN(channels=48)
    with torch.no_grad():
        model.bn.weight.uniform_()
        model.bn.bias.uniform_()
    saved = state(model)
    fixed = ModuleValidator.fix(model)
    # The user's model is untouched.
    assert type(model.bn) is nn.BatchNorm2d and model.act.inplace is True
    assert_same_state(model, saved)
    # The copy: GroupNorm with gcd(32, 48) = 16 groups, same affine parameters (copied, not shared).
    assert type(fixed.bn) is nn.GroupNorm
    assert (fixed.bn.num_groups, fixed.bn.num_channels, fixed.bn.eps, fixed.bn.affine) == (16, 48, 1e-5, True)
    torch.testing.assert_close(fixed.bn.weight, model.bn.weight)
    assert fixed.bn.weight is not model.bn.weight and fixed.conv.weight is not model.conv.weight
    assert fixed.act.inplace is False
    assert ModuleValidator.validate(fixed) == []
    # Samples no longer influence each other: changing sample 1 leaves sample 0's output alone.
    x = torch.randn(2, 3, 6, 6)
    x2 = x.clone()
    x2[1] = torch.randn(3, 6, 6)
    torch.testing.assert_close(fixed(x)[0], fixed(x2)[0])
    assert not torch.allclose(model(x)[0], model(x2)[0])


@pytest.mark.parametrize("channels, groups", [(8, 8), (3, 1), (64, 32), (12, 4)])
def test_default_groups_over_positions_are_gcd_of_32_and_channels(channels, groups):
    fixed = ModuleValidator.fix(nn.Sequential(nn.BatchNorm2d(channels)))
    assert (fixed[0].num_groups, fixed[0].num_channels) == (groups, channels)
    # a BatchNorm1d seen over (N, C, L) by the example forward: the same groups
    fixed = ModuleValidator.fix(nn.Sequential(nn.BatchNorm1d(channels)), example_inputs=torch.randn(2, channels, 5))
    assert (type(fixed[0]), fixed[0].num_groups, fixed[0].num_channels) == (nn.GroupNorm, groups, channels)


def test_num_groups_is_passed_to_the_fixer():
    fixed = ModuleValidator.fix(ConvBN(), num_groups=2)
    assert fixed.bn.num_groups == 2
    with pytest.raises(ValueError) as info:
        ModuleValidator.fix(ConvBN(), num_groups=3)
    assert str(info.value) == (
        "cannot fix `bn` (nn.BatchNorm2d): GroupNorm needs num_groups to divide the number of channels: "
        "num_groups=3, channels=8; pass num_groups=... to ModuleValidator.fix, a divisor of 8")


@pytest.mark.parametrize("make", [
    lambda: nn.BatchNorm3d(4, affine=False), lambda: nn.SyncBatchNorm(4), lambda: nn.BatchNorm1d(4),
])
def test_fix_covers_every_batch_norm_kind(make):
    bn = make()
    model = nn.Sequential(bn)
    fixed = ModuleValidator.fix(model)
    assert type(fixed[0]) is nn.GroupNorm and fixed[0].affine == bn.affine and fixed[0].num_channels == 4
    assert model[0] is bn


def test_fix_replaces_an_uninitialised_lazy_batch_norm():
    model = nn.Sequential(nn.Conv2d(3, 12, 1), nn.LazyBatchNorm2d())
    fixed = ModuleValidator.fix(model)
    assert isinstance(fixed[1], LazyGroupNorm)
    out = fixed(torch.randn(2, 3, 4, 4))
    assert type(fixed[1]) is nn.GroupNorm and (fixed[1].num_groups, fixed[1].num_channels) == (4, 12)
    assert out.shape == (2, 12, 4, 4)
    assert ModuleValidator.validate(fixed) == []
    assert isinstance(model[1], nn.LazyBatchNorm2d)


def test_fix_turns_instance_norm_running_stats_off():
    model = ConvBN(nn.InstanceNorm2d(8, affine=True, track_running_stats=True))
    fixed = ModuleValidator.fix(model)
    assert fixed.bn.track_running_stats is False and fixed.bn.running_mean is None
    assert not any("running" in k or "num_batches" in k for k in fixed.state_dict())
    assert ModuleValidator.validate(fixed) == []
    assert model.bn.track_running_stats is True and model.bn.running_mean is not None
    fixed(torch.randn(2, 3, 5, 5))  # still runs


@pytest.mark.parametrize("make", [
    lambda: nn.ReLU(inplace=True), lambda: nn.ReLU6(inplace=True), lambda: nn.LeakyReLU(inplace=True),
    lambda: nn.ELU(inplace=True), lambda: nn.SELU(inplace=True), lambda: nn.CELU(inplace=True),
    lambda: nn.SiLU(inplace=True), lambda: nn.Hardswish(inplace=True), lambda: nn.Hardsigmoid(inplace=True),
    lambda: nn.Hardtanh(inplace=True), lambda: nn.Mish(inplace=True), lambda: nn.Threshold(0.1, 0, inplace=True),
    lambda: nn.RReLU(inplace=True), lambda: nn.Dropout(inplace=True), lambda: nn.Dropout2d(inplace=True),
    lambda: nn.AlphaDropout(inplace=True),
])
def test_fix_turns_inplace_flags_off(make):
    model = nn.Sequential(nn.Linear(3, 3), make())
    fixed = ModuleValidator.fix(model)
    assert model[1].inplace is True and fixed[1].inplace is False and type(fixed[1]) is type(model[1])


def test_fix_turns_off_the_flag_of_any_module_with_one():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.inplace = True

        def forward(self, x):
            return x.relu_() if self.inplace else x.relu()

    model = nn.Sequential(Custom())
    assert ModuleValidator.fix(model)[0].inplace is False and model[0].inplace is True


def test_fix_keeps_a_shared_module_shared():
    bn = nn.BatchNorm1d(4)
    model = nn.ModuleDict({"a": nn.Sequential(bn), "b": nn.Sequential(bn)})
    fixed = ModuleValidator.fix(model)
    assert type(fixed["a"][0]) is nn.GroupNorm and fixed["a"][0] is fixed["b"][0]


def test_fix_a_root_batch_norm():
    fixed = ModuleValidator.fix(nn.BatchNorm2d(6))
    assert type(fixed) is nn.GroupNorm and fixed.num_groups == 2


def test_fix_and_validate():
    with pytest.warns(ModuleFixWarning) as record:
        fixed = ModuleValidator.fix_and_validate(ConvBN())
    assert type(fixed.bn) is nn.GroupNorm
    assert os.path.samefile(record[0].filename, __file__)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert isinstance(ModuleValidator.fix_and_validate(model, example_inputs=torch.randn(2, 3))[1], nn.LayerNorm)
    with pytest.raises(UnsupportedModuleError) as info:
        ModuleValidator.fix_and_validate(ConvBN().eval())
    assert [type(e) for e in info.value.errors] == [IllegalModuleConfigurationError]


# -- fix(remove_inplace_ops=True) --------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.bn(self.fc(x))
        out += x
        out.mul_(2)
        return self.act(out)


def test_fix_with_remove_inplace_ops_returns_a_graph_module_and_warns():
    model = Residual()
    with pytest.warns(UserWarning) as record:
        fixed = ModuleValidator.fix(model, remove_inplace_ops=True)
    replaced, warning = record
    assert replaced.category is ModuleFixWarning and warning.category is UserWarning
    assert os.path.samefile(replaced.filename, __file__)
    assert replaced.message.changes == (("bn", "nn.BatchNorm1d(4)", "nn.GroupNorm(1, 4)"),)
    assert os.path.samefile(warning.filename, __file__)  # stacklevel=2: points at the caller
    assert str(warning.message).startswith(
        "ModuleValidator.fix(remove_inplace_ops=True) returns a torch.fx.GraphModule, not a Residual")
    assert "(2 in-place op(s) rewritten)" in str(warning.message)
    assert isinstance(fixed, torch.fx.GraphModule) and type(fixed).__name__ == "Residual"
    ops = {(n.op, str(n.target)) for n in fixed.graph.nodes}
    assert ("call_method", "mul") in ops and not any(t.endswith("_") or "iadd" in t for _, t in ops)
    assert type(fixed.bn) is nn.GroupNorm and fixed.act.inplace is False
    assert ModuleValidator.validate(fixed) == []
    # Outputs equal those of the module-level fix alone (in-place and out-of-place agree).
    reference = ModuleValidator.fix(model)
    reference.load_state_dict(fixed.state_dict())
    x = torch.randn(3, 4)
    torch.testing.assert_close(fixed(x), reference(x))
    assert type(model.bn) is nn.BatchNorm1d and model.act.inplace is True


def test_fix_of_an_untraceable_model_logs_why_and_returns_the_module(caplog, recwarn):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: not traceable
                x = x * 2
            x += 1
            return self.bn(x)

    with caplog.at_level(logging.INFO, logger="fxdp"):
        fixed = ModuleValidator.fix(Branchy(), remove_inplace_ops=True)
    assert type(fixed) is Branchy and type(fixed.bn) is nn.GroupNorm
    (record,) = [r for r in caplog.records if r.name == "fxdp"]
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert message.startswith("ModuleValidator.fix(remove_inplace_ops=True): Branchy cannot be traced (TraceError:")
    assert f"{__file__}:" in message and "returning it with the module-level fixes only" in message
    # only the replacement is reported, no GraphModule warning
    assert [w.category for w in recwarn if issubclass(w.category, UserWarning)] == [ModuleFixWarning]


# -- registration ---------------------------------------------------------------------------------------------


class Gadget(nn.Module):
    def __init__(self, legal=True):
        super().__init__()
        self.legal = legal
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x)


class SubGadget(Gadget):
    pass


@register_module_validator(Gadget)
def _validate_gadget(module, **kwargs):
    if module.legal:
        return []
    return [ShouldReplaceModuleError("gadgets must be legal", fix="use a legal gadget")]


@register_module_fixer([Gadget])
def _fix_gadget(module, *, legal_after_fix=True, **kwargs):
    module.legal = legal_after_fix
    return module


def test_custom_validator_and_fixer_cover_subclasses():
    model = nn.Sequential(Gadget(legal=False), SubGadget(legal=False))
    errors = ModuleValidator.validate(model)
    assert [(type(e), e.module_name, e.module_type, e.message) for e in errors] == [
        (ShouldReplaceModuleError, "0", Gadget, "gadgets must be legal"),
        (ShouldReplaceModuleError, "1", SubGadget, "gadgets must be legal"),
    ]
    assert ModuleValidator.validate(ModuleValidator.fix(model)) == []
    assert not model[0].legal  # the original is untouched
    assert len(ModuleValidator.validate(ModuleValidator.fix(model, legal_after_fix=False))) == 2  # kwargs reach fixers


def test_validator_subclass_has_its_own_registry_and_inherits_the_defaults():
    class StrictValidator(ModuleValidator):
        pass

    @register_module_validator(nn.Linear, validator_class=StrictValidator)
    def _no_linear(module, **kwargs):
        return [NotYetSupportedModuleError("no linear layers here")]

    @register_module_validator(nn.BatchNorm2d, validator_class=StrictValidator)
    def _bn_is_fine(module, **kwargs):
        return []

    @register_module_fixer(nn.Linear, validator_class=StrictValidator)
    def _linear_to_identity(module, **kwargs):
        return nn.Identity()

    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.BatchNorm2d(2))
    strict_errors = StrictValidator.validate(model)
    # Linear: its own rule; BatchNorm1d: the inherited default; BatchNorm2d: overridden by the subclass.
    assert [(type(e), e.module_name) for e in strict_errors] == [
        (NotYetSupportedModuleError, "0"), (BatchNormModuleError, "1")]
    assert [e.module_name for e in ModuleValidator.validate(model)] == ["1", "2"]  # defaults unaffected
    assert StrictValidator.find_validator(nn.BatchNorm1d) is ModuleValidator.find_validator(nn.BatchNorm1d)
    fixed = StrictValidator.fix(model)
    assert [type(m) for m in fixed] == [nn.Identity, nn.GroupNorm, nn.GroupNorm]
    assert type(ModuleValidator.fix(model)[0]) is nn.Linear


def test_registration_rejects_what_is_not_a_module_type():
    with pytest.raises(TypeError, match="expected nn.Module subclasses"):
        register_module_validator(int)
    with pytest.raises(TypeError, match="validator_class must be ModuleValidator or a subclass"):
        register_module_fixer(nn.Linear, validator_class=object)


def test_a_fixer_must_return_a_module():
    class Broken(ModuleValidator):
        pass

    @register_module_fixer(nn.Linear, validator_class=Broken)
    def _bad(module, **kwargs):
        return None

    with pytest.raises(TypeError, match="the fixer '_bad' for nn.Linear returned NoneType"):
        Broken.fix(nn.Sequential(nn.Linear(2, 2)))


def test_fix_does_not_share_state_with_the_original():
    model = ConvBN(nn.GroupNorm(2, 8))
    fixed = ModuleValidator.fix(model)
    with torch.no_grad():
        fixed.fc.weight.add_(1.0)
    assert not torch.allclose(fixed.fc.weight, model.fc.weight)


# -- fix keeps the model's output a function of its input (issue #10, situation 9) -------------------------


def affine_bn(make, channels):
    bn = make(channels)
    with torch.no_grad():  # a non-trivial scale and shift, so "the output is its bias" shows
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    return nn.Sequential(bn)


def assert_output_depends_on_input(model, shape):
    """Per sample: another input changes the output; another sample's input does not."""
    torch.manual_seed(0)
    x, other = torch.randn(shape), torch.randn(shape)
    out, out_other = model(x), model(other)
    for i in range(shape[0]):
        assert not torch.allclose(out[i], out_other[i], atol=1e-3), f"sample {i}'s output ignores its input"
    mixed = x.clone()
    mixed[1:] = other[1:]
    torch.testing.assert_close(model(mixed)[0], out[0])  # samples still independent


def fix_reporting(model, **kwargs):
    with pytest.warns(ModuleFixWarning) as record:
        fixed = ModuleValidator.fix(model, **kwargs)
    (warning,) = [w for w in record if w.category is ModuleFixWarning]
    return fixed, warning.message


def test_the_input_dependence_check_catches_a_group_per_channel_over_features():
    # What fix produced for BatchNorm1d over (N, C) before: GroupNorm(C, C), whose output is its bias.
    model = nn.Sequential(nn.GroupNorm(8, 8))
    with torch.no_grad():
        model[0].bias.uniform_(-1, 1)
    with pytest.raises(AssertionError, match="ignores its input"):
        assert_output_depends_on_input(model, (4, 8))


def gcd32(c):
    return math.gcd(32, c)


BN_CASES = [  # (layer, input shape, replacement with example_inputs, replacement without)
    *[(nn.BatchNorm1d, (4, c), ("LayerNorm", c), ("GroupNorm", 1, c)) for c in (3, 32, 64)],
    *[(nn.BatchNorm1d, (4, c, 5), ("GroupNorm", gcd32(c), c), ("GroupNorm", 1, c)) for c in (3, 32, 64)],
    (nn.BatchNorm1d, (4, 1, 5), ("GroupNorm", 1, 1), None),
    *[(nn.BatchNorm2d, (4, c, 3, 3), ("GroupNorm", gcd32(c), c), ("GroupNorm", gcd32(c), c)) for c in (1, 3, 32, 64)],
    *[(nn.BatchNorm3d, (4, c, 2, 2, 2), ("GroupNorm", gcd32(c), c), ("GroupNorm", gcd32(c), c)) for c in (1, 32)],
    # BatchNorm2d after global pooling: features again, one group
    *[(nn.BatchNorm2d, (4, c, 1, 1), ("GroupNorm", 1, c), ("GroupNorm", gcd32(c), c)) for c in (3, 64)],
]


def describe(norm):
    if isinstance(norm, nn.LayerNorm):
        return ("LayerNorm", *norm.normalized_shape)
    return (type(norm).__name__, norm.num_groups, norm.num_channels)


@pytest.mark.parametrize("make, shape, with_inputs, without", BN_CASES,
                         ids=[f"{m.__name__}-{'x'.join(map(str, s))}" for m, s, *_ in BN_CASES])
def test_fixed_batch_norm_output_depends_on_its_input(make, shape, with_inputs, without):
    channels = shape[1]
    model = affine_bn(make, channels)
    x = torch.randn(shape)
    fixed, report = fix_reporting(model, example_inputs=x)
    assert describe(fixed[0]) == with_inputs
    assert_output_depends_on_input(fixed, shape)
    torch.testing.assert_close(fixed[0].weight, model[0].weight)
    new = (f"nn.LayerNorm(({channels},))" if with_inputs[0] == "LayerNorm"
           else f"nn.GroupNorm({with_inputs[1]}, {channels})")
    assert report.changes == (("0", f"nn.{make.__name__}({channels})", f"{new} (input {shape})"),)
    assert str(report) == (f"ModuleValidator.fix changed 1 module(s):\n  `0`: nn.{make.__name__}({channels}) -> "
                           f"{new} (input {shape})")

    if without is None:  # could be (N, 1) or (N, 1, L): refused, with advice
        with pytest.raises(ValueError) as info:
            ModuleValidator.fix(model)
        assert str(info.value).startswith("cannot fix `0` (nn.BatchNorm1d): over (N, 1) inputs it has one value per "
                                          "sample")
        assert "Pass example_inputs=... to ModuleValidator.fix" in str(info.value)
        return
    fixed, report = fix_reporting(model)
    assert describe(fixed[0]) == without
    assert report.changes[0][:2] == ("0", f"nn.{make.__name__}({channels})")
    assert "without example_inputs" in str(report)
    if shape[2:] != (1, 1):  # what the type alone cannot tell: a BatchNorm2d over 1x1 positions
        assert_output_depends_on_input(fixed, shape)


@pytest.mark.parametrize("make, shape", [(nn.BatchNorm1d, (4, 1)), (nn.BatchNorm1d, (4, 1, 1)),
                                         (nn.BatchNorm2d, (4, 1, 1, 1))])
def test_batch_norm_over_one_value_per_sample_is_refused(make, shape):
    model = nn.Sequential(nn.Identity(), affine_bn(make, 1))
    with pytest.raises(ValueError) as info:
        ModuleValidator.fix(model, example_inputs=torch.randn(shape))
    assert str(info.value) == (
        f"cannot fix `1.0` (nn.{make.__name__}): its input {shape} has one value per sample; normalising a single "
        "value outputs the layer's bias whatever the input. Remove the layer, or register a fixer of your own "
        "(fxdp.validators.register_module_fixer)")


def test_num_groups_that_leave_one_value_per_group_are_refused():
    model = affine_bn(nn.BatchNorm1d, 8)
    with pytest.raises(ValueError) as info:
        ModuleValidator.fix(model, num_groups=8)
    assert str(info.value).startswith(
        "cannot fix `0` (nn.BatchNorm1d): num_groups=8 leaves one channel per group, and over (N, C) inputs it "
        "would have no positions: each group would normalise a single value and output its bias whatever the "
        "input. Use fewer groups (a divisor of 8 below 8), or pass example_inputs=...")
    with pytest.raises(ValueError, match=r"its input \(2, 8\) has no positions"):
        ModuleValidator.fix(model, num_groups=8, example_inputs=torch.randn(2, 8))
    fixed = ModuleValidator.fix(model, num_groups=4, example_inputs=torch.randn(2, 8))
    assert describe(fixed[0]) == ("GroupNorm", 4, 8)
    assert_output_depends_on_input(fixed, (2, 8))
    fixed = ModuleValidator.fix(model, num_groups=8, example_inputs=torch.randn(2, 8, 3))
    assert describe(fixed[0]) == ("GroupNorm", 8, 8)


def test_shapes_come_from_every_call_of_a_shared_layer_and_the_model_is_left_alone():
    class TwoCalls(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(6)
            self.seq = nn.Sequential(nn.Linear(4, 6), self.bn)  # shared: named `bn` first
            self.drop = nn.Dropout(0.5)

        def forward(self, x, seq):
            return self.drop(self.bn(seq).mean(2)) + self.seq(x)

    model = TwoCalls()
    saved = state(model)
    fixed, report = fix_reporting(model, example_inputs=(torch.randn(2, 4), torch.randn(2, 6, 5)))
    # over (N, 6) and (N, 6, 5): a GroupNorm with one group suits both
    assert describe(fixed.bn) == ("GroupNorm", 1, 6) and fixed.seq[1] is fixed.bn
    assert report.changes == (("bn", "nn.BatchNorm1d(6)", "nn.GroupNorm(1, 6) (input (2, 6, 5), (2, 6))"),)
    assert model.training and fixed.training and fixed.drop.training  # the probe ran on a copy in eval mode
    assert_same_state(model, saved)
    assert type(model.bn) is nn.BatchNorm1d and model.bn.num_batches_tracked == 0


def test_example_inputs_may_be_keyword_inputs_and_errors_say_how_to_give_them():
    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, *, features):
            return self.bn(features)

    fixed = ModuleValidator.fix(Kw(), example_inputs={"features": torch.randn(2, 3)})
    assert isinstance(fixed.bn, nn.LayerNorm)
    with pytest.raises(ValueError) as info:
        ModuleValidator.fix(Kw(), example_inputs=torch.randn(2, 3))
    assert str(info.value).startswith("ModuleValidator.fix: running Kw on example_inputs failed (TypeError: ")
    assert str(info.value).endswith("give example_inputs as forward takes them: a tensor, a tuple of positional "
                                    "inputs or a dict of keyword inputs")


def test_lazy_batch_norm_becomes_a_group_norm_sized_by_its_first_input():
    fixed = ModuleValidator.fix(nn.Sequential(nn.Linear(3, 5), nn.LazyBatchNorm1d()))
    fixed(torch.randn(2, 3))
    assert describe(fixed[1]) == ("GroupNorm", 1, 5)  # over (N, C) features: one group
    assert_output_depends_on_input(fixed, (2, 3))
    lazy = ModuleValidator.fix(nn.Sequential(nn.LazyBatchNorm1d()))
    with pytest.raises(ValueError, match=r"got input of shape \(2, 1\) and 1 group\(s\): each group would hold one "
                                         "value per sample"):
        lazy(torch.randn(2, 1))


def test_instance_norm_change_is_reported():
    model = nn.Sequential(nn.InstanceNorm1d(4, track_running_stats=True))
    _, report = fix_reporting(model)
    assert report.changes == (("0", "nn.InstanceNorm1d(track_running_stats=True)",
                               "nn.InstanceNorm1d(track_running_stats=False)"),)


def test_a_model_without_anything_to_replace_warns_nothing(recwarn):
    ModuleValidator.fix(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True)))
    assert [w for w in recwarn if issubclass(w.category, UserWarning)] == []


# -- what is not a module ------------------------------------------------------------------------------------


def a_function(x):
    return x


@pytest.mark.parametrize("call", ["validate", "is_valid", "fix", "fix_and_validate"])
@pytest.mark.parametrize("given, described", [
    (None, "None"),
    (a_function, "the function 'a_function'; wrap it in an nn.Module whose forward calls it, with its "
                 "parameters registered on the module"),
    (nn.Linear, "the class nn.Linear itself, not an instance; pass one, e.g. Linear(...)"),
    (3, "an int"),
    (torch.zeros(2), "a torch.Tensor"),
])
def test_what_is_not_a_module_is_a_type_error_naming_it(call, given, described):
    with pytest.raises(TypeError) as info:
        getattr(ModuleValidator, call)(given)
    assert str(info.value) == f"ModuleValidator.{call}(module) expects a torch.nn.Module, got {described}"
