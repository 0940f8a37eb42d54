"""fxdp.grad_sample.mixing: which modules mix samples in the mode they are in. The validators and the engines read
this one rule."""
from __future__ import annotations

from torch import nn

from fxdp.grad_sample.mixing import BATCH_NORM_FIX, sample_mixing_modules, uses_batch_statistics, why_it_mixes_samples
from fxdp.validators import ModuleValidator


def test_batch_norm_mixes_samples_in_training_and_without_running_statistics():
    bn = nn.BatchNorm2d(3)
    assert uses_batch_statistics(bn)
    bn.eval()
    assert not uses_batch_statistics(bn) and why_it_mixes_samples(bn) is None
    no_stats = nn.BatchNorm1d(3, track_running_stats=False).eval()
    assert uses_batch_statistics(no_stats)
    assert why_it_mixes_samples(nn.GroupNorm(1, 3)) is None and why_it_mixes_samples(nn.Linear(2, 2)) is None


def test_it_lists_each_module_by_its_path_and_the_validators_say_the_same():
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.BatchNorm1d(3)), nn.BatchNorm1d(3).eval())
    found = sample_mixing_modules(model)
    assert [(name, type(m)) for name, m, _, _ in found] == [("1.0", nn.BatchNorm1d)]
    assert found[0][3] == BATCH_NORM_FIX
    errors = ModuleValidator.validate(model)
    assert [(e.module_name, e.message, e.fix) for e in errors] == [("1.0", found[0][2], BATCH_NORM_FIX)]
