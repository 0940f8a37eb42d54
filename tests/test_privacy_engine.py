"""PrivacyEngine end to end: compile, DP optimizer, Poisson loader and accountant together, and
checkpoints, on the compiled graph and the hooks engine."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


import fxdp
from fxdp.data import DPDataLoader
from fxdp.optim import DPOptimizer
from fxdp.privacy_engine import PrivacyEngine

ENGINES = ("fx", "hooks")
DELTA = 1e-5


def dataset(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def classifier(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.Tanh(), nn.Linear(8, 3, bias=bias))


def train(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def private(engine, mode, model=None, batch_size=16, data=None, **kwargs):
    model = model or classifier()
    kwargs.setdefault("noise_multiplier", 1.0)
    kwargs.setdefault("max_grad_norm", 1.0)
    data = data or dataset()
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=DataLoader(data, batch_size=batch_size), grad_sample_mode=mode,
                               example_inputs=data.tensors[0][:4], **kwargs)


@pytest.mark.parametrize("mode", ENGINES)
def test_make_private_trains_and_accounts_every_logical_step(mode):
    torch.manual_seed(0)
    engine = PrivacyEngine()
    model = classifier()
    before = [p.detach().clone() for p in model.parameters()]
    dp_model, optimizer, loader = private(engine, mode, model=model, noise_multiplier=1.3)
    assert fxdp.report(dp_model).mode == mode
    assert isinstance(optimizer, DPOptimizer) and isinstance(loader, DPDataLoader)
    assert loader.sample_rate == pytest.approx(0.25) and len(loader) == 4
    assert optimizer.expected_batch_size == 16 and optimizer.noise_multiplier == 1.3
    assert len(engine.accountant) == 0
    train(dp_model, optimizer, loader)
    assert len(engine.accountant) == 4
    assert engine.accountant.history == [(1.3, pytest.approx(0.25), 4)]
    eps_one_epoch = engine.get_epsilon(DELTA)
    train(dp_model, optimizer, loader)
    assert 0 < eps_one_epoch < engine.get_epsilon(DELTA)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_without_poisson_sampling_the_loader_is_kept():
    engine = PrivacyEngine()
    model = classifier()
    loader = DataLoader(dataset(), batch_size=16, shuffle=True)
    dp_model, optimizer, same = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                    data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                                    poisson_sampling=False)
    assert same is loader and optimizer.expected_batch_size == 16
    optimizer.zero_grad()
    x, y = next(iter(same))
    nn.functional.cross_entropy(dp_model(x), y).backward()
    optimizer.step()
    assert engine.accountant.history == [(1.0, 0.25, 1)]


@pytest.mark.parametrize("mode", ENGINES)
def test_a_model_dp_cannot_train_is_refused(mode):
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(fxdp.errors.NotPrivateError, match="BatchNorm"):
        private(PrivacyEngine(), mode, model=model)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew"])
def test_a_model_refused_for_its_modules_alone_raises_what_opacus_raises(mode):
    """Opacus's make_private raises UnsupportedModuleError for a BatchNorm; fxdp's refusal, when validation's findings
    are all it has, is that class too (and still a NotPrivateError carrying the findings)."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    loader = DataLoader(TensorDataset(torch.randn(16, 1, 6, 6), torch.randint(0, 3, (16,))), batch_size=8)
    with pytest.raises(fxdp.validators.UnsupportedModuleError, match="BatchNorm2d") as info:
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                     grad_sample_mode=mode)
    assert isinstance(info.value, fxdp.errors.NotPrivateError)
    assert [f.op for f in info.value.findings] == ["nn.BatchNorm2d"]


