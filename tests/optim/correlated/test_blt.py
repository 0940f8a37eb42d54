"""BLT noise: the stream it adds equals the explicit matrix form ``C^-1 Z`` (float64), its min-separation
sensitivity equals the brute-force maximum over all participation patterns, its state is buffers x parameters
and survives a checkpoint bit for bit, and the settings it refuses, with the error text."""

from __future__ import annotations

import itertools

import pytest
import torch

from fxdp.optim.correlated import (BufferedLinearToeplitz, blt_prefix_sum_error, blt_toeplitz_coefficients,
                                   min_separation_sensitivity, optimize_blt)
from fxdp.optim.correlated.banded import banded_toeplitz_matrix
from fxdp.optim.noise import add_gaussian_noise_all_
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError

THETA, OMEGA = [0.98, 0.8, 0.3], [0.15, 0.2, 0.1]
SHAPES = [(3, 2), (5,)]


def following(mechanism, partitions):
    """The mechanism set to follow a cycle of ``partitions`` whose batches come in order, one per step."""
    mechanism.follow_cycle(lambda: mechanism.steps % partitions, partitions)
    return mechanism


def run(mechanism, steps, seed=0, std=1.0):
    """The noise of ``steps`` steps on zero float64 gradients: a (steps, parameters) matrix."""
    return torch.stack(noise_rows(mechanism, steps, torch.Generator().manual_seed(seed), std))


def noise_rows(mechanism, steps, generator, std=1.0):
    """The noise of ``steps`` steps on zero float64 gradients drawn from ``generator``: one flat row per step."""
    rows = []
    for _ in range(steps):
        outs = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        mechanism.add_noise_(outs, std, generator=generator)
        rows.append(torch.cat([o.flatten() for o in outs]))
    return rows


