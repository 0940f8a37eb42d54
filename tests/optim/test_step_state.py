"""The step's state in one object (``optimizer.step_state``, :class:`fxdp.optim.step_state.StepState`): what a
logical step carries between calls lives there, the optimizer's former private names for it fail loudly, and a
checkpoint keeps the keys it kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.sinks.contract import sink_of
from fxdp.optim import DPOptimizer
from fxdp.optim.step_state import MOVED, StepState


def _private(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.zeros(2, 4, dtype=torch.float64))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=4, sink=sink_of(compiled))
    return model, compiled, opt


def _backward(compiled, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (4,), generator=g)
    F.cross_entropy(compiled(x), y).backward()


def test_a_skipped_step_keeps_its_sums_and_the_signal_in_step_state_and_the_checkpoint_keeps_them():
    model, compiled, opt = _private()
    assert isinstance(opt.step_state, StepState) and opt.step_state.summed == {}
    opt.zero_grad()
    _backward(compiled, 1)
    opt.signal_skip_step()
    assert opt.step_state.skip_next
    opt.step()
    assert not opt.step_state.skip_next
    params = [p for p in model.parameters()]
    assert list(opt.step_state.summed) == params  # the clipped sums of the physical batch, by parameter
    saved = opt.state_dict()["fxdp"]
    assert saved["skip_next"] is False
    assert all(torch.equal(a, opt.step_state.summed[p]) for a, p in zip(saved["accumulated"], params))

    _, compiled2, again = _private()
    again.load_state_dict(opt.state_dict())
    assert all(torch.equal(again.step_state.summed[q], opt.step_state.summed[p])
               for p, q in zip(params, compiled2.parameters()))
    _backward(compiled, 2)
    opt.step()
    assert opt.step_state.summed == {} and opt.step_state.needs_zero_grad
    with pytest.raises(RuntimeError, match="without optimizer.zero_grad"):
        opt.step()
    opt.zero_grad()
    assert not opt.step_state.needs_zero_grad


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_former_private_names_fail_loudly(old):
    _, _, opt = _private()
    with pytest.raises(AttributeError, match=rf"DPOptimizer\.{old} is now optimizer\.step_state\.{MOVED[old]}"):
        getattr(opt, old)
    with pytest.raises(AttributeError, match=rf"optimizer\.step_state\.{MOVED[old]} "):
        setattr(opt, old, None)  # (a subclass written before would set an attribute nothing reads)
    assert MOVED[old] in StepState.__dataclass_fields__