def test_an_optimizer_of_another_model_is_refused():
    model, other = classifier(), classifier()
    with pytest.raises(ValueError, match=r"not the module's \(param_groups\[0\]\['params'\]\[0\] of shape \(8, 6\).*"
                                         r"in Opacus's words: Module parameters are different than optimizer Parameters"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                                     data_loader=DataLoader(dataset(), batch_size=16), noise_multiplier=1.0,
                                     max_grad_norm=1.0)
    _, dp_optimizer, _ = private(PrivacyEngine(), "fx", model=model)
    with pytest.raises(TypeError, match="already a DPOptimizer"):
        PrivacyEngine().make_private(module=model, optimizer=dp_optimizer, data_loader=DataLoader(dataset()),
                                     noise_multiplier=1.0, max_grad_norm=1.0)


def test_trainable_parameters_left_out_of_the_optimizer_are_warned_about():
    model = classifier()
    with pytest.warns(UserWarning, match=r"not in the optimizer \(2.weight, 2.bias\)"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1),
                                     data_loader=DataLoader(dataset(), batch_size=16), noise_multiplier=1.0,
                                     max_grad_norm=1.0)


@pytest.mark.parametrize("mode", ENGINES)
def test_an_empty_poisson_batch_still_steps_with_noise(mode):
    """Batches of expected size 1 out of 4 samples: about a third are empty. Each empty one goes through
    forward, backward and step like any other: the parameters move by noise and the step is accounted."""
    torch.manual_seed(0)
    engine = PrivacyEngine()
    model = classifier(bias=False)  # see the report: per-sample rules with a bias do not take empty batches yet
    dp_model, optimizer, loader = private(engine, mode, model=model, batch_size=1, data=dataset(n=4))
    empty_seen = 0
    for _ in range(5):
        for x, y in loader:
            before = [p.detach().clone() for p in model.parameters()]
            steps = len(engine.accountant)
            optimizer.zero_grad()
            nn.functional.cross_entropy(dp_model(x), y).backward()
            optimizer.step()
            assert len(engine.accountant) == steps + 1
            if len(x) == 0:
                empty_seen += 1
                assert x.shape == (0, 6)
                for b, p in zip(before, model.parameters()):
                    assert torch.isfinite(p).all() and not torch.equal(b, p)
    assert empty_seen > 0


@pytest.mark.parametrize("mode", ENGINES)
def test_per_layer_clipping_through_make_private(mode):
    """One sample, large enough to be clipped: each layer's share of the gradient has norm C_k."""
    bounds = [1e-3, 2e-3, 3e-3, 4e-3]
    model = classifier()
    dp_model, optimizer, _ = private(PrivacyEngine(), mode, model=model, clipping="per_layer",
                                     max_grad_norm=bounds, noise_multiplier=0.0,
                                     poisson_sampling=False)  # a batch of one of our own: the loader is kept
    x, y = dataset().tensors
    optimizer.zero_grad()
    nn.functional.cross_entropy(dp_model(x[:1]), y[:1]).backward()
    optimizer.step()
    for p, C in zip(model.parameters(), bounds):
        assert p.grad.norm() * optimizer.expected_batch_size == pytest.approx(C, rel=1e-4)


def test_secure_mode_reaches_the_optimizer_and_refuses_a_seeded_generator():
    _, optimizer, _ = private(PrivacyEngine(secure_mode=True), "fx")
    assert optimizer.secure_mode
    with pytest.raises(ValueError, match="secure_mode"):
        private(PrivacyEngine(secure_mode=True), "fx", noise_generator=torch.Generator().manual_seed(0))