def draws(steps, seed=0):
    """The standard normal ``Z`` the mechanism draws from the same generator (one draw per parameter per step)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(steps):
        outs = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        add_gaussian_noise_all_(outs, 1.0, generator=generator)
        rows.append(torch.cat([o.flatten() for o in outs]))
    return torch.stack(rows)


@pytest.mark.parametrize("steps, min_separation", [(12, None), (12, 4), (9, 1)])
def test_the_noise_stream_is_the_explicit_inverse_of_the_normalised_strategy_times_z(steps, min_separation):
    mechanism = following(BufferedLinearToeplitz(THETA, OMEGA, steps=steps, min_separation=min_separation),
                          min_separation or steps)
    noise = run(mechanism, steps, std=2.5)
    coefficients = blt_toeplitz_coefficients(THETA, OMEGA, steps)
    c = banded_toeplitz_matrix(coefficients.tolist(), steps)
    sensitivity = min_separation_sensitivity(coefficients, steps, min_separation or steps)
    explicit = 2.5 * torch.linalg.solve_triangular(c / sensitivity, draws(steps), upper=False)
    torch.testing.assert_close(noise, explicit, rtol=1e-10, atol=1e-12)
    # and C (normalised) times the noise gives back the independent draws, scaled
    torch.testing.assert_close((c / sensitivity) @ noise / 2.5, draws(steps), rtol=1e-10, atol=1e-12)


def test_one_buffer_with_zero_scale_is_dp_sgds_independent_noise():
    mechanism = following(BufferedLinearToeplitz([0.5], [0.0], steps=5), 5)
    assert mechanism.scale == 1.0
    torch.testing.assert_close(run(mechanism, 5, seed=3), draws(5, seed=3), rtol=0, atol=0)


@pytest.mark.parametrize("n, b", [(10, 3), (9, 2), (8, 8), (7, 1)])
def test_min_separation_sensitivity_is_the_largest_over_all_patterns(n, b):
    coefficients = blt_toeplitz_coefficients(THETA, OMEGA, n)
    c = banded_toeplitz_matrix(coefficients.tolist(), n)
    best = 0.0
    for size in range(1, n + 1):
        for steps in itertools.combinations(range(n), size):
            if all(later - earlier >= b for earlier, later in zip(steps, steps[1:])):
                best = max(best, float(c[:, list(steps)].sum(1).norm()))
    assert float(min_separation_sensitivity(coefficients, n, b)) == pytest.approx(best, rel=1e-12)


def test_state_is_buffers_times_parameters_and_a_checkpoint_continues_the_same_noise():
    whole = following(BufferedLinearToeplitz(THETA, OMEGA, steps=10, min_separation=5), 5)
    expected = run(whole, 10, seed=7)
    first = following(BufferedLinearToeplitz(THETA, OMEGA, steps=10, min_separation=5), 5)
    generator = torch.Generator().manual_seed(7)
    rows = noise_rows(first, 6, generator)
    assert first.memory_bytes() == 3 * sum(torch.zeros(s).numel() for s in SHAPES) * 8
    state, generator_state = first.state_dict(), generator.get_state()
    resumed = following(BufferedLinearToeplitz(THETA, OMEGA, steps=10, min_separation=5), 5)
    resumed.load_state_dict(state)
    generator = torch.Generator()
    generator.set_state(generator_state)
    rows += noise_rows(resumed, 4, generator)
    assert torch.equal(torch.stack(rows), expected)
    other = BufferedLinearToeplitz(THETA, OMEGA, steps=11, min_separation=5)
    with pytest.raises(ValueError, match="checkpoint's BLT .* differs"):
        other.load_state_dict(state)


def test_optimised_blt_beats_dp_sgd_and_its_normalised_sensitivity_is_one():
    mechanism = BufferedLinearToeplitz.optimized(2, steps=64, min_separation=16)
    assert mechanism.sensitivity == pytest.approx(1.0, rel=1e-12)
    dp_sgd = 64 * 65 / 2 * 4  # C = I: n (n + 1) / 2 per participation-squared (4 participations)
    assert mechanism.expected_prefix_sum_error() < 0.5 * dp_sgd
    theta, omega = optimize_blt(2, 64, min_separation=16)
    assert list(mechanism.theta) == theta and list(mechanism.omega) == omega
    assert blt_prefix_sum_error([0.0], [0.0], 64, min_separation=16) == pytest.approx(dp_sgd)


def test_refusals_name_what_to_do():
    with pytest.raises(PrivacySettingError, match=r"theta in \[0, 1\).*optimize_blt"):
        BufferedLinearToeplitz([1.2], [0.1], steps=10)
    with pytest.raises(PrivacySettingError, match=r"sum\(omega\) <= 1"):
        BufferedLinearToeplitz([0.5, 0.4], [0.6, 0.6], steps=10)
    with pytest.raises(PrivacySettingError, match="as many decays"):
        BufferedLinearToeplitz([0.5, 0.4], [0.6], steps=10)
    with pytest.raises(PrivacySettingError, match="steps .* must be an int >= 1"):
        BufferedLinearToeplitz([0.5], [0.1], steps=0)
    mechanism = BufferedLinearToeplitz(THETA, OMEGA, steps=4, min_separation=2)
    with pytest.raises(StepRefusedError, match="CyclicPoissonDataLoader"):
        mechanism.add_noise_([torch.zeros(2)], 1.0)
    with pytest.raises(PrivacySettingError, match="BLT with a minimum separation of 2 needs a cyclic loader of at "
                                                  "least 2 partitions"):
        mechanism.follow_cycle(lambda: 0, 1)
    following(mechanism, 2)
    run(mechanism, 4)
    with pytest.raises(StepRefusedError, match="planned .* for 4 steps and all have run"):
        run(mechanism, 1)


def test_optimised_strategies_are_cached_and_not_shared_mutably():
    from fxdp.optim.correlated.blt import optimize_blt_cache_info

    first = optimize_blt(1, 40, min_separation=10)
    hits = optimize_blt_cache_info().hits
    second = optimize_blt(1, 40, min_separation=10)
    assert optimize_blt_cache_info().hits == hits + 1 and second == first
    second[0].append(0.5)
    assert len(optimize_blt(1, 40, min_separation=10)[0]) == 1


def test_the_noise_is_the_per_parameter_recurrence_in_float64_within_rounding():
    """add_noise_ runs the recurrence on one (buffers, values) tensor per dtype (a matrix-vector product for the
    weighted sum, a fused update of the buffers; fxdp.optim.correlated.blt_state): its values are those of the plain
    loop over parameters, w -= omega_i u_i, then u_i = theta_i u_i + w, then out += std * scale * w, computed in
    float64 from the same draws, within the rounding of the parameters' dtype, in float32 and float64 together and
    over a large tensor (drawn in blocks); and the float32 noise is no further from it than the float32 loop's."""
    shapes, dtypes = [(70_000,), (3, 5), (7,), (2, 3)], [torch.float32, torch.float32, torch.float64, torch.float32]
    mechanism = following(BufferedLinearToeplitz(THETA, OMEGA, steps=20, min_separation=5), 5)
    generator, reference_generator = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    exact = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in THETA]
    loop = [[torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)] for _ in THETA]
    for _ in range(12):
        outs = [torch.full(s, 0.5, dtype=d) for s, d in zip(shapes, dtypes)]
        mechanism.add_noise_(outs, 1.3, generator=generator)
        draws = [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]
        add_gaussian_noise_all_(draws, 1.0, generator=reference_generator)
        for k, (out, z) in enumerate(zip(outs, draws)):
            w, w_loop = z.double(), z.clone()
            for omega, buffer, buffer_loop in zip(OMEGA, exact, loop):
                w.sub_(buffer[k], alpha=omega)
                w_loop.sub_(buffer_loop[k], alpha=omega)
            for theta, buffer, buffer_loop in zip(THETA, exact, loop):
                buffer[k].mul_(theta).add_(w)
                buffer_loop[k].mul_(theta).add_(w_loop)
            expected = 0.5 + 1.3 * mechanism.scale * w
            # each value: d + 2 roundings a step, of values about the size of the noise, carried over the steps by
            # decays below 1; measured about one unit of the last place of the largest value (float32, float64)
            eps, size = torch.finfo(out.dtype).eps, float(expected.abs().max())
            assert float((out.double() - expected).abs().max()) <= 16 * eps * size
            if out.dtype == torch.float32:
                loop_error = float((0.5 + 1.3 * mechanism.scale * w_loop.double() - expected).abs().max())
                assert float((out.double() - expected).abs().max()) <= max(2 * loop_error, 4 * eps * size)


