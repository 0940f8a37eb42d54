"""Privacy accounting: ε against reference values, against exact quadrature, calibration, checkpoints.

The RDP accountant is checked three ways: per order against the defining integral evaluated by
mpmath quadrature (exact to 1e-9, independent of the series it uses); end to end against ε values
that dp-accounting's RDP accountant produced once (written below, no package needed); and live
against dp-accounting when it is installed.
"""

import json
import math
import sys

import mpmath  # ships with torch (through sympy)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxdp.accounting import (
    DEFAULT_ORDERS,
    GDPAccountant,
    PLDAccountant,
    RDPAccountant,
    create_accountant,
    get_noise_multiplier,
)
from fxdp.accounting.rdp import rdp_of_step


def _history_accountant(kind, history):
    accountant = create_accountant(kind)
    for sigma, q, steps in history:
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant


# --- reference values ---------------------------------------------------------------------------------
# Produced once with dp-accounting 0.6.0 (pip install dp-accounting), by:
#
#   import dp_accounting as dpa
#   from dp_accounting.rdp import RdpAccountant
#   from dp_accounting.pld import PLDAccountant
#
#   def reference(accountant, history, delta):  # history: [(noise_multiplier, sample_rate, steps)]
#       accountant.compose(dpa.ComposedDpEvent([
#           dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), n)
#           for s, q, n in history]))
#       return accountant.get_epsilon(delta)
#
#   reference(RdpAccountant(), history, delta)   # RDP_REFERENCE
#   reference(PLDAccountant(), history, delta)   # PLD_REFERENCE
#
# (history, delta, epsilon)
RDP_REFERENCE = [
    ([(1.0, 0.01, 1000)], 1e-5, 2.101366525420273),
    ([(0.6, 0.001, 10000)], 1e-6, 3.9991858528326922),
    ([(2.0, 0.1, 500)], 1e-5, 6.034562203370491),
    ([(0.8, 0.004, 25000)], 1e-5, 6.316892354365717),
    ([(10.0, 0.02, 100)], 1e-5, 0.07099584425381932),
    ([(3.0, 1.0, 10)], 1e-5, 5.023949750348651),
    ([(1.1, 0.0445, 600)], 1e-5, 6.683739564664176),
    ([(1.0, 0.01, 500), (2.0, 0.05, 200), (0.7, 0.002, 3000)], 1e-5, 3.027018181435685),
]
PLD_REFERENCE = [
    ([(1.5, 0.01, 300)], 1e-5, 0.4960358945713442),
    ([(3.0, 1.0, 10)], 1e-5, 4.65298457064985),
    ([(2.0, 0.05, 100), (3.0, 1.0, 5)], 1e-6, 3.769163930486098),
]
# dp-accounting sums the fractional-order series until a term is below e^-30 in absolute terms, which
# leaves its RDP up to ~4e-4 relative above the exact integral (e.g. q=0.0445, sigma=1.1, order 3.9:
# 0.00579889 against mpmath's 0.0057964926); ours stops relative to the sum and matches mpmath to 1e-8
# (test_rdp_of_one_step_matches_quadrature). The ε values therefore agree to 5e-4, not to rounding.
RDP_REFERENCE_RTOL = 5e-4


@pytest.mark.parametrize("history, delta, epsilon", RDP_REFERENCE)
def test_rdp_epsilon_matches_dp_accounting_reference(history, delta, epsilon):
    accountant = RDPAccountant()
    accountant.history = list(history)
    assert accountant.get_epsilon(delta) == pytest.approx(epsilon, rel=RDP_REFERENCE_RTOL)


def test_rdp_epsilon_matches_dp_accounting_live():
    dpa = pytest.importorskip("dp_accounting")
    for history, delta, _ in RDP_REFERENCE[::3]:  # a few: dp-accounting's RDP takes ~0.3 s per case
        theirs = dpa.rdp.RdpAccountant()
        for sigma, q, steps in history:
            theirs.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
        ours = _history_accountant("rdp", history)
        assert ours.get_epsilon(delta) == pytest.approx(theirs.get_epsilon(delta), rel=RDP_REFERENCE_RTOL)


