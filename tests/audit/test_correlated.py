"""Audits of runs with correlated noise (fxdp.audit.correlated): the strategy the auditor undoes against the noise
the mechanisms actually add, the scores against the likelihood ratio written out by hand, and audits of short
banded-MF and BLT digits runs: below the claimed epsilon when the run is correct, above it when clipping is
broken, strong without noise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fxdp.audit import one_run
from fxdp.audit.correlated import CorrelatedStepScores, canary_partitions, strategy_matrix
from fxdp.audit.digits import digits
from fxdp.optim.correlated import BandedMatrixFactorization, BufferedLinearToeplitz
from fxdp.optim.noise import add_gaussian_noise_all_


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


@pytest.mark.parametrize("mechanism", [
    BandedMatrixFactorization(coefficients=[1.0, 0.6, 0.3]),
    BufferedLinearToeplitz([0.9, 0.5], [0.3, 0.2], steps=12, min_separation=3),
], ids=["banded", "blt"])
def test_the_strategy_turns_the_added_noise_back_into_independent_draws(mechanism):
    # The mechanism adds w_t at step t; C w must be the independent standard normal draws z it started from.
    steps, parts, std = 12, 3, 0.7
    position = [0]
    mechanism.follow_cycle(lambda: position[0], parts)
    generator = torch.Generator().manual_seed(5)
    added = []
    for t in range(steps):
        position[0] = t % parts
        out = [torch.zeros(4), torch.zeros(2, 3)]
        mechanism.add_noise_(out, std, generator=generator)
        added.append(torch.cat([o.reshape(-1) for o in out]).double() / std)
    replay = torch.Generator().manual_seed(5)
    draws = []
    for _ in range(steps):  # the same generator's draws, uncorrelated
        z = [torch.zeros(4), torch.zeros(2, 3)]
        add_gaussian_noise_all_(z, 1.0, generator=replay)
        draws.append(torch.cat([o.reshape(-1) for o in z]).double())
    c = strategy_matrix(mechanism, steps)
    assert torch.allclose(c @ torch.stack(added), torch.stack(draws), atol=1e-5)
    assert torch.allclose(c, c.tril())  # lower triangular, Toeplitz
    assert torch.allclose(torch.diagonal(c, -1), torch.full((steps - 1,), float(c[1, 0]), dtype=torch.float64))


def test_strategy_matrix_normalisation():
    banded = BandedMatrixFactorization(bands=4)
    c = strategy_matrix(banded, 10)
    assert c.norm(dim=0).max().item() == pytest.approx(1.0)  # one participation: sensitivity 1
    blt = BufferedLinearToeplitz([0.8], [0.5], steps=9, min_separation=3)
    c = strategy_matrix(blt, 9)
    # the earliest, densest pattern of steps 3 apart (0, 3, 6) has sensitivity 1 after normalisation
    assert (c[:, 0] + c[:, 3] + c[:, 6]).norm().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no strategy matrix known"):
        strategy_matrix(object(), 3)


def test_correlated_scores_are_the_likelihood_ratio_written_out():
    # Two bands, two parts, four steps; canary 0 in part 0 (steps 0, 2), canary 1 in part 1 (steps 1, 3).
    block = nn.Parameter(torch.zeros(2))
    coefficients = [0.8, 0.6]
    c = torch.tensor([[0.8, 0, 0, 0], [0.6, 0.8, 0, 0], [0, 0.6, 0.8, 0], [0, 0, 0.6, 0.8]], dtype=torch.float64)
    positions = iter([0, 1, 0, 1])
    now = [0]
    sigma, q = 1.5, 0.25
    scores = CorrelatedStepScores(block, unit=0.5, noise_multiplier=sigma, sample_rate=q,
                                  partition=torch.tensor([0, 1]), position=lambda: now[0],
                                  strategy=lambda n: strategy_matrix(BandedMatrixFactorization(
                                      coefficients=coefficients), n))
    u = torch.tensor([[1.0, 0.2], [-0.3, 0.9], [0.4, -1.0], [0.0, 0.5]], dtype=torch.float64)
    for t in range(4):
        now[0] = next(positions)
        with torch.no_grad():
            block -= 0.5 * u[t].float()  # an update of u units (0.5 per unit)
        scores()
    y = c @ u.float().double()
    expected = []
    for j, steps in enumerate([(0, 2), (1, 3)]):
        total = 0.0
        for t in steps:
            x = (float(y[:, j] @ c[:, t]) - 0.5 * float(c[:, t] @ c[:, t])) / sigma ** 2
            total += math.log(1 - q + q * math.exp(x))
        expected.append(total)
    assert torch.allclose(scores.scores(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    # every step of the part (q = 1): the Gaussian likelihood ratio of the known signal s = C 1_part
    scores.q = 1.0
    s = torch.stack([c[:, 0] + c[:, 2], c[:, 1] + c[:, 3]], dim=1)
    full = ((y * s).sum(0) - 0.5 * (s * s).sum(0)) / sigma ** 2
    assert torch.allclose(scores.scores(), full, atol=1e-6)
    # without noise: the summed update
    scores.sigma = 0.0
    assert torch.allclose(scores.scores(), u.float().double().sum(0), atol=1e-6)


def test_canaries_get_uniform_parts():
    parts = canary_partitions(4000, 4, torch.Generator().manual_seed(0))
    counts = torch.bincount(parts, minlength=4).double()
    assert parts.min() >= 0 and parts.max() <= 3
    assert (counts - 1000).abs().max() < 120  # sd sqrt(4000 * 1/4 * 3/4) ~ 27: over 4 sd


# --------------------------------------------------------------------------- audits of banded-MF and BLT runs
# Digits (1797 records), MLP 64-32-10, C = 1, batch 64: make_private's cyclic loader has 32 steps a pass (29
# rounded up to a multiple of 4 bands), each part sampled at q = 4/32; 1 epoch; 500 canaries.


def _audit(noise_multiplier, mechanism, **kwargs):
    data, _ = digits()
    return one_run(_mlp(), data, noise_multiplier=noise_multiplier, max_grad_norm=1.0, batch_size=64, epochs=1,
                   canaries=500, delta=1e-5, confidence=0.95, seed=0, noise_mechanism=mechanism, **kwargs)


def _banded_epsilon(noise_multiplier):
    from fxdp.accounting import create_accountant

    # unit sensitivity: DP-SGD's composition over a sample's participations, one every 4 steps at rate 4/32
    accountant = create_accountant("pld")
    for _ in range(32 // 4):
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=4 / 32)
    return accountant.get_epsilon(1e-5)


def _clip_at_ten_c(self, norms):
    total = sum(sq for sq in norms.values())
    factor = (10 * self.max_grad_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
    return {p: factor for p in norms}


def test_banded_mf_audit_stays_below_the_claim():
    result = _audit(1.0, BandedMatrixFactorization(bands=4))
    assert result.epsilon_claimed == pytest.approx(_banded_epsilon(1.0), rel=1e-3)
    assert result.epsilon_lower <= result.epsilon_claimed and result.consistent


def test_banded_mf_audit_without_noise_finds_the_leak():
    result = _audit(0.0, BandedMatrixFactorization(bands=4))
    assert result.epsilon_claimed == math.inf
    assert result.epsilon_lower >= 2.5 and result.correct == result.guesses


def test_banded_mf_audit_catches_a_clipping_bound_ten_times_too_large(monkeypatch):
    from fxdp.optim.dp_optimizer import DPOptimizer

    monkeypatch.setattr(DPOptimizer, "_clip_factors", _clip_at_ten_c)
    broken = _audit(2.0, BandedMatrixFactorization(bands=4))
    assert broken.epsilon_claimed == pytest.approx(_banded_epsilon(2.0), rel=1e-3)
    assert broken.epsilon_lower > broken.epsilon_claimed and not broken.consistent


def _blt():
    # make_private's fixed-epoch loader for BLT: 29 batches a pass, each sample in one of them (rate 1). Two
    # buffers, given (optimize_blt's would take seconds and change nothing the audit checks)
    return BufferedLinearToeplitz([0.9, 0.5], [0.3, 0.2], steps=29)


def _gaussian_epsilon(sigma, delta):
    """The exact epsilon of one Gaussian mechanism of noise multiplier sigma (sensitivity 1), by bisection on
    delta(eps) = Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma) (Balle & Wang 2018)."""
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    tail = lambda e: phi(0.5 / sigma - e * sigma) - math.exp(e) * phi(-0.5 / sigma - e * sigma)  # noqa: E731
    low, high = 0.0, 50.0
    for _ in range(200):
        low, high = ((low + high) / 2, high) if tail((low + high) / 2) > delta else (low, (low + high) / 2)
    return high


def test_blt_audit_stays_below_the_claim():
    result = _audit(1.0, _blt())
    # one participation (min separation 29 = the steps), unit sensitivity: one Gaussian mechanism of sigma = 1
    assert result.epsilon_claimed == pytest.approx(_gaussian_epsilon(1.0, 1e-5), rel=1e-2)
    assert result.epsilon_lower <= result.epsilon_claimed and result.consistent
    assert result.epsilon_lower > 0.5  # the signal of one certain participation at sigma = 1 is visible


def test_blt_audit_catches_a_clipping_bound_ten_times_too_large(monkeypatch):
    from fxdp.optim.dp_optimizer import DPOptimizer

    monkeypatch.setattr(DPOptimizer, "_clip_factors", _clip_at_ten_c)
    broken = _audit(2.0, _blt())
    assert broken.epsilon_lower > broken.epsilon_claimed and not broken.consistent


def test_command_line_audit_of_a_banded_mf_run(capsys):
    from fxdp.cli import main

    code = main(["audit", "--noise-multiplier", "1", "--epochs", "1", "--canaries", "50", "--batch-size", "256",
                 "--noise", "banded-mf", "--bands", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "noise: BandedMatrixFactorization(bands=2" in out
    assert "epsilon lower bound" in out and "among 50 canaries" in out
    # banded MF is accounted with PLD only: an RDP claim is refused, with the reason
    assert main(["audit", "--noise-multiplier", "1", "--noise", "banded-mf", "--accountant", "rdp"]) == 2
    assert "accounted with PLD" in capsys.readouterr().err