# -- checkpoints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ENGINES)
def test_checkpoint_round_trip_keeps_weights_optimizer_noise_and_privacy_spent(mode, tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.manual_seed(0)
    engine = PrivacyEngine()
    model = classifier()
    dp_model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        data_loader=DataLoader(dataset(), batch_size=16), noise_multiplier=0.9, max_grad_norm=1.0,
        grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(1))
    train(dp_model, optimizer, loader)
    engine.save_checkpoint(path=path, module=dp_model, optimizer=optimizer, checkpoint_dict={"epoch": 1})
    eps_saved = engine.get_epsilon(DELTA)

    # a new process: another engine, a model with other weights, a fresh optimizer
    engine2 = PrivacyEngine()
    model2 = classifier(seed=3)
    dp_model2, optimizer2, loader2 = engine2.make_private(
        module=model2, optimizer=torch.optim.Adam(model2.parameters(), lr=0.01),
        data_loader=DataLoader(dataset(), batch_size=16), noise_multiplier=0.9, max_grad_norm=1.0,
        grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(99))
    assert len(engine2.accountant) == 0
    extras = engine2.load_checkpoint(path=path, module=dp_model2, optimizer=optimizer2)
    assert extras == {"epoch": 1}
    assert engine2.get_epsilon(DELTA) == eps_saved and len(engine2.accountant) == len(engine.accountant)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)

    # the next steps: same updates (Adam moments and noise generator restored) and same privacy spent; the two
    # Poisson loaders draw from torch's global generator: the same batches from the same seed
    torch.manual_seed(7)
    train(dp_model, optimizer, loader)
    torch.manual_seed(7)
    train(dp_model2, optimizer2, loader2)
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b)
    assert engine2.get_epsilon(DELTA) == engine.get_epsilon(DELTA) > eps_saved


def test_checkpoint_holds_the_plain_models_names(tmp_path):
    path = tmp_path / "ckpt.pt"
    engine = PrivacyEngine()
    model = classifier()
    dp_model, optimizer, _ = private(engine, "hooks", model=model)
    engine.save_checkpoint(path=path, module=dp_model)
    plain = classifier(seed=4)
    plain.load_state_dict(torch.load(path, weights_only=True)["module_state_dict"])
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        engine.load_checkpoint(path=path, module=dp_model, optimizer=optimizer)


def test_make_private_with_epsilon_lands_within_the_tolerance_below_the_target():
    target, epochs = 2.0, 3
    torch.manual_seed(0)
    engine = PrivacyEngine()
    model = classifier()
    dp_model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset(), batch_size=16), target_epsilon=target, target_delta=DELTA,
        epochs=epochs, max_grad_norm=1.0)
    for _ in range(epochs):
        train(dp_model, optimizer, loader)
    assert len(engine.accountant) == epochs * 4
    eps = engine.get_epsilon(DELTA)
    assert target - 0.01 <= eps <= target  # epsilon_tolerance: absolute, 0.01 by default (Opacus's)




@pytest.mark.parametrize("mode", ENGINES)
def test_memory_manager_physical_batches_give_the_same_training_and_accounting(mode):
    """A logical Poisson batch (expected 16 samples) cut into physical batches of at most 5: the same
    updates as whole logical batches (noise off), one accounted step per logical batch."""
    from fxdp.data import BatchMemoryManager

    results = []
    for max_physical in (None, 5):
        engine = PrivacyEngine()
        model = classifier()
        dp_model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
            data_loader=DataLoader(dataset(), batch_size=16), noise_multiplier=0.0, max_grad_norm=0.1,
            grad_sample_mode=mode)
        torch.manual_seed(5)  # the Poisson draws come from the global generator: the same logical batches
        sizes = []
        if max_physical is None:
            for x, y in loader:
                sizes.append(len(x))
            torch.manual_seed(5)
            train(dp_model, optimizer, loader)
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=max_physical,
                                    optimizer=optimizer) as physical:
                for x, y in physical:
                    assert len(x) <= max_physical
                    sizes.append(len(x))
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(dp_model(x), y).backward()
                    optimizer.step()
        assert len(engine.accountant) == optimizer.steps == len(loader)
        results.append(([p.detach().clone() for p in model.parameters()], sizes))
    (whole, logical_sizes), (split, physical_sizes) = results
    assert sum(logical_sizes) == sum(physical_sizes) and len(physical_sizes) > len(logical_sizes)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b)


# --- the privacy engine's own part of every training flow being accounted (issue 21, items 5-7 and 9) -----