def _exact_rdp(q, sigma, order):
    """RDP of one sampled Gaussian step from its defining integral (Mironov et al. 2019, eq. for A_alpha)."""
    mpmath.mp.dps = 30
    q, sigma, order = mpmath.mpf(q), mpmath.mpf(sigma), mpmath.mpf(order)

    def integrand(z):
        ratio = (1 - q) + q * mpmath.exp((2 * z - 1) / (2 * sigma ** 2))
        return mpmath.npdf(z, 0, sigma) * ratio ** order

    points = [-mpmath.inf, -10 * sigma, 0, 0.5, 1, order, 10 * sigma + order, mpmath.inf]
    return float(mpmath.log(mpmath.quad(integrand, sorted(set(points)))) / (order - 1))


@pytest.mark.parametrize(
    "q, sigma, order",
    [
        (0.01, 1.0, 7.8),  # fractional, fast-converging series
        (0.1, 2.0, 4.4),
        (0.001, 0.6, 4.4),
        (0.3, 0.3, 1.2),  # small noise: huge terms, log space
        (0.01, 0.05, 2.5),
        (0.5, 5.0, 1.5),  # q = 1/2: terms shrink slowly, the series stops with its upper bound
        (0.1, 2.0, 4.0),  # integer: binomial sum
        (0.05, 0.8, 12.0),
    ],
)
def test_rdp_of_one_step_matches_quadrature(q, sigma, order):
    assert rdp_of_step(q, sigma, order) == pytest.approx(_exact_rdp(q, sigma, order), rel=1e-8)


def test_rdp_fractional_series_meets_integer_sum_and_full_sampling_limit():
    # the series (fractional orders) and the binomial sum (integer orders) are different formulas
    for q, sigma in [(0.01, 1.0), (0.2, 0.7), (0.6, 3.0)]:
        for order in (2.0, 5.0, 32.0):
            assert rdp_of_step(q, sigma, order + 1e-7) == pytest.approx(rdp_of_step(q, sigma, order), rel=1e-5)
    # q -> 1 tends to the plain Gaussian mechanism, RDP alpha / (2 sigma^2)
    for order in (1.5, 3.0, 20.0):
        assert rdp_of_step(1 - 1e-9, 1.3, order) == pytest.approx(order / (2 * 1.3 ** 2), rel=1e-6)


# --- edge cases and argument checks ---------------------------------------------------------------------


def test_edge_cases_of_the_mechanism():
    never_sampled = _history_accountant("rdp", [(1.0, 0.0, 100), (0.0, 0.0, 5)])
    assert never_sampled.get_epsilon(1e-5) == 0.0
    assert RDPAccountant().get_epsilon(1e-5) == 0.0  # nothing recorded
    no_noise = _history_accountant("rdp", [(1.0, 0.01, 10), (0.0, 0.01, 1)])
    assert no_noise.get_epsilon(1e-5) == math.inf
    # more steps, more epsilon; a longer history costs at least as much as its prefix
    assert _history_accountant("rdp", [(1.0, 0.01, 10)]).get_epsilon(1e-5) < _history_accountant(
        "rdp", [(1.0, 0.01, 10), (1.5, 0.02, 3)]
    ).get_epsilon(1e-5)


def test_history_merges_repeated_steps_and_counts_them():
    accountant = _history_accountant("rdp", [(1.0, 0.01, 3), (2.0, 0.01, 2), (1.0, 0.01, 1)])
    assert accountant.history == [(1.0, 0.01, 3), (2.0, 0.01, 2), (1.0, 0.01, 1)]
    assert len(accountant) == 6
    assert accountant.mechanism == "rdp"


@pytest.mark.parametrize("delta", [0, 1, -1e-5, 1.5, float("nan"), "1e-5", None])
def test_bad_delta_is_a_value_error_naming_delta(delta):
    with pytest.raises(ValueError, match="delta"):
        RDPAccountant().get_epsilon(delta)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(noise_multiplier=-1.0, sample_rate=0.1), "noise_multiplier"),
        (dict(noise_multiplier=float("inf"), sample_rate=0.1), "noise_multiplier"),
        (dict(noise_multiplier=1.0, sample_rate=1.5), "sample_rate"),
        (dict(noise_multiplier=1.0, sample_rate=-0.1), "sample_rate"),
        (dict(noise_multiplier=1.0, sample_rate=float("nan")), "sample_rate"),
    ],
)
def test_bad_step_arguments_are_value_errors_naming_them(kwargs, name):
    accountant = RDPAccountant()
    with pytest.raises(ValueError, match=name):
        accountant.step(**kwargs)
    assert accountant.history == []


