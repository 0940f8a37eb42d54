"""Canary users (fxdp.audit.users): the audit of a user-level run. Their rows and per-user norms against values
worked out by hand, their clipping as one unit through the UserLevelDPOptimizer, and audits of short user-level
digits runs: below the claim when the run is correct, above it when records are clipped one by one (the
example-level clipping that the user-level optimizer exists to prevent) or when there is no noise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fxdp.audit import one_run
from fxdp.audit.digits import digits
from fxdp.audit.users import UserCanarySink, user_observer
from fxdp.sinks.contract import GradSampleSink


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_canary_users_bring_their_records_as_consecutive_rows():
    import fxdp

    model = _mlp()
    dp = fxdp.compile_for_dp(model, example_inputs=torch.randn(2, 64))
    x, y = torch.randn(5, 64), torch.randint(0, 10, (5,))
    block = nn.Parameter(torch.zeros(4))
    sink = UserCanarySink(GradSampleSink(), block, torch.tensor([True, False, True, True]), norm=10.0,
                          sample_rate=1.0, generator=torch.Generator().manual_seed(0), records=3)
    assert sink.draw().tolist() == [0, 2, 3]
    assert sink.canary_counts().tolist() == [3, 3, 3]
    nn.functional.cross_entropy(dp(x), y).backward()
    params = list(model.parameters()) + [block]
    norms = sink.squared_norms(params)
    assert torch.equal(norms[block], torch.tensor([0.0] * 5 + [100.0] * 9))  # each record: 10 e_j
    # real users: records (0, 1) and (2, 3, 4); canary users 2, 3, 4 with three records each
    groups = torch.tensor([0, 0, 1, 1, 1] + [2] * 3 + [3] * 3 + [4] * 3)
    per_user = sink.grouped_squared_norms(params, groups, 5)
    assert torch.equal(per_user[block], torch.tensor([0.0, 0.0, 900.0, 900.0, 900.0], dtype=torch.float64))
    for p in model.parameters():
        g = p.grad_sample.reshape(5, -1)
        expected = torch.stack([g[:2].sum(0).pow(2).sum(), g[2:].sum(0).pow(2).sum()])
        assert torch.allclose(per_user[p][:2].double(), expected.double(), rtol=1e-5)
        assert torch.equal(per_user[p][2:], torch.zeros(3, dtype=per_user[p].dtype))
    factors = torch.tensor([1.0] * 5 + [0.1] * 3 + [0.2] * 3 + [0.3] * 3)
    sums = sink.clipped_sums(params, {p: factors for p in params})
    assert torch.allclose(sums[block], torch.tensor([3.0, 0.0, 6.0, 9.0]))  # 3 records x factor x 10
    # the canary users must be the last users of the step, with their rows
    sink.draw()
    with pytest.raises(Exception, match="canary users of this step are the last 3 users with 3 rows each"):
        sink.grouped_squared_norms([block], torch.arange(14), 14)


def test_the_user_level_optimizer_clips_a_canary_user_as_one_unit():
    # sigma = 0: a canary user of 3 records of norm 2000 each adds exactly C (not 3 C) to the clipped sum.
    from fxdp.privacy_engine import PrivacyEngine

    data, _ = digits()
    model = _mlp()
    engine = PrivacyEngine()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = torch.utils.data.DataLoader(data, batch_size=256)
    dp_model, dp_optimizer, dp_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=2.0,
        privacy_unit="user", user_ids=[i // 4 for i in range(len(data))], max_records_per_user=4)
    block = nn.Parameter(torch.zeros(6))
    dp_optimizer.add_param_group({"params": [block], "lr": 0.0})
    members = torch.tensor([True, False, True, True, False, True])
    sink = UserCanarySink(dp_optimizer.sink, block, members, norm=2000.0, sample_rate=1.0,
                          generator=torch.Generator().manual_seed(0), records=3)
    dp_optimizer.sink = sink
    dp_loader.batch_observer = user_observer(dp_optimizer, sink)
    x, y = next(iter(dp_loader))
    assert sink.active.tolist() == [0, 2, 3, 5]
    dp_optimizer.zero_grad()
    nn.functional.cross_entropy(dp_model(x), y).backward()
    dp_optimizer.step()
    users = dp_optimizer.expected_batch_size  # the "mean" normaliser: the expected number of users
    assert users == round(len(data) / 4 / len(loader))
    expected = torch.tensor([2.0, 0, 2.0, 2.0, 0, 2.0]) / users
    assert torch.allclose(block.grad, expected, atol=1e-6)


# --------------------------------------------------------------------------- audits of user-level runs
# Digits (1797 records) in users of 8 records (225 users), MLP 64-32-10, C = 1, q = 1/29 of the users per step,
# 1 epoch (29 steps), 500 canary users of 8 records each.


def _user_audit(noise_multiplier, **kwargs):
    data, _ = digits()
    return one_run(_mlp(), data, noise_multiplier=noise_multiplier, max_grad_norm=1.0, batch_size=64, epochs=1,
                   canaries=500, delta=1e-5, confidence=0.95, seed=0, privacy_unit="user",
                   user_ids=[i // 8 for i in range(len(data))], max_records_per_user=8, **kwargs)


def _user_level_epsilon(noise_multiplier):
    from fxdp.accounting import create_accountant

    accountant = create_accountant("rdp")  # one user is one unit of the Poisson-sampled Gaussian: q = 1/29
    for _ in range(29):
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=1 / 29)
    return accountant.get_epsilon(1e-5)


def test_user_level_audit_stays_below_the_claimed_user_level_epsilon():
    result = _user_audit(1.0)
    assert result.epsilon_claimed == pytest.approx(_user_level_epsilon(1.0))
    assert result.canaries == 500 and result.epsilon_claimed > 1.0
    assert result.epsilon_lower <= result.epsilon_claimed and result.consistent


def test_user_level_audit_without_noise_finds_the_canary_users():
    result = _user_audit(0.0)
    assert result.epsilon_claimed == math.inf
    assert result.epsilon_lower >= 2.5
    assert result.correct == result.guesses


def test_user_level_audit_catches_records_clipped_one_by_one(monkeypatch):
    # A test-only bug: the user-level optimizer clips each record alone (the example-level factors) while the
    # accountant claims a user-level epsilon. A canary user of 8 records then adds 8 C to the sum, not C.
    from fxdp.optim.dp_optimizer import DPOptimizer
    from fxdp.optim.user_level import UserLevelDPOptimizer

    monkeypatch.setattr(UserLevelDPOptimizer, "_factors", DPOptimizer._factors)
    broken = _user_audit(2.0)
    assert broken.epsilon_claimed == pytest.approx(_user_level_epsilon(2.0))  # the accountant cannot see it
    assert broken.epsilon_lower > broken.epsilon_claimed
    assert not broken.consistent and "VIOLATION" in str(broken)


def test_user_level_audit_settings_are_checked():
    data, _ = digits()
    with pytest.raises(ValueError, match="needs max_records_per_user"):
        one_run(_mlp(), data, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=64, epochs=1, canaries=10,
                privacy_unit="user", user_ids=list(range(len(data))))
    with pytest.raises(ValueError, match="canary_records is for privacy_unit='user'"):
        one_run(_mlp(), data, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=64, epochs=1, canaries=10,
                canary_records=3)
    with pytest.raises(ValueError, match="input canaries audit example-level runs"):
        one_run(_mlp(), data, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=64, epochs=1, canaries=10,
                canary="input", privacy_unit="user", user_ids=list(range(len(data))), max_records_per_user=2)


def test_command_line_audit_of_a_user_level_run(capsys):
    from fxdp.cli import main

    code = main(["audit", "--noise-multiplier", "1", "--epochs", "1", "--canaries", "50", "--batch-size", "256",
                 "--privacy-unit", "user", "--records-per-user", "6", "--max-records-per-user", "4"])
    out = capsys.readouterr().out
    assert code == 0
    assert "users: 300 of 6 records, up to 4 a step; canary users of 4 records" in out
    assert "epsilon lower bound" in out and "among 50 canaries" in out
    assert main(["audit", "--noise-multiplier", "1", "--privacy-unit", "user", "--records-per-user", "0"]) == 2
    assert "--records-per-user must be at least 1" in capsys.readouterr().err


def test_canary_users_join_steps_that_sample_no_real_user():
    # 10 users of 4 records at q = 1/10: about a third of the 30 steps sample no real user (0.9^10 = 0.35); the
    # canary users still join those steps, alone, and without noise the audit finds them.
    data, _ = digits()
    small = torch.utils.data.Subset(data, range(40))
    result = one_run(_mlp(), small, noise_multiplier=0.0, max_grad_norm=1.0, batch_size=4, epochs=3, canaries=40,
                     privacy_unit="user", user_ids=[i // 4 for i in range(40)], max_records_per_user=4)
    assert result.epsilon_claimed == math.inf
    assert result.epsilon_lower > 1.0 and result.correct >= result.guesses - 1