def test_a_second_engine_on_a_model_already_private_is_refused_naming_the_first():
    import gc

    model = classifier()
    first = PrivacyEngine()
    dp_model, optimizer, loader = private(first, "fx", model=model)
    train(dp_model, optimizer, [next(iter(loader))])
    before = [p.detach().clone() for p in model.parameters()]
    second = PrivacyEngine()
    for again in (model, dp_model):  # the original model, or the one make_private returned
        with pytest.raises(fxdp.diagnostics.AlreadyPrivateError,
                           match=r"already made private by another PrivacyEngine \(make_private called at "
                                 r"tests/test_privacy_engine.py:\d+\), whose accountant has recorded 1 steps"):
            private(second, "hooks", model=again)
    assert len(second.accountant) == 0 and len(first.accountant) == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    del first, dp_model, optimizer, loader
    gc.collect()  # once the first engine is gone, nobody else counts this model's steps
    private(second, "fx", model=model)


@pytest.mark.parametrize("samples, batch_size", [(49, 1), (100, 3), (1437, 64), (10, 3), (93, 1)])
def test_the_expected_batch_size_is_the_rounded_expectation(samples, batch_size):
    loader = DataLoader(dataset(samples), batch_size=batch_size)
    _, optimizer, dp_loader = private(PrivacyEngine(), "fx", data=dataset(samples), batch_size=batch_size)
    assert optimizer.expected_batch_size == round(samples / len(loader)) >= 1
    assert dp_loader.sample_rate == 1 / len(loader)


def test_make_private_with_epsilon_calibrates_for_every_step_the_loader_yields():
    """93 batches an epoch: 1 / (1 / 93) is 92.99999999999999 in floating point; calibrating for int() of it,
    one step fewer than the loader yields, ended above the target."""
    from fxdp.accounting import get_noise_multiplier, steps_in_epochs

    assert steps_in_epochs(1, 1 / 93) == 93 and steps_in_epochs(2, 1 / 93) == 186
    assert steps_in_epochs(1.5, 0.1) == 15 and steps_in_epochs(0.101, 0.01) == 11  # a partial step counts
    assert (get_noise_multiplier(target_epsilon=1.0, target_delta=DELTA, sample_rate=1 / 93, epochs=1)
            == get_noise_multiplier(target_epsilon=1.0, target_delta=DELTA, sample_rate=1 / 93, steps=93))
    torch.manual_seed(0)
    engine = PrivacyEngine()
    model = nn.Linear(6, 3)
    dp_model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset(93), batch_size=1), target_epsilon=1.0, target_delta=DELTA, epochs=1,
        max_grad_norm=1.0, epsilon_tolerance=0.001)
    train(dp_model, optimizer, loader)
    assert len(engine.accountant) == len(loader) == 93
    assert 0.999 <= engine.get_epsilon(DELTA) <= 1.0


def _fixed_batches(model, engine, loader, **kwargs):
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                               poisson_sampling=False, **kwargs)