def test_create_accountant_names_the_choices():
    assert isinstance(create_accountant("rdp"), RDPAccountant)
    assert isinstance(create_accountant("prv"), PLDAccountant)  # Opacus's default, under its name
    assert isinstance(create_accountant("gdp"), GDPAccountant)
    with pytest.raises(ValueError, match="'pld', 'rdp', 'prv', 'gdp'"):
        create_accountant("moments")


def test_pld_without_dp_accounting_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # makes `import dp_accounting` fail
    for make in (PLDAccountant, lambda: create_accountant("pld")):
        with pytest.raises(ImportError, match=r"a dependency of fxdp that is missing here: pip install dp-accounting"):
            make()
    with pytest.raises(ImportError, match="dp-accounting"):
        get_noise_multiplier(
            target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=100, accountant="pld"
        )


# --- checkpoints ---------------------------------------------------------------------------------------


def test_state_dict_round_trip_preserves_epsilon_and_the_next_steps(tmp_path):
    before = _history_accountant("rdp", [(1.0, 0.01, 300), (1.3, 0.02, 50)])
    torch.save({"accountant": before.state_dict()}, tmp_path / "ckpt.pt")
    after = RDPAccountant()
    after.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["accountant"])
    assert after.history == before.history and len(after) == len(before) == 350
    assert after.get_epsilon(1e-5) == before.get_epsilon(1e-5) > 0
    for accountant in (before, after):
        for _ in range(20):
            accountant.step(noise_multiplier=1.3, sample_rate=0.02)
    assert after.history == before.history
    assert after.get_epsilon(1e-5) == before.get_epsilon(1e-5)
    # a JSON round trip (tuples become lists) loads too
    again = RDPAccountant()
    again.load_state_dict(json.loads(json.dumps(after.state_dict())))
    assert again.get_epsilon(1e-5) == after.get_epsilon(1e-5)


@pytest.mark.parametrize(
    "state, match",
    [
        ([(1.0, 0.1, 3)], "history"),
        ({"history": [(1.0, 0.1)], "mechanism": "rdp"}, r"history\[0\]"),
        ({"history": [(1.0, 2.0, 3)], "mechanism": "rdp"}, "sample_rate"),
        ({"history": [(1.0, 0.1, -3)], "mechanism": "rdp"}, "num_steps"),
        ({"history": []}, "mechanism"),  # a state_dict() always names its mechanism
    ],
)
def test_load_state_dict_refuses_malformed_histories(state, match):
    with pytest.raises(ValueError, match=match):
        RDPAccountant().load_state_dict(state)


# --- calibration ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target_epsilon, target_delta, sample_rate, steps, tolerance",
    [(3.0, 1e-5, 64 / 1437, 449, 0.01), (1.0, 1e-5, 0.01, 1000, 0.01), (8.0, 1e-6, 0.004, 5000, 0.01),
     (0.5, 1e-5, 1.0, 1, 0.01), (0.5, 1e-5, 1.0, 1, 1e-4)],
)
def test_calibrated_noise_lands_within_the_absolute_tolerance_below_the_target(
    target_epsilon, target_delta, sample_rate, steps, tolerance
):
    # epsilon_tolerance is absolute, as Opacus documents it (for a target of 0.5, 0.01 is 2%)
    sigma = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=sample_rate,
                                 steps=steps, epsilon_tolerance=tolerance)
    accountant = RDPAccountant()
    accountant.history = [(sigma, sample_rate, steps)]
    assert target_epsilon - tolerance <= accountant.get_epsilon(target_delta) <= target_epsilon


def test_calibration_finds_the_noise_opacus_finds():
    """Opacus 1.6's get_noise_multiplier for epsilon 8, delta 1e-5, sample rate 0.04 (its own tests' figures):
    the same bisection over the same accountant lands on the same noise multiplier, so a run switched from
    Opacus trains with the same noise."""
    common = dict(target_epsilon=8.0, target_delta=1e-5, sample_rate=0.04)
    assert get_noise_multiplier(**common, epochs=90, accountant="rdp") == pytest.approx(1.416, abs=5e-5)
    assert get_noise_multiplier(**common, steps=2000, accountant="rdp") == pytest.approx(1.3562, abs=5e-5)
    with pytest.warns(UserWarning, match="central-limit approximation"):
        assert get_noise_multiplier(**common, epochs=90, accountant="gdp") == 1.3232421875


