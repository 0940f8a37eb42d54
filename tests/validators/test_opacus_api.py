"""ModuleValidator as code written for Opacus uses it: the VALIDATORS / FIXERS dicts, fixers written
``def fix(module)``, ``fix(replace_bn_with_in=True)``, the log line per replacement, and the stock recurrent and
attention layers (valid in fxdp; ``fix`` gives them the types of fxdp.layers without changing anything else)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fxdp.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from fxdp.validators import ModuleValidator, ShouldReplaceModuleError, register_module_fixer
from fxdp.validators.batch_norm import replace_batch_norm, validate_batch_norm
from fxdp.validators.instance_norm import stop_tracking_running_stats


def test_validators_and_fixers_read_as_dicts_by_module_type():
    for bn in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        assert ModuleValidator.VALIDATORS[bn] is validate_batch_norm and bn in ModuleValidator.VALIDATORS
        assert ModuleValidator.FIXERS[bn] is replace_batch_norm
    assert ModuleValidator.FIXERS[nn.InstanceNorm2d] is stop_tracking_running_stats
    (error,) = ModuleValidator.VALIDATORS[nn.BatchNorm1d](nn.BatchNorm1d(4))
    assert "normalises each sample with statistics of the whole batch" in str(error)
    with pytest.raises(KeyError):
        ModuleValidator.VALIDATORS[nn.LSTM]  # valid in fxdp: no validator
    assert nn.Linear not in ModuleValidator.FIXERS and "not a type" not in ModuleValidator.FIXERS
    assert nn.modules.batchnorm._BatchNorm in list(ModuleValidator.FIXERS)


def test_assigning_to_fixers_registers_for_that_validator_class_only():
    class Mine(ModuleValidator):
        pass

    class Gizmo(nn.Module):
        def forward(self, x):
            return x

    def fix(module):  # Opacus's fixers take the module alone
        return nn.Identity()

    Mine.FIXERS[Gizmo] = fix
    assert Mine.FIXERS[Gizmo] is fix and Gizmo not in ModuleValidator.FIXERS
    assert isinstance(Mine.fix(nn.Sequential(Gizmo()))[0], nn.Identity)
    assert isinstance(ModuleValidator.fix(nn.Sequential(Gizmo()))[0], Gizmo)
    assert Mine.FIXERS[nn.BatchNorm2d] is replace_batch_norm  # the parents' rules, through the subclass
    del Mine.FIXERS[Gizmo]
    assert Gizmo not in Mine.FIXERS and isinstance(Mine.fix(nn.Sequential(Gizmo()))[0], Gizmo)


def test_fixers_get_only_the_keywords_they_name():
    class Mine(ModuleValidator):
        pass

    seen = {}

    @register_module_fixer(nn.Linear, validator_class=Mine)
    def fix_linear(module):
        seen["linear"] = True
        return nn.Linear(module.in_features, module.out_features, bias=False)

    @register_module_fixer(nn.Conv1d, validator_class=Mine)
    def fix_conv(module, num_groups=None):
        seen["conv"] = num_groups
        return module

    fixed = Mine.fix(nn.Sequential(nn.Linear(2, 3), nn.Conv1d(3, 3, 1)), num_groups=3)
    assert seen == {"linear": True, "conv": 3} and fixed[0].bias is None


@pytest.mark.parametrize("bn, expected", [(nn.BatchNorm1d, nn.InstanceNorm1d), (nn.BatchNorm2d, nn.InstanceNorm2d),
                                          (nn.BatchNorm3d, nn.InstanceNorm3d)])
def test_replace_bn_with_in_gives_instance_norm_with_the_affine_parameters(bn, expected):
    model = nn.Sequential(bn(4))
    with torch.no_grad():
        model[0].weight.uniform_()
        model[0].bias.uniform_()
    fixed = ModuleValidator.fix(model, replace_bn_with_in=True)
    norm = fixed[0]
    assert type(norm) is expected and norm.num_features == 4 and norm.training
    assert norm.affine and not norm.track_running_stats and norm.running_mean is None
    assert torch.equal(norm.weight, model[0].weight) and torch.equal(norm.bias, model[0].bias)
    assert ModuleValidator.is_valid(fixed) and type(model[0]) is bn  # the original is left as it was
    x = torch.randn(2, 4, *([5] * (expected._get_no_batch_dim(norm) - 1)))
    reference = nn.functional.instance_norm(x, weight=model[0].weight, bias=model[0].bias)
    torch.testing.assert_close(fixed(x), reference)


def test_replace_bn_with_in_refusals_name_the_module():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="replace_bn_with_in=True and num_groups=2 ask for two different"):
        ModuleValidator.fix(model, replace_bn_with_in=True, num_groups=2)
    with pytest.raises(ValueError, match=r"cannot fix `1` \(nn.BatchNorm1d\): replace_bn_with_in=True: its input "
                                         r"\(2, 4\) has one value per channel and sample"):
        ModuleValidator.fix(model, replace_bn_with_in=True, example_inputs=torch.randn(2, 3))
    with pytest.raises(ValueError, match="no InstanceNorm matches SyncBatchNorm"):
        ModuleValidator.fix(nn.Sequential(nn.SyncBatchNorm(4)), replace_bn_with_in=True)
    assert type(model[1]) is nn.BatchNorm1d


def test_each_replacement_is_logged(caplog):
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.InstanceNorm2d(8, track_running_stats=True))
    with caplog.at_level(logging.INFO, logger="fxdp"), pytest.warns(UserWarning):
        ModuleValidator.fix(model)
    assert [r.getMessage() for r in caplog.records] == [
        "Replaced sub_module 1: nn.BatchNorm2d(8) with nn.GroupNorm(8, 8)",
        "Replaced sub_module 2: nn.InstanceNorm2d(track_running_stats=True) with "
        "nn.InstanceNorm2d(track_running_stats=False)",
    ]


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.gru, self.rnn = nn.LSTM(4, 4, batch_first=True), nn.GRU(4, 4), nn.RNN(4, 4)
        self.attention = nn.MultiheadAttention(4, 2)

    def forward(self, x):
        x = self.lstm(x)[0].transpose(0, 1)
        x = self.rnn(self.gru(x)[0])[0]
        return self.attention(x, x, x)[0]


def test_stock_recurrent_and_attention_layers_are_valid():
    assert ModuleValidator.validate(Recurrent()) == []


def test_fix_gives_stock_layers_the_dp_types_and_changes_nothing_else():
    model = Recurrent()
    model.gru.weight_hh_l0.requires_grad_(False)
    x = torch.randn(2, 3, 4)
    with pytest.warns(UserWarning, match=r"`lstm`: nn.LSTM\(4, 4\) -> DPLSTM\(4, 4\)"):
        fixed = ModuleValidator.fix(model)
    assert [type(m) for m in (fixed.lstm, fixed.gru, fixed.rnn, fixed.attention)] == [
        DPLSTM, DPGRU, DPRNN, DPMultiheadAttention]
    assert type(model.lstm) is nn.LSTM  # the original is not changed
    assert list(fixed.state_dict()) == list(model.state_dict())
    assert all(torch.equal(fixed.state_dict()[k], v) for k, v in model.state_dict().items())
    assert not fixed.gru.weight_hh_l0.requires_grad and fixed.lstm.batch_first
    assert fixed.lstm.weight_ih_l0 is not model.lstm.weight_ih_l0
    torch.testing.assert_close(fixed(x), model(x), rtol=0, atol=0)
    (fixer,) = {ModuleValidator.FIXERS[t] for t in (nn.LSTM, nn.GRU, nn.RNN, nn.MultiheadAttention)}
    assert fixer(fixed.lstm) is fixed.lstm  # a DP layer already


def test_fix_keeps_a_users_subclass_of_a_recurrent_layer():
    class Reversed(nn.LSTM):
        def forward(self, x, hx=None):
            return super().forward(x.flip(0), hx)

    model = nn.Sequential(Reversed(4, 4))
    assert type(ModuleValidator.fix(model)[0]) is Reversed


def test_should_replace_stays_importable_for_opacus_code():
    assert issubclass(ShouldReplaceModuleError, ValueError)