def test_the_poisson_figure_for_fixed_size_batches_is_flagged_once_where_epsilon_is_reported():
    engine = PrivacyEngine()
    dp_model, optimizer, loader = _fixed_batches(classifier(), engine, DataLoader(dataset(), batch_size=16))
    train(dp_model, optimizer, loader)
    with pytest.warns(UserWarning, match=r"Poisson-sampling figure.*poisson_sampling=False.*"
                                         r"fixed_batch_accounting='per_epoch'"):
        eps = engine.get_epsilon(DELTA)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second report is silent
        assert engine.get_epsilon(DELTA) == eps
    assert "not a proven bound" in PrivacyEngine.get_epsilon.__doc__
    poisson = PrivacyEngine()  # Poisson sampling: the figure holds, nothing to say
    dp_model, optimizer, loader = private(poisson, "fx")
    train(dp_model, optimizer, loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        poisson.get_epsilon(DELTA)


def test_per_epoch_accounting_records_one_unsampled_mechanism_per_epoch_begun():
    from fxdp.accounting import PLDAccountant

    engine = PrivacyEngine()
    loader = DataLoader(dataset(64), batch_size=16, shuffle=True)  # 4 batches an epoch
    dp_model, optimizer, counted = _fixed_batches(classifier(), engine, loader, fixed_batch_accounting="per_epoch")
    train(dp_model, optimizer, counted)  # a whole epoch: one mechanism
    assert engine.accountant.history == [(1.0, 1.0, 1)]
    train(dp_model, optimizer, [next(iter(counted))])  # an epoch begun and left after one batch: one more
    assert engine.accountant.history == [(1.0, 1.0, 2)]
    it = iter(counted)  # a third epoch, whose second step has less noise: its batch may hold the sample
    train(dp_model, optimizer, [next(it)])
    optimizer.noise_multiplier = 0.5
    train(dp_model, optimizer, [next(it)])
    optimizer.noise_multiplier = 0.7  # more noise than recorded for this epoch: nothing new
    train(dp_model, optimizer, [next(it)])
    assert engine.accountant.history == [(1.0, 1.0, 3), (0.5, 1.0, 1)]
    reference = PLDAccountant()  # the engine's default
    reference.history = [(1.0, 1.0, 3), (0.5, 1.0, 1)]
    assert engine.get_epsilon(DELTA) == reference.get_epsilon(DELTA)
    assert engine.get_epsilon(DELTA) > PrivacyEngine().accountant.get_epsilon(DELTA)


def test_per_epoch_accounting_calibrates_for_whole_epochs():
    engine = PrivacyEngine()
    model = classifier()
    dp_model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset(64), batch_size=16, shuffle=True), target_epsilon=8.0, target_delta=DELTA,
        epochs=2, max_grad_norm=1.0, poisson_sampling=False, fixed_batch_accounting="per_epoch")
    for _ in range(2):
        train(dp_model, optimizer, loader)
    assert engine.accountant.history == [(optimizer.noise_multiplier, 1.0, 2)]
    assert 8.0 - 0.01 <= engine.get_epsilon(DELTA) <= 8.0


@pytest.mark.parametrize("loader, poisson, match", [
    (DataLoader(dataset(), batch_size=16, sampler=torch.utils.data.RandomSampler(dataset(), replacement=True)),
     False, "its sampler is RandomSampler, which may repeat samples"),
    (DataLoader(dataset(), batch_size=16), True, "pass poisson_sampling=False with it"),
])
def test_per_epoch_accounting_refuses_what_it_cannot_bound(loader, poisson, match):
    engine = PrivacyEngine()
    model = classifier()
    with pytest.raises(ValueError, match=match):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson,
                            fixed_batch_accounting="per_epoch")
    with pytest.raises(ValueError, match="fixed_batch_accounting must be one of"):
        _fixed_batches(classifier(), engine, loader, fixed_batch_accounting="shuffled")


def test_checking_a_model_first_with_opacus_names():
    """PrivacyEngine.is_compatible / validate / get_compatible_module, as Opacus code calls them: a batch norm
    is found and named, the fixed copy passes and trains, the original is left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    engine = PrivacyEngine()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(dataset(), batch_size=16)
    assert engine.is_compatible(module=model, optimizer=optimizer, data_loader=loader) is False
    with pytest.raises(fxdp.validators.UnsupportedModuleError, match=r"`1`.*BatchNorm1d"):
        engine.validate(module=model, optimizer=optimizer, data_loader=loader)
    with pytest.warns(fxdp.validators.ModuleFixWarning):
        fixed = PrivacyEngine.get_compatible_module(model)
    assert isinstance(model[1], nn.BatchNorm1d) and not isinstance(fixed[1], nn.BatchNorm1d)
    assert engine.is_compatible(module=fixed, optimizer=None, data_loader=None)
    engine.validate(module=fixed, optimizer=None, data_loader=None)
    dp_model, dp_optimizer, dp_loader = private(engine, "fx", model=fixed)
    train(dp_model, dp_optimizer, dp_loader)
    assert len(engine.accountant) == len(dp_loader)
    with pytest.raises(fxdp.validators.UnsupportedModuleError, match="eval"):  # as make_private would refuse it
        engine.validate(module=copy.deepcopy(fixed).eval())