def test_calibration_from_epochs_counts_every_step_begun():
    q = 64 / 1437  # 20 / q = 449.06...: the 450th step is taken, and spends privacy
    by_epochs = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, epochs=20)
    by_steps = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, steps=450)
    assert by_epochs == by_steps


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=100, epochs=1), "exactly one of steps and epochs"),
        (dict(), "exactly one of steps and epochs"),
        (dict(steps=0), "steps is 0"),
        (dict(epochs=1e-12), r"ceil\(epochs / sample_rate\)"),
        (dict(steps=100, sample_rate=0.0), "sample_rate is 0"),
        (dict(steps=100, target_epsilon=0.0), "target_epsilon"),
        (dict(steps=100, target_delta=0.0), "delta"),
        (dict(steps=100, accountant="moments"), "'pld', 'rdp', 'prv', 'gdp'"),
        (dict(steps=100, epsilon_tolerance=0.0), "epsilon_tolerance"),
        (dict(steps=100, epsilon_tolerance=math.inf), "epsilon_tolerance"),
        # noise large enough to meet it drives epsilon from ~0.004 straight to 0 (total variation <= delta)
        (dict(steps=1, sample_rate=1.0, target_epsilon=1e-4, epsilon_tolerance=1e-6), "larger epsilon_tolerance"),
        (dict(steps=1, sample_rate=1.0, target_epsilon=1e13), "so large"),
    ],
)
def test_calibration_errors_say_what_is_wrong(kwargs, match):
    arguments = dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=match):
        get_noise_multiplier(**arguments)


# --- monotonicity --------------------------------------------------------------------------------------

# A few orders of both kinds (fractional: series; integer: binomial sum) keep hypothesis fast.
_ORDERS = (1.5, 2.0, 3.5, 8.0, 32.0)
_rates = st.floats(min_value=1e-3, max_value=0.3)
_sigmas = st.floats(min_value=0.5, max_value=5.0)


def _epsilon(sigma, q, steps):
    accountant = RDPAccountant(orders=_ORDERS)
    accountant.history = [(sigma, q, steps)]
    return accountant.get_epsilon(1e-5)


@settings(max_examples=25, deadline=None)
@given(sigma=_sigmas, q=_rates, steps=st.integers(1, 500), more=st.integers(1, 500))
def test_epsilon_grows_with_steps(sigma, q, steps, more):
    assert _epsilon(sigma, q, steps + more) >= _epsilon(sigma, q, steps)


@settings(max_examples=25, deadline=None)
@given(sigma=_sigmas, q=_rates, factor=st.floats(1.05, 3.0))
def test_epsilon_grows_with_sample_rate(sigma, q, factor):
    assert _epsilon(sigma, min(q * factor, 1.0), 100) > _epsilon(sigma, q, 100)


@settings(max_examples=25, deadline=None)
@given(sigma=_sigmas, q=_rates, factor=st.floats(1.05, 3.0))
def test_epsilon_falls_with_noise(sigma, q, factor):
    assert _epsilon(sigma * factor, q, 100) < _epsilon(sigma, q, 100)


def test_default_orders_are_documented_ones():
    assert DEFAULT_ORDERS[:3] == (1.1, 1.2, 1.3) and DEFAULT_ORDERS[98] == pytest.approx(10.9)
    assert DEFAULT_ORDERS[99:152] == tuple(float(a) for a in range(11, 64))
    assert DEFAULT_ORDERS[152:] == (128.0, 256.0, 512.0, 1024.0)


# --- PLD (dp-accounting), the privacy engine's default ------------------------------------------------


@pytest.mark.parametrize("history, delta, epsilon", PLD_REFERENCE)
def test_pld_epsilon_matches_dp_accounting_reference(history, delta, epsilon):
    accountant = _history_accountant("pld", history)
    assert accountant.mechanism == "pld"
    assert accountant.get_epsilon(delta) == pytest.approx(epsilon, rel=1e-6)
    # tighter than RDP for the same steps
    assert accountant.get_epsilon(delta) < _history_accountant("rdp", history).get_epsilon(delta)


