"""The accountants' Opacus surface: register_accountant / create_accountant(mechanism=) / registry, the
mechanism name callable as Opacus's classmethod, state_dict(destination), the mechanism key load_state_dict needs,
get_privacy_spent, get_optimizer_hook_fn, and the names GaussianAccountant and PRVAccountant."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxdp
from fxdp.accounting import (Accountant, GaussianAccountant, GDPAccountant, PLDAccountant, PRVAccountant,
                             RDPAccountant, create_accountant, register_accountant, registry)


class Constant(Accountant):
    mechanism = "constant-for-test"

    def get_epsilon(self, delta):
        return 1.5


def test_register_accountant_and_create_it_by_mechanism():
    try:
        register_accountant("constant-for-test", Constant)
        made = create_accountant(mechanism="constant-for-test")
        assert isinstance(made, Constant) and made.mechanism() == made.mechanism == "constant-for-test"
        with pytest.raises(ValueError, match="already registered as 'constant-for-test'"):
            register_accountant("constant-for-test", RDPAccountant)
        with pytest.raises(ValueError, match="already registered as 'rdp'"):
            register_accountant("rdp", Constant)
        assert isinstance(create_accountant("rdp"), RDPAccountant)  # the refusal changed nothing
        register_accountant("constant-for-test", RDPAccountant, force=True)
        assert isinstance(create_accountant("constant-for-test"), RDPAccountant)
    finally:
        registry._ACCOUNTANTS.pop("constant-for-test", None)
    with pytest.raises(ValueError, match="unknown accountant 'constant-for-test'"):
        create_accountant("constant-for-test")


def test_opacus_names_of_the_accountants():
    assert GaussianAccountant is GDPAccountant
    assert issubclass(PRVAccountant, PLDAccountant) and PRVAccountant.mechanism() == "prv"
    assert isinstance(create_accountant("prv"), PRVAccountant)
    for cls in (RDPAccountant, PLDAccountant, GDPAccountant):
        assert cls.mechanism() == cls.mechanism and isinstance(cls.mechanism, str)


def test_the_prv_name_reports_the_pld_bound_which_is_not_above_opacuss_prv_figure():
    """2250 steps at sigma 1.5, q 0.04, delta 1e-5: Opacus's PRV accountant reports 6.7774; the PLD bound here is
    a bound too (pessimistic discretisation), and not larger; RDP's is larger."""
    prv = PRVAccountant()
    prv.history = [(1.5, 0.04, 2250)]
    rdp = RDPAccountant()
    rdp.history = list(prv.history)
    epsilon = prv.get_epsilon(1e-5)
    assert 6.70 < epsilon <= 6.7774 < rdp.get_epsilon(1e-5)


def test_state_dict_into_a_destination_and_load_state_dict_needs_the_mechanism():
    rdp = RDPAccountant()
    for _ in range(3):
        rdp.step(noise_multiplier=1.0, sample_rate=0.1)
    mine = {"kept": 1}
    state = rdp.state_dict(mine)
    assert state is mine and mine == {"kept": 1, "history": [(1.0, 0.1, 3)], "mechanism": "rdp"}
    assert state["history"] is not rdp.history
    fresh = RDPAccountant()
    for bad in ({}, {"1": 2}, {"history": []}):
        with pytest.raises(ValueError, match="'history' and 'mechanism' keys"):
            fresh.load_state_dict(bad)
    assert fresh.history == []
    pld = PLDAccountant()
    pld.load_state_dict(rdp.state_dict())  # a bound's history into a tighter bound: accepted
    assert pld.history == rdp.history
    gdp = GDPAccountant()
    with pytest.raises(ValueError, match="is an approximation, not a bound"):
        gdp.load_state_dict(rdp.state_dict())
    assert gdp.history == []


def test_get_privacy_spent_and_the_optimizer_hook():
    rdp = RDPAccountant()
    model = nn.Linear(3, 2)
    opt = fxdp.optim.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.3,
                                 max_grad_norm=1.0, expected_batch_size=4)
    hook = rdp.get_optimizer_hook_fn(sample_rate=0.25)
    hook(opt)
    opt.noise_multiplier = 0.9
    hook(opt)
    assert rdp.history == [(1.3, 0.25, 1), (0.9, 0.25, 1)]
    epsilon, order = rdp.get_privacy_spent(delta=1e-5)
    assert epsilon == rdp.get_epsilon(1e-5) and order == rdp.get_epsilon_and_order(1e-5)[1]
    assert rdp.get_epsilon(1e-5, alphas=[2.0]) >= epsilon  # one order: no better than the best of many
    pld = PLDAccountant()
    pld.history = list(rdp.history)
    assert pld.get_privacy_spent(delta=1e-5) == (pld.get_epsilon(1e-5), None)
    with pytest.raises(ValueError, match="sample_rate must lie in"):
        rdp.get_optimizer_hook_fn(sample_rate=1.5)
    assert not math.isnan(epsilon)