def test_changed_parameters_are_refused_and_a_refused_step_keeps_the_checkpoints_state():
    """The state is buffers per parameter: tensors of other shapes or dtypes than the first step's are refused, and
    so are a checkpoint's buffers for other shapes; the refusal changes nothing (the right tensors then continue the
    checkpoint's noise, bit for bit)."""
    whole = following(BufferedLinearToeplitz(THETA, OMEGA, steps=6), 6)
    expected = run(whole, 4, seed=2)
    first = following(BufferedLinearToeplitz(THETA, OMEGA, steps=6), 6)
    generator = torch.Generator().manual_seed(2)
    rows = noise_rows(first, 2, generator)
    for changed in ([torch.zeros(3, 3, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)],
                    [torch.zeros(s, dtype=torch.float32) for s in SHAPES]):
        with pytest.raises(StepRefusedError, match="trainable parameters changed since the BLT noise began"):
            first.add_noise_(changed, 1.0, generator=torch.Generator())
    resumed = following(BufferedLinearToeplitz(THETA, OMEGA, steps=6), 6)
    resumed.load_state_dict(first.state_dict())
    with pytest.raises(StepRefusedError, match="trainable parameters changed since the BLT noise began"):
        resumed.add_noise_([torch.zeros(4, dtype=torch.float64)], 1.0, generator=torch.Generator())
    assert resumed.steps == 2 and resumed.memory_bytes() == 3 * 11 * 8
    rows += noise_rows(resumed, 2, generator)
    assert torch.equal(torch.stack(rows), expected)