def test_pld_calibration_lands_within_the_tolerance_below_the_target():
    sigma = get_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sample_rate=1.0, steps=5, accountant="pld"
    )
    assert 3.0 - 0.01 <= _history_accountant("pld", [(sigma, 1.0, 5)]).get_epsilon(1e-5) <= 3.0
    # less noise than RDP needs for the same target
    assert sigma < get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=1.0, steps=5)


def test_pld_state_dict_round_trip_and_edge_cases():
    before = _history_accountant("pld", [(3.0, 1.0, 5)])
    after = PLDAccountant()
    after.load_state_dict(before.state_dict())
    assert after.get_epsilon(1e-5) == before.get_epsilon(1e-5) > 0
    for accountant in (before, after):
        accountant.step(noise_multiplier=3.0, sample_rate=1.0)
    assert after.get_epsilon(1e-5) == before.get_epsilon(1e-5) > after.get_epsilon(1e-4)
    assert _history_accountant("pld", [(1.0, 0.0, 10)]).get_epsilon(1e-5) == 0.0
    assert _history_accountant("pld", [(0.0, 0.1, 1)]).get_epsilon(1e-5) == math.inf
    with pytest.raises(ValueError, match="delta"):
        before.get_epsilon(0.0)


def test_the_privacy_engines_default_is_the_pld_bound_at_most_opacus_prv_figure():
    """Opacus 1.6's default accountant is PRV; for the same steps it reported (measured 2026-12-03, opacus
    1.6.0's PRVAccountant, delta 1e-5): 1.8384, 2.7611, 3.5450, 1.8562. The default here must not report
    more, nor less than the exact value, of which the PLD figure is an upper bound (pessimistic grid)."""
    from fxdp.privacy_engine import PrivacyEngine

    engine = PrivacyEngine()
    assert isinstance(engine.accountant, PLDAccountant)
    opacus_prv = {(1.0, 0.01, 1000): 1.8384, (2.6, 1 / 6, 90): 2.7611, (0.8, 0.004, 10000): 3.5450,
                  (5.0, 0.5, 20): 1.8562}
    for entry, prv in opacus_prv.items():
        pld = _history_accountant("pld", [entry]).get_epsilon(1e-5)
        rdp = _history_accountant("rdp", [entry]).get_epsilon(1e-5)
        assert pld <= prv < rdp


# --- GDP (the central-limit approximation, for Opacus code) ---------------------------------------------


@pytest.mark.parametrize("history", [[(1.0, 0.01, 1000)], [(2.6, 1 / 6, 90)], [(0.8, 0.004, 10000), (1.2, 0.01, 50)]])
def test_gdp_epsilon_solves_the_gdp_tradeoff_at_delta(history):
    """mu^2 = sum q^2 T (e^(1/sigma^2) - 1); at the epsilon returned, Phi(-e/mu + mu/2) - e^e Phi(-e/mu - mu/2)
    is delta (Bu et al. 2020), evaluated here independently with scipy."""
    from scipy.stats import norm

    accountant = _history_accountant("gdp", history)
    with pytest.warns(UserWarning, match="central-limit approximation, not a bound"):
        eps = accountant.get_epsilon(1e-5)
    mu = math.sqrt(sum(q * q * t * (math.exp(1 / s ** 2) - 1) for s, q, t in history))
    assert norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) == pytest.approx(1e-5, rel=1e-6)
    assert eps < _history_accountant("pld", history).get_epsilon(1e-5)  # below the bound: why it warns


def test_gdp_edge_cases_and_a_single_warning():
    import warnings

    with pytest.warns(UserWarning):
        assert _history_accountant("gdp", [(1.0, 0.0, 10)]).get_epsilon(1e-5) == 0.0
    accountant = _history_accountant("gdp", [(0.0, 0.1, 1)])
    with pytest.warns(UserWarning):
        assert accountant.get_epsilon(1e-5) == math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert accountant.get_epsilon(1e-5) == math.inf  # warned once
    with pytest.warns(UserWarning):
        assert _history_accountant("gdp", [(0.03, 0.1, 1)]).get_epsilon(1e-5) == math.inf
