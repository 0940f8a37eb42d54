"""Privacy auditing with one training run: the bound's statistics against values worked out by hand
(and scipy where installed), the gradient canaries against a hand-written DP-SGD step, and audits of
real training runs: consistent at sigma = 1, strong without noise, a violation when clipping is broken."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from fxdp.audit.bound import (
    AuditResult,
    Guesses,
    best_guesses,
    binomial_tail,
    epsilon_lower_bound,
    guess_grid,
    p_value,
)


# --------------------------------------------------------------------------- the bound's statistics


def test_p_value_three_guesses_by_hand():
    # r = 3 guesses, v = 2 right. P[Bin(3, q) >= 2] = 3q^2(1-q) + q^3.
    # eps = 0 (q = 1/2): beta = 4/8. alpha = max(pmf(1) / 1, (pmf(1) + pmf(0)) / 2) = max(3/8, 2/8) = 3/8.
    assert p_value(10, 3, 2, 0.0, 0.0) == pytest.approx(0.5, abs=1e-12)
    assert p_value(10, 3, 2, 0.0, 0.01) == pytest.approx(0.5 + 3 / 8 * 0.01 * 2 * 10, abs=1e-12)
    # eps = log 3 (q = 3/4): beta = 27/64 + 27/64 = 27/32; pmf(1) = 9/64, pmf(0) = 1/64, alpha = 9/64.
    assert p_value(10, 3, 2, math.log(3), 0.0) == pytest.approx(27 / 32, abs=1e-12)
    assert p_value(10, 3, 2, math.log(3), 0.01) == pytest.approx(27 / 32 + 9 / 64 * 0.2, abs=1e-12)
    # the bound never exceeds 1, and v = 0 right guesses is certain
    assert p_value(10, 3, 2, 0.0, 0.5) == 1.0
    assert p_value(10, 3, 0, 5.0, 0.0) == 1.0


def test_all_guesses_right_without_delta_has_a_closed_form():
    # v = r: P[Bin(r, q) >= r] = q^r < beta  <=>  q < beta^(1/r), so eps = logit(beta^(1/r)).
    for r in (5, 20, 300):
        q = 0.05 ** (1 / r)
        expected = math.log(q / (1 - q))
        assert epsilon_lower_bound(1000, r, r, delta=0.0, confidence=0.95) == pytest.approx(expected, abs=1e-5)
    # four right guesses out of four happen with probability 1/16 > 5% even without privacy loss
    assert epsilon_lower_bound(1000, 4, 4, delta=0.0, confidence=0.95) == 0.0
    assert epsilon_lower_bound(1000, 100, 0, delta=1e-5) == 0.0


def test_bound_rounds_down_to_a_rejected_epsilon():
    eps = epsilon_lower_bound(1000, 200, 150, delta=1e-5, confidence=0.95)
    assert eps > 0.5
    assert p_value(1000, 200, 150, eps, 1e-5) < 0.05  # rejected
    assert p_value(1000, 200, 150, eps + 1e-4, 1e-5) >= 0.05  # the next eps up is not
    # more confidence, or more delta, can only lower the bound
    assert epsilon_lower_bound(1000, 200, 150, delta=1e-5, confidence=0.99) < eps
    assert epsilon_lower_bound(1000, 200, 150, delta=1e-3, confidence=0.95) < eps


def test_the_papers_worked_example():
    # Steinke, Nasr & Jagielski (arXiv:2305.08846), Appendix D: m = 1000, r = 100, v = 75, delta = 1e-4,
    # 95% confidence gives eps >= 0.673.
    assert epsilon_lower_bound(1000, 100, 75, delta=1e-4, confidence=0.95) == pytest.approx(0.673, abs=5e-4)


def test_binomial_tail_by_hand():
    assert binomial_tail(2, 3, 0.5) == pytest.approx(0.5)
    assert binomial_tail(3, 3, 0.9) == pytest.approx(0.729)
    assert binomial_tail(0, 3, 0.1) == 1.0 and binomial_tail(4, 3, 0.9) == 0.0
    # far tails stay accurate in log space: P[Bin(1000, 0.5) >= 1000] = 2^-1000
    assert binomial_tail(1000, 1000, 0.5) == pytest.approx(2.0 ** -1000, rel=1e-9)


def test_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for _ in range(40):
        m = rng.randint(10, 3000)
        r = rng.randint(1, m)
        v = rng.randint(0, r)
        eps = rng.uniform(0, 6)
        delta = rng.choice([0.0, 1e-6, 1e-5, 1e-3])
        q = math.exp(eps) / (1 + math.exp(eps))
        beta = stats.binom.sf(v - 1, r, q)
        below = stats.binom.pmf(range(v - 1, -1, -1), r, q).cumsum()  # P[v-i <= Bin < v], i = 1..v
        alpha = max((b / i for i, b in enumerate(below, 1)), default=0.0)
        expected = min(1.0, beta + alpha * delta * 2 * m)
        assert p_value(m, r, v, eps, delta) == pytest.approx(expected, rel=1e-7, abs=1e-12)
        assert binomial_tail(v, r, q) == pytest.approx(beta, rel=1e-7, abs=1e-300)


def test_bad_counts_are_errors():
    with pytest.raises(ValueError, match="v <= guesses r <= canaries m"):
        p_value(10, 3, 4, 1.0, 0.0)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(10, 3, 3, delta=0.0, confidence=1.0)
    with pytest.raises(ValueError, match="NaN"):
        best_guesses([0.0, float("nan")], [True, False], delta=0.0)


def test_best_guesses_counts_right_guesses_at_both_ends():
    # scores rank canaries 0..9 from most to least "in"; members: the top 4 and canary 6
    scores = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    members = [True, True, True, True, False, False, True, False, False, False]
    one = best_guesses(scores, members, delta=0.0, grid=[(3, 4)])
    # top 3 all in (3 right); bottom 4 = canaries 9, 8, 7, 6: three out (right), canary 6 in (wrong)
    assert one == Guesses(3, 4, 6, epsilon_lower_bound(10, 7, 6, delta=0.0, confidence=0.95))
    # two pairs split the 5% between them: each is tested at 97.5%
    two = best_guesses(scores, members, delta=0.0, grid=[(3, 4), (4, 0)])
    assert two.epsilon_lower == max(epsilon_lower_bound(10, 7, 6, delta=0.0, confidence=0.975),
                                    epsilon_lower_bound(10, 4, 4, delta=0.0, confidence=0.975))


def test_ties_are_broken_by_index_not_membership():
    # all scores equal: the "in" guesses are canaries 0 and 1 whatever their membership
    got = best_guesses([0.0] * 6, [False, True, True, True, False, False], delta=0.0, grid=[(2, 0)])
    assert got.correct == 1


def test_guess_grid_is_fixed_and_small():
    grid = guess_grid(1000)
    assert grid == [(50, 0), (100, 0), (200, 0), (400, 0), (50, 50), (100, 100), (200, 200), (400, 400)]
    assert all(0 < kp + kn <= 7 for kp, kn in guess_grid(7))


def test_audit_result_reads_well():
    ok = AuditResult(epsilon_lower=0.41, epsilon_claimed=1.93, guesses=200, correct=130, canaries=1000,
                     delta=1e-5, confidence=0.95, positives=100)
    text = str(ok)
    assert "0.410" in text and "1.930" in text and "130 of 200 right" in text and "95%" in text
    assert ok.consistent and "consistent" in text
    bad = AuditResult(epsilon_lower=3.2, epsilon_claimed=1.9, guesses=400, correct=398, canaries=1000,
                      delta=1e-5, confidence=0.95, positives=400)
    assert not bad.consistent and "VIOLATION" in str(bad)


# --------------------------------------------------------------------------- gradient canaries in the sink

from fxdp.audit.canaries import CanaryInputs, CanarySink, StepScores, draw_membership, loss_scores  # noqa: E402
from fxdp.sinks.contract import GradSampleSink  # noqa: E402


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_canary_rows_join_the_real_samples_rows():
    import fxdp

    model = _mlp()
    dp = fxdp.compile_for_dp(model, example_inputs=torch.randn(2, 64))
    x, y = torch.randn(5, 64), torch.randint(0, 10, (5,))
    block = nn.Parameter(torch.zeros(6))
    members = torch.tensor([True, False, True, True, False, False])
    sink = CanarySink(GradSampleSink(), block, members, norm=50.0, sample_rate=1.0,
                      generator=torch.Generator().manual_seed(0))
    assert sink.draw().tolist() == [0, 2, 3]  # rate 1: every member joins
    nn.functional.cross_entropy(dp(x), y).backward()
    params = list(model.parameters()) + [block]

    norms = sink.squared_norms(params)
    for p in model.parameters():
        real = p.grad_sample.reshape(5, -1).pow(2).sum(1)
        assert torch.equal(norms[p], torch.cat([real, torch.zeros(3)]))  # canaries: zero in the model
    assert torch.equal(norms[block], torch.tensor([0.0] * 5 + [2500.0] * 3))  # real samples: zero in the block

    factors = torch.tensor([1.0, 0.5, 0.25, 1.0, 1.0, 0.02, 0.01, 0.03])
    sums = sink.clipped_sums(params, {p: factors for p in params})
    for p in model.parameters():
        expected = torch.tensordot(factors[:5], p.grad_sample, dims=1)
        assert torch.allclose(sums[p], expected)
    assert torch.allclose(sums[block], torch.tensor([0.02 * 50, 0.0, 0.01 * 50, 0.03 * 50, 0.0, 0.0]))
    # the rows are spent: a second physical batch of the same step carries no canaries
    assert len(sink.squared_norms([block])[block]) == 0
    sink.clear(params)
    assert all(p.grad_sample is None for p in model.parameters())


def test_the_dp_optimizer_clips_each_canary_to_c_and_leaves_the_data_alone():
    import fxdp
    from fxdp.sinks.contract import sink_of
    from fxdp.optim import DPOptimizer

    x, y = torch.randn(5, 64), torch.randint(0, 10, (5,))
    grads = []
    for with_canaries in (False, True):
        model = _mlp()
        dp = fxdp.compile_for_dp(model, example_inputs=x[:2])
        optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                                max_grad_norm=2.0, expected_batch_size=4, sink=sink_of(dp))
        if with_canaries:
            block = nn.Parameter(torch.zeros(6))
            optimizer.add_param_group({"params": [block], "lr": 0.0})
            members = torch.tensor([True, False, True, True, False, False])
            optimizer.sink = CanarySink(optimizer.sink, block, members, norm=2000.0, sample_rate=1.0,
                                        generator=torch.Generator().manual_seed(0))
            optimizer.sink.draw()
        optimizer.zero_grad()
        nn.functional.cross_entropy(dp(x), y).backward()
        optimizer.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    # each canary's 2000-norm gradient is clipped to C = 2, then divided by the expected batch size 4
    assert torch.allclose(block.grad, torch.tensor([0.5, 0, 0.5, 0.5, 0, 0]), atol=1e-6)
    # the data's clipped gradient is the same with or without canaries
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*grads))


def test_canaries_join_at_the_data_sample_rate():
    members = draw_membership(4000, torch.Generator().manual_seed(1))
    assert abs(members.float().mean().item() - 0.5) < 0.03  # 4 standard deviations
    sink = CanarySink(GradSampleSink(), nn.Parameter(torch.zeros(4000)), members, norm=1.0, sample_rate=0.1,
                      generator=torch.Generator().manual_seed(2))
    for _ in range(50):
        sink.draw()
    assert sink.appearances[~members].sum() == 0  # an "out" canary never joins
    rate = sink.appearances[members].float().mean().item() / 50
    assert abs(rate - 0.1) < 0.005  # sd of the mean rate ~ 0.0006


def test_step_scores_add_up_each_steps_likelihood_ratio():
    block = nn.Parameter(torch.zeros(2))
    scores = StepScores(block, unit=0.5, noise_multiplier=2.0, sample_rate=0.25)
    with torch.no_grad():
        block -= torch.tensor([0.5, -0.25])  # step 1: u = (1, -0.5) units
    scores()
    with torch.no_grad():
        block -= torch.tensor([0.0, 1.0])  # step 2: u = (0, 2)
    scores()
    # log(1 - q + q exp((u - 1/2) / sigma^2)) per step, q = 1/4, sigma^2 = 4
    lr = lambda u: math.log(0.75 + 0.25 * math.exp((u - 0.5) / 4))  # noqa: E731
    assert torch.allclose(scores.scores(), torch.tensor([lr(1) + lr(0), lr(-0.5) + lr(2)], dtype=torch.float64))
    assert torch.allclose(scores.summed, torch.tensor([1.0, 1.5], dtype=torch.float64))
    # without noise the score is the summed update
    quiet = StepScores(block, unit=0.5, noise_multiplier=0.0, sample_rate=0.25)
    with torch.no_grad():
        block -= torch.tensor([1.0, 0.0])
    quiet()
    assert quiet.scores().tolist() == [2.0, 0.0]


def test_input_canaries_look_like_the_data_and_are_scored_by_loss():
    data = torch.utils.data.TensorDataset(torch.rand(300, 64) * 16, torch.randint(0, 10, (300,)))
    canaries = CanaryInputs.like(data, 40, num_classes=10, generator=torch.Generator().manual_seed(0))
    assert canaries.inputs.shape == (40, 64) and canaries.labels.dtype == torch.int64
    assert abs(canaries.inputs.mean().item() - 8.0) < 1.5
    model = _mlp()
    scores = loss_scores(model, canaries)
    expected = -nn.functional.cross_entropy(model(canaries.inputs), canaries.labels, reduction="none")
    assert torch.allclose(scores, expected.double(), atol=1e-6)


# --------------------------------------------------------------------------- audits of real training runs
# Digits-sized data (scikit-learn's digits, or a stand-in of the same size), MLP 64-32-10, C = 1,
# batch 64, 2 epochs (56 steps), 1000 canaries.

from fxdp.audit import one_run  # noqa: E402
from fxdp.audit.digits import digits  # noqa: E402


def _audit(noise_multiplier, canary="gradient", **kwargs):
    data, _ = digits()
    return one_run(_mlp(), data, noise_multiplier=noise_multiplier, max_grad_norm=1.0, batch_size=64, epochs=2,
                   canaries=1000, canary=canary, delta=1e-5, confidence=0.95, seed=0, **kwargs)


def test_audit_with_noise_stays_below_the_claim():
    result = _audit(1.0)
    assert result.canaries == 1000 and result.delta == 1e-5 and result.confidence == 0.95
    assert 1.0 < result.epsilon_claimed < 5.0  # the accountant's epsilon of this run, at the same delta
    assert result.epsilon_lower <= result.epsilon_claimed
    assert result.consistent


def test_audit_without_noise_finds_the_leak():
    result = _audit(0.0)
    assert result.epsilon_claimed == math.inf
    # an "in" canary that joined any step moved its coordinate; an "out" one never moves
    assert result.epsilon_lower >= 3.0
    assert result.correct == result.guesses and result.positives == result.guesses


def test_audit_catches_a_clipping_bound_ten_times_too_large(monkeypatch):
    # A test-only bug: the optimizer clips at 10 C while the noise (sigma C) and the accountant use C.
    from fxdp.optim.dp_optimizer import DPOptimizer

    def clip_at_ten_c(self, norms):
        total = sum(sq for sq in norms.values())
        factor = (10 * self.max_grad_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
        return {p: factor for p in norms}

    from fxdp.accounting import create_accountant

    monkeypatch.setattr(DPOptimizer, "_clip_factors", clip_at_ten_c)
    broken = _audit(1.0)
    accountant = create_accountant("rdp")  # the accountant cannot see the bug: 2 epochs of 29 steps, q = 1/29
    for _ in range(2 * 29):
        accountant.step(noise_multiplier=1.0, sample_rate=1 / 29)
    assert broken.epsilon_claimed == pytest.approx(accountant.get_epsilon(1e-5))
    assert broken.epsilon_lower > broken.epsilon_claimed  # the audit does
    assert not broken.consistent and "VIOLATION" in str(broken)


def test_input_canaries_find_what_a_model_memorises():
    # Black box: without noise, 300 digits and 10 epochs at a high learning rate, the model fits the
    # random labels of the canaries it trained on, and their loss gives them away.
    data, _ = digits()
    result = one_run(_mlp(), torch.utils.data.Subset(data, range(300)), noise_multiplier=0.0, max_grad_norm=1.0,
                     batch_size=32, epochs=10, canaries=200, canary="input", lr=2.0, seed=0)
    assert result.canary == "input" and result.canaries == 200
    assert result.epsilon_lower > 0.5
    assert result.positives > 0 and result.correct / result.guesses > 0.8


def test_audit_leaves_the_callers_random_state_alone():
    data, _ = digits()
    model = _mlp()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    one_run(model, data, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=256, epochs=1, canaries=20)
    assert torch.equal(torch.rand(3), expected)  # sampling and noise drew from a forked generator


def test_bad_audit_settings_are_errors():
    data, _ = digits()
    with pytest.raises(ValueError, match="canary must be one of"):
        one_run(_mlp(), data, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=64, epochs=1, canary="weights")
    with pytest.raises(ValueError, match="canaries must be a positive int"):
        one_run(_mlp(), data, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=64, epochs=1, canaries=0)


def test_command_line_audit(capsys):
    from fxdp.cli import main

    code = main(["audit", "--noise-multiplier", "1", "--epochs", "1", "--canaries", "100", "--batch-size", "128"])
    out = capsys.readouterr().out
    assert code == 0
    assert "epsilon lower bound" in out and "epsilon claimed" in out and "MLP 64-32-10" in out
    assert main(["audit", "--noise-multiplier", "1", "--canaries", "0"]) == 2
    assert "--canaries must be at least 1" in capsys.readouterr().err
