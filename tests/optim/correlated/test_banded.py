"""Banded MF noise: its strategy (coefficients, sensitivity, expected error), the noise the DP optimizer actually adds
(covariance across steps), checkpoints, the default Gaussian noise unchanged, and what is refused.

Every reference here is derived in the test from the definitions, never copied: the coefficients from
binom(2k, k) / 4^k, the sensitivity and the error from the explicit n x n matrices.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fxdp.data import DPDataLoader
from fxdp.optim import AdaClipDPOptimizer, DPOptimizer
from fxdp.optim.correlated import (BandedMatrixFactorization, banded_toeplitz_matrix, expected_prefix_sum_error,
                                   max_column_norm, optimize_banded_toeplitz, sqrt_toeplitz_coefficients)
from fxdp.optim.noise import add_gaussian_noise_all_
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError


def prefix_sums(n: int) -> torch.Tensor:
    return torch.tril(torch.ones(n, n, dtype=torch.float64))


# -- the strategy ------------------------------------------------------------------------------------------


def test_sqrt_coefficients_are_the_series_of_one_over_sqrt_one_minus_x_with_unit_norm():
    bands = 7
    raw = [math.comb(2 * k, k) / 4 ** k for k in range(bands)]
    norm = math.sqrt(sum(c * c for c in raw))
    assert sqrt_toeplitz_coefficients(bands) == pytest.approx([c / norm for c in raw], rel=1e-14)
    # unbanded (bands = n), the Toeplitz matrix of the series squares to the prefix-sum workload A
    n = 9
    full = banded_toeplitz_matrix([math.comb(2 * k, k) / 4 ** k for k in range(n)], n)
    torch.testing.assert_close(full @ full, prefix_sums(n), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 40])
@pytest.mark.parametrize("coefficients", [sqrt_toeplitz_coefficients(4), [2.0, -0.5, 0.25, 0.1]])
def test_sensitivity_in_closed_form_equals_the_explicit_matrix(n, coefficients):
    explicit = banded_toeplitz_matrix(coefficients, n).norm(dim=0).max().item()
    assert max_column_norm(coefficients, n) == pytest.approx(explicit, rel=1e-13)
    assert BandedMatrixFactorization(coefficients=coefficients).sensitivity == pytest.approx(1.0, rel=1e-13)


@pytest.mark.parametrize("bands, n", [(1, 10), (3, 10), (4, 64), (8, 5)])
def test_expected_error_equals_the_explicit_matrix(bands, n):
    c = sqrt_toeplitz_coefficients(bands)
    C = banded_toeplitz_matrix(c, n)
    explicit = (prefix_sums(n) @ torch.linalg.inv(C)).pow(2).sum() * C.norm(dim=0).max() ** 2
    assert expected_prefix_sum_error(c, n) == pytest.approx(explicit.item(), rel=1e-10)
    if bands == 1:  # DP-SGD: the sum of the n prefix sums' variances
        assert expected_prefix_sum_error(c, n) == pytest.approx(n * (n + 1) / 2, rel=1e-12)


def test_optimised_coefficients_are_no_worse_than_the_square_root_and_better_than_dp_sgd():
    n, bands = 512, 6
    optimised = optimize_banded_toeplitz(bands, n)
    assert len(optimised) == bands and math.sqrt(sum(c * c for c in optimised)) == pytest.approx(1.0)
    error = expected_prefix_sum_error(optimised, n)
    assert error <= expected_prefix_sum_error(sqrt_toeplitz_coefficients(bands), n) * (1 + 1e-12)
    assert error < expected_prefix_sum_error([1.0], n)
    C = banded_toeplitz_matrix(optimised, n)  # and the fast objective is the matrix one at the optimum too
    explicit = (prefix_sums(n) @ torch.linalg.inv(C)).pow(2).sum() * C.norm(dim=0).max() ** 2
    assert error == pytest.approx(explicit.item(), rel=1e-8)


# -- the noise the optimizer adds ----------------------------------------------------------------------------


def noising_optimizer(numel, mechanism="gaussian", *, seed=0, sigma=1.0, bound=1.0, partitions=None):
    """A DPOptimizer over one parameter whose per-sample gradient is always zero: p.grad after a step is the noise."""
    p = nn.Parameter(torch.zeros(numel))
    opt = DPOptimizer(torch.optim.SGD([p], lr=0.0), noise_multiplier=sigma, max_grad_norm=bound,
                      expected_batch_size=None, loss_reduction="sum", generator=torch.Generator().manual_seed(seed),
                      noise_mechanism=mechanism)
    if opt.noise_mechanism is not None:
        opt.noise_mechanism.follow_cycle(lambda: opt.steps % (partitions or mechanism.bands), partitions
                                         or mechanism.bands)
    return p, opt


def noise_of_steps(p, opt, steps):
    rows = []
    for _ in range(steps):
        opt.zero_grad()
        p.grad, p.grad_sample = torch.zeros_like(p), torch.zeros(1, *p.shape)
        opt.step()
        rows.append(p.grad.detach().double().clone())
    return torch.stack(rows)


def test_the_noise_across_steps_has_the_covariance_of_c_inverse():
    """Each coordinate is an independent run of the mechanism: over d coordinates, the empirical covariance of the
    T steps' noise estimates (sigma C_clip)^2 C^-1 C^-T. Entry (s, t) is a mean of d products of jointly Gaussian
    values, whose variance is (S_ss S_tt + S_st^2) / d; every entry must lie within 6 of those standard deviations
    (a correct mechanism fails one of the 64 entries with probability below 1e-7; for d = 2e5 six of them are
    about 2% of the variances, so a covariance wrong by more than that fails)."""
    bands, steps, d, sigma, bound = 3, 8, 200_000, 1.3, 0.5
    mechanism = BandedMatrixFactorization(bands)
    p, opt = noising_optimizer(d, mechanism, sigma=sigma, bound=bound)
    noise = noise_of_steps(p, opt, steps)  # (steps, d)
    empirical = noise @ noise.T / d
    C_inv = torch.linalg.inv(banded_toeplitz_matrix(mechanism.coefficients, steps))
    expected = (sigma * bound) ** 2 * C_inv @ C_inv.T
    spread = ((expected.diag()[:, None] * expected.diag()[None, :] + expected ** 2) / d).sqrt()
    assert ((empirical - expected).abs() <= 6 * spread).all(), (empirical - expected) / spread
    assert not torch.allclose(expected, expected.diag().diag())  # (the noise is correlated: not a diagonal)
    assert mechanism.memory_bytes() == (bands - 1) * d * 4  # the last bands - 1 noise vectors, float32


def test_the_default_noise_is_the_independent_gaussian_draw_bit_for_bit():
    d, sigma, bound = 70_000, 0.9, 2.0  # (over NOISE_CHUNK: the block-parallel path)
    p, opt = noising_optimizer(d, sigma=sigma, bound=bound, seed=11)
    assert opt.noise_mechanism is None
    noise = noise_of_steps(p, opt, 3)
    generator, expected = torch.Generator().manual_seed(11), []
    for _ in range(3):
        out = torch.zeros(d)
        add_gaussian_noise_all_([out], sigma * bound, generator=generator)
        expected.append(out.double())
    assert torch.equal(noise, torch.stack(expected))


def test_one_band_is_independent_noise_of_the_same_std():
    p, opt = noising_optimizer(50_000, BandedMatrixFactorization(1), sigma=2.0)
    noise = noise_of_steps(p, opt, 4)
    empirical = noise @ noise.T / noise.shape[1]
    spread = 6 * math.sqrt(2 * 4.0 ** 2 / noise.shape[1])
    torch.testing.assert_close(empirical, 4.0 * torch.eye(4, dtype=torch.float64), rtol=0, atol=spread)


def test_resuming_from_a_checkpoint_gives_the_noise_of_a_run_that_never_stopped():
    bands, d = 4, 1000
    p, opt = noising_optimizer(d, BandedMatrixFactorization(bands), seed=3)
    noise_of_steps(p, opt, 6)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    after = noise_of_steps(p, opt, 5)

    p2, opt2 = noising_optimizer(d, BandedMatrixFactorization(bands), seed=99)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt2.noise_mechanism.steps == 6
    assert torch.equal(noise_of_steps(p2, opt2, 5), after)


def test_a_checkpoint_of_another_noise_mechanism_is_refused():
    _, banded = noising_optimizer(10, BandedMatrixFactorization(2))
    _, other_bands = noising_optimizer(10, BandedMatrixFactorization(3))
    _, gaussian = noising_optimizer(10)
    with pytest.raises(ValueError, match="'banded_mf' noise mechanism"):
        gaussian.load_state_dict(banded.state_dict())
    with pytest.raises(ValueError, match="independent Gaussian noise"):
        banded.load_state_dict(gaussian.state_dict())
    with pytest.raises(ValueError, match="coefficients"):
        other_bands.load_state_dict(banded.state_dict())


# -- what is refused ---------------------------------------------------------------------------------------


def test_banded_noise_without_a_cycle_to_follow_refuses_to_step():
    p = nn.Parameter(torch.zeros(3))
    opt = DPOptimizer(torch.optim.SGD([p], lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=None,
                      loss_reduction="sum", noise_mechanism=BandedMatrixFactorization(2))
    p.grad, p.grad_sample = torch.zeros(3), torch.zeros(1, 3)
    with pytest.raises(StepRefusedError, match="CyclicPoissonDataLoader"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3)) and opt.steps == 0


def test_a_batch_out_of_the_cycle_is_refused():
    mechanism = BandedMatrixFactorization(2)
    p, opt = noising_optimizer(3, mechanism)
    positions = [0, 1, 0, 0]  # the fourth step gets part 0 again: a batch was skipped
    mechanism.follow_cycle(lambda: positions[opt.steps], 2)
    noise_of_steps(p, opt, 3)
    state = opt.state_dict()
    with pytest.raises(StepRefusedError, match="cycle position 0"):
        noise_of_steps(p, opt, 1)
    assert opt.steps == 3 and opt.noise_mechanism.steps == 3  # refused before anything moved
    assert all(torch.equal(a, b) for a, b in zip(opt.state_dict()["fxdp"]["noise_mechanism"]["state"]["history"][0],
                                                  state["fxdp"]["noise_mechanism"]["state"]["history"][0]))


def test_fewer_partitions_than_bands_and_unknown_mechanisms_are_refused():
    with pytest.raises(PrivacySettingError, match="at least 3 partitions"):
        BandedMatrixFactorization(3).follow_cycle(lambda: 0, 2)
    plain_poisson = DPDataLoader(TensorDataset(torch.zeros(10, 1)), sample_rate=0.5)
    with pytest.raises(PrivacySettingError, match="a DPDataLoader does not guarantee that.*CyclicPoissonDataLoader"):
        BandedMatrixFactorization(3).follow(plain_poisson)
    with pytest.raises(PrivacySettingError, match="noise_mechanism must be"):
        noising_optimizer(3, "banded")
    with pytest.raises(PrivacySettingError, match="c_0 > 0"):
        BandedMatrixFactorization(coefficients=[0.0, 1.0])


def test_an_optimizer_that_adds_noise_its_own_way_refuses_a_noise_mechanism():
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(PrivacySettingError, match="AdaClipDPOptimizer"):
        AdaClipDPOptimizer(torch.optim.SGD([p], lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                           expected_batch_size=4, target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
                           max_clipbound=10.0, min_clipbound=0.1, unclipped_num_std=1.0,
                           noise_mechanism=BandedMatrixFactorization(2))
