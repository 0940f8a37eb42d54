"""make_private(privacy_unit="user"): the loader, optimizer and accountant it builds, the ε it reports (for one
user, against dp-accounting's for the user-level event history), calibration for users, the unit in the
engine and its checkpoints, and what it refuses."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fxdp import PrivacyEngine
from fxdp.accounting import create_accountant, group_privacy_epsilon
from fxdp.data import UserLevelDataLoader
from fxdp.optim import UserLevelDPOptimizer

N = 60
USER_IDS = [i % 13 for i in range(N)]  # 13 users of 4 or 5 records


def _setup(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(N, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    loader = DataLoader(TensorDataset(x, y), batch_size=10)  # 6 batches: user rate q = 1/6
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loader


def _train(model, optimizer, loader, steps):
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                return


def _dp_accounting_epsilon(sigma, q, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(sigma)), steps)
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                                 value_discretization_interval=1e-4)
    return accountant.compose(event).get_epsilon(delta)


def test_user_level_training_reports_epsilon_for_one_user():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.3, max_grad_norm=1.0, privacy_unit="user",
                                                   user_ids=USER_IDS, max_records_per_user=3)
    assert isinstance(loader, UserLevelDataLoader) and isinstance(optimizer, UserLevelDPOptimizer)
    assert loader.sample_rate == pytest.approx(1 / 6) and loader.num_users == 13
    assert optimizer.expected_batch_size == round(13 / 6)  # the "mean" normaliser: expected USERS per batch
    assert engine.privacy_unit == "user"
    _train(model, optimizer, loader, 9)
    assert engine.accountant.history == [(1.3, 1 / 6, 9)]
    epsilon = engine.get_epsilon(1e-5)
    assert epsilon == pytest.approx(_dp_accounting_epsilon(1.3, 1 / 6, 9, 1e-5), rel=1e-9)
    rdp = create_accountant("rdp")
    rdp.history = list(engine.accountant.history)
    assert epsilon < rdp.get_epsilon(1e-5)  # the RDP bound of the same history, looser


def test_make_private_with_epsilon_calibrates_for_users():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=4.0, target_delta=1e-5, epochs=2,
        max_grad_norm=1.0, privacy_unit="user", user_ids=USER_IDS, max_records_per_user=2)
    _train(model, optimizer, loader, 2 * len(loader))
    epsilon = engine.get_epsilon(1e-5)
    assert 4.0 - 0.01 <= epsilon <= 4.0
    assert epsilon == pytest.approx(_dp_accounting_epsilon(optimizer.noise_multiplier, 1 / 6, 12, 1e-5), rel=1e-9)


def test_the_checkpoint_says_which_unit_its_epsilon_is_for(tmp_path):
    model, optimizer, loader = _setup()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0, privacy_unit="user",
                                                   user_ids=USER_IDS, max_records_per_user=2)
    _train(model, optimizer, loader, 2)
    path = tmp_path / "user.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    assert torch.load(path, weights_only=True)["privacy_unit"] == "user"
    reader = PrivacyEngine()
    reader.load_checkpoint(path=path, module=_setup()[0])
    assert reader.privacy_unit == "user" and reader.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    other, other_optimizer, other_loader = _setup()
    example_level = PrivacyEngine()
    other, other_optimizer, _ = example_level.make_private(module=other, optimizer=other_optimizer,
                                                           data_loader=other_loader, noise_multiplier=1.0,
                                                           max_grad_norm=1.0)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ValueError, match="holds an accountant history for privacy_unit='user', and this "
                                         "PrivacyEngine trains with privacy_unit='example'"):
        example_level.load_checkpoint(path=path, module=other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # refused before anything was loaded


def test_one_accountant_holds_one_unit():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    _train(model, optimizer, loader, 1)
    model2, optimizer2, loader2 = _setup(1)
    with pytest.raises(ValueError, match="accountant holds 1 steps accounted with privacy_unit='example'; its ε "
                                         "cannot also be for privacy_unit='user'"):
        engine.make_private(module=model2, optimizer=optimizer2, data_loader=loader2, noise_multiplier=1.0,
                            max_grad_norm=1.0, privacy_unit="user", user_ids=USER_IDS, max_records_per_user=2)


@pytest.mark.parametrize("options, message", [
    (dict(privacy_unit="user"), "privacy_unit='user' needs user_ids"),
    (dict(user_ids=USER_IDS, max_records_per_user=2), "user_ids and max_records_per_user are for privacy_unit='user'"),
    (dict(privacy_unit="person"), "privacy_unit must be one of \\('example', 'user'\\), got 'person'"),
    (dict(privacy_unit="user", user_ids=USER_IDS, max_records_per_user=2, poisson_sampling=False),
     "privacy_unit='user' does not support poisson_sampling=False"),
    (dict(privacy_unit="user", user_ids=USER_IDS, max_records_per_user=2, clipping="adaptive"),
     "privacy_unit='user' does not support clipping='adaptive'"),
])
def test_what_user_level_training_refuses(options, message):
    model, optimizer, loader = _setup()
    with pytest.raises(Exception, match=message):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                     max_grad_norm=1.0, **options)


def test_the_default_stays_example_level():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine()
    _, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                               noise_multiplier=1.0, max_grad_norm=1.0)
    assert type(optimizer).__name__ == "DPOptimizer" and not isinstance(loader, UserLevelDataLoader)
    assert engine.privacy_unit == "example"


def test_group_privacy_is_weaker_than_the_user_unit():
    accountant = create_accountant("pld")
    accountant.history = [(1.3, 1 / 6, 9)]
    one = accountant.get_epsilon(1e-5)
    assert group_privacy_epsilon(accountant, delta=1e-5, group_size=1) == one
    five = group_privacy_epsilon(accountant, delta=1e-5, group_size=5)
    # the group bound needs delta' <= delta / k, so it is at least k * eps(delta / k)
    assert five >= 5 * accountant.get_epsilon(1e-5 / 5) > 5 * one * 0.99
