"""Tree aggregation (DP-FTRL's binary tree) as a noise mechanism: its strategy built from the dyadic intervals (B C
is the prefix-sum workload), the noise stream equal to the explicit C^-1 Z, the prefix noise equal to the sum of the
decomposition's node noises, its sensitivity (exact for one participation, an upper bound never below the brute-
force maximum under min-separation), the covariance of the noise the DP optimizer adds, its O(log T) state, a
checkpoint continuing the same noise bit for bit, and what is refused.

References are built in the test from the definition (dyadic intervals, binary decompositions), not from
:func:`tree_matrices`."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fxdp.optim.correlated import TreeAggregation, tree_matrices, tree_sensitivity
from fxdp.optim.noise import add_gaussian_noise_all_
from fxdp.sinks.contract import PrivacySettingError, StepRefusedError
from tests.optim.correlated.test_banded import noise_of_steps, noising_optimizer

SHAPES = [(3, 2), (5,)]


def dyadic_reference(n):
    """The released intervals of the online tree over ``n`` steps, in the order they complete, as sets, and for
    each prefix ``[0, t]`` the indices of the intervals of its binary decomposition (from the bits of t + 1)."""
    intervals, position = [], {}
    for t in range(n):  # at step t, the intervals ending at t that some prefix uses: the one of length lowbit
        m = t + 1
        length = 1
        while m % (2 * length) == 0:
            length *= 2
        position[(t + 1 - length, t)] = len(intervals)
        intervals.append(set(range(t + 1 - length, t + 1)))
    decompositions = []
    for t in range(n):
        start, parts = 0, []
        for bit in reversed(range((t + 1).bit_length())):
            if (t + 1) >> bit & 1:
                parts.append(position[(start, start + 2 ** bit - 1)])
                start += 2 ** bit
        decompositions.append(parts)
    return intervals, decompositions


@pytest.mark.parametrize("n", [1, 2, 7, 8, 13, 33])
def test_the_strategy_is_the_dyadic_intervals_and_b_c_is_the_prefix_sum_workload(n):
    intervals, decompositions = dyadic_reference(n)
    C, B = tree_matrices(n)
    expected_C = torch.tensor([[1.0 if s in interval else 0.0 for s in range(n)] for interval in intervals],
                              dtype=torch.float64)
    expected_B = torch.zeros(n, n, dtype=torch.float64)
    for t, parts in enumerate(decompositions):
        expected_B[t, parts] = 1.0
    assert torch.equal(C, expected_C) and torch.equal(B, expected_B)
    assert torch.equal(B @ C, torch.tril(torch.ones(n, n, dtype=torch.float64)))
    assert torch.equal(C, torch.tril(C)) and torch.equal(C.diag(), torch.ones(n, dtype=torch.float64))


def following(mechanism, partitions):
    mechanism.follow_cycle(lambda: mechanism.steps % partitions, partitions)
    return mechanism


def run(mechanism, steps, generator, std=1.0):
    rows = []
    for _ in range(steps):
        outs = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        mechanism.add_noise_(outs, std, generator=generator)
        rows.append(torch.cat([o.flatten() for o in outs]))
    return torch.stack(rows)


def draws(steps, seed=0):
    generator, rows = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        outs = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        add_gaussian_noise_all_(outs, 1.0, generator=generator)
        rows.append(torch.cat([o.flatten() for o in outs]))
    return torch.stack(rows)


@pytest.mark.parametrize("steps", [1, 5, 16, 23])
def test_the_noise_stream_is_c_inverse_z_and_its_prefix_sums_are_the_decompositions_node_noises(steps):
    mechanism = following(TreeAggregation(steps=steps), steps)
    noise = run(mechanism, steps, torch.Generator().manual_seed(0), std=1.7)
    Z = draws(steps)  # z_t: the noise of the interval released at step t
    C, _ = tree_matrices(steps)
    torch.testing.assert_close(noise, 1.7 * torch.linalg.solve_triangular(C, Z, upper=False), rtol=1e-12, atol=1e-12)
    _, decompositions = dyadic_reference(steps)
    prefix = noise.cumsum(0)
    for t, parts in enumerate(decompositions):
        torch.testing.assert_close(prefix[t], 1.7 * Z[parts].sum(0), rtol=1e-12, atol=1e-12)


def brute_force_sensitivity(n, b):
    """max over every non-empty set of steps with consecutive ones b or more apart of ||sum of C's columns||."""
    C, _ = tree_matrices(n)
    best = 0.0
    for r in range(1, -(-n // b) + 1):
        for steps in itertools.combinations(range(n), r):
            if all(j - i >= b for i, j in zip(steps, steps[1:])):
                best = max(best, float(C[:, list(steps)].sum(1).norm()))
    return best


@pytest.mark.parametrize("n", [1, 6, 8, 13])
def test_single_participation_sensitivity_is_the_largest_column_norm(n):
    C, _ = tree_matrices(n)
    assert tree_sensitivity(n) == pytest.approx(float(C.norm(dim=0).max()), rel=1e-12)
    assert tree_sensitivity(n) ** 2 == pytest.approx(math.floor(math.log2(n)) + 1, rel=1e-12)
    assert TreeAggregation(steps=n).sensitivity == tree_sensitivity(n)


@pytest.mark.parametrize("n, b", [(8, 1), (8, 2), (8, 3), (12, 4), (13, 5), (16, 4), (16, 7), (14, 14)])
def test_the_min_separation_sensitivity_bounds_the_brute_force_maximum(n, b):
    exact = brute_force_sensitivity(n, b)
    bound = tree_sensitivity(n, b)
    assert bound >= exact - 1e-12
    # tight here: the Algorithm 4 bound reaches the maximum on these small cases (the closed form alone does not:
    # up to 1.27x above it)
    assert bound == pytest.approx(exact, rel=1e-12)


def test_the_noise_across_steps_has_the_covariance_of_c_inverse():
    """As for banded MF (tests/optim/correlated/test_banded.py): each coordinate an independent run; every entry of
    the empirical covariance within 6 standard deviations of its estimate, (S_ss S_tt + S_st^2) / d."""
    steps, d, sigma, bound = 8, 200_000, 1.3, 0.5
    mechanism = TreeAggregation(steps=steps)
    p, opt = noising_optimizer(d, mechanism, sigma=sigma, bound=bound, partitions=steps)
    noise = noise_of_steps(p, opt, steps)
    empirical = noise @ noise.T / d
    C_inv = torch.linalg.inv(tree_matrices(steps)[0])
    expected = (sigma * bound) ** 2 * C_inv @ C_inv.T
    spread = ((expected.diag()[:, None] * expected.diag()[None, :] + expected ** 2) / d).sqrt()
    assert ((empirical - expected).abs() <= 6 * spread).all(), (empirical - expected) / spread
    assert not torch.allclose(expected, expected.diag().diag())


def test_state_is_log_steps_node_noises_and_a_checkpoint_continues_the_same_noise():
    steps, params = 40, sum(math.prod(s) for s in SHAPES)
    straight = following(TreeAggregation(steps=steps), steps)
    all_noise = run(straight, steps, torch.Generator().manual_seed(3))
    first, generator = following(TreeAggregation(steps=steps), steps), torch.Generator().manual_seed(3)
    sizes = []
    for _ in range(31):
        run(first, 1, generator)
        sizes.append(first.memory_bytes())
    # after step t the decomposition of t + 1 is kept: one node noise per set bit, float64 here
    assert sizes == [bin(t + 1).count("1") * params * 8 for t in range(31)]
    assert max(sizes) <= (math.floor(math.log2(steps)) + 1) * params * 8
    state, generator_state = first.state_dict(), generator.get_state()
    resumed = following(TreeAggregation(steps=steps), steps)
    resumed.load_state_dict(state)
    generator.set_state(generator_state)
    assert torch.equal(run(resumed, steps - 31, generator), all_noise[31:])
    with pytest.raises(ValueError, match=r"checkpoint's tree aggregation \(steps, min_separation\) \(40, 40\) differs"):
        TreeAggregation(steps=41).load_state_dict(state)
    with pytest.raises(StepRefusedError, match="planned .* for 40 steps and all have run"):
        run(resumed, 1, generator)


def test_what_is_refused():
    with pytest.raises(PrivacySettingError, match="steps .* must be an int >= 1, got 0"):
        TreeAggregation(steps=0)
    with pytest.raises(PrivacySettingError, match="min_separation must be an int >= 1"):
        TreeAggregation(steps=4, min_separation=0)
    mechanism = TreeAggregation(steps=10, min_separation=5)
    with pytest.raises(PrivacySettingError, match="at least 5 partitions"):
        mechanism.follow_cycle(lambda: 0, 4)
    with pytest.raises(StepRefusedError, match="call noise_mechanism.follow"):
        TreeAggregation(steps=4).add_noise_([torch.zeros(2)], 1.0)
