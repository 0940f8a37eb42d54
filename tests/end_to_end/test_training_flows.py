"""Privacy holds in every training flow: one optimizer step is one private step (each sample one row,
clipped once, the step counted once), or an fxdp error comes first, before any parameter moves and before
the accountant records anything.

The private steps are checked against an independent computation: each sample's total gradient from a
plain copy of the model run on that sample alone, clipped, summed (noise off, SGD with lr=1, summed loss:
the update is minus the clipped sum)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fxdp
from fxdp.data import BatchMemoryManager
from fxdp.optim import DPOptimizer
from fxdp.privacy_engine import PrivacyEngine
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import sink_of

ENGINES = ("fx-bookkeeping", "fx", "hooks", "ew", "functorch")
C = 0.05  # small enough that every sample here is clipped


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def private_model(model, mode, x):
    sink = BookkeepingSink() if mode == "fx-bookkeeping" else None
    return fxdp.compile_for_dp(model, example_inputs=x, grad_sample_mode=mode.split("-")[0], loss_reduction="sum",
                               sink=sink)


def dp_optimizer(model, dp_model, **kwargs):
    kwargs.setdefault("noise_multiplier", 0.0)
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), max_grad_norm=C, expected_batch_size=4,
                       loss_reduction="sum", sink=sink_of(dp_model), **kwargs)


def clipped_sum(model, sample_losses, bound=C):
    """sum_i clip(grad of sample_losses[i](plain copy)): each sample's total gradient clipped to ``bound``."""
    plain = copy.deepcopy(model)
    for m in plain.modules():  # a copy's engine hooks are dead; none of fxdp's may record here
        m._forward_hooks.clear(), m._forward_pre_hooks.clear()
    params = list(plain.parameters())
    total = [torch.zeros_like(p) for p in params]
    for loss_of in sample_losses:
        grads = torch.autograd.grad(loss_of(plain), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, bound / (float(norm) + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


def snapshot(model, optimizer, engine=None):
    return ([p.detach().clone() for p in model.parameters()], optimizer.steps,
            None if engine is None else list(engine.accountant.history))


def assert_unchanged(model, optimizer, before, engine=None):
    params, steps, history = before
    assert all(torch.equal(b, p) for b, p in zip(params, model.parameters())), "a parameter moved"
    assert optimizer.steps == steps
    if engine is not None:
        assert engine.accountant.history == history, "the accountant recorded a step"


def assert_stepped_by(model, before, expected):
    for b, p, e in zip(before[0], model.parameters(), expected):
        torch.testing.assert_close(b - p.detach(), e, atol=1e-10, rtol=1e-8)


# -- item 2: two losses on one forward, two forwards of one batch ---------------------------------------------


@pytest.mark.parametrize("mode", ENGINES)
def test_two_losses_on_one_forward_are_one_row_per_sample(mode):
    """loss1.backward(retain_graph=True); loss2.backward(); step(): each sample clipped once, on its total
    gradient (what (loss1 + loss2).backward() gives), not twice with sensitivity 2C."""
    model, x = mlp(), torch.randn(4, 5, dtype=torch.float64)
    r = torch.randn(4, 3, dtype=torch.float64)
    dp = private_model(model, mode, x)
    opt = dp_optimizer(model, dp)
    expected = clipped_sum(model, [lambda m, i=i: (m(x[i:i + 1]) * r[i]).sum() + m(x[i:i + 1]).pow(2).sum()
                                   for i in range(4)])
    before = snapshot(model, opt)
    out = dp(x)
    (out * r).sum().backward(retain_graph=True)
    out.pow(2).sum().backward()
    opt.step()
    assert_stepped_by(model, before, expected)


@pytest.mark.parametrize("mode", ENGINES)
def test_two_forwards_of_one_batch_in_one_backward_are_one_row_per_sample(mode):
    """Two views of a batch (two forward calls), one backward: sample i's row is the sum of its uses in both."""
    model, x = mlp(), torch.randn(4, 5, dtype=torch.float64)
    dp = private_model(model, mode, x)
    opt = dp_optimizer(model, dp)
    expected = clipped_sum(model, [lambda m, i=i: m(x[i:i + 1]).sum() + m(2 * x[i:i + 1] + 1).pow(2).sum()
                                   for i in range(4)])
    before = snapshot(model, opt)
    (dp(x).sum() + dp(2 * x + 1).pow(2).sum()).backward()
    opt.step()
    assert_stepped_by(model, before, expected)


@pytest.mark.parametrize("mode", ENGINES)
def test_two_forwards_with_a_backward_each_are_refused(mode):
    """A backward per forward call: indistinguishable from two batches, so the step is refused."""
    model, x = mlp(), torch.randn(4, 5, dtype=torch.float64)
    dp = private_model(model, mode, x)
    opt = dp_optimizer(model, dp)
    before = snapshot(model, opt)
    dp(x).sum().backward()
    dp(x).pow(2).sum().backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="reached none of the forward calls"):
        opt.step()
    assert_unchanged(model, opt, before)


# -- item 3: every sink and engine agrees on "sample i" ------------------------------------------------------


@pytest.mark.parametrize("materialise", [True, False])
def test_two_views_give_one_row_per_sample_with_either_sink(materialise):
    """make_private(materialise_grad_sample=True) and the default book-keeping sink: N rows for N samples,
    each the sample's gradient through both views (against batches of one)."""
    model = mlp().float()
    data = TensorDataset(torch.randn(32, 5), torch.randint(0, 3, (32,)))
    dp, opt, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=C, loss_reduction="sum",
        materialise_grad_sample=materialise, example_inputs=data.tensors[0][:4])
    x = data.tensors[0][:6]
    (dp(x).sum() + dp(x.flip(1)).pow(2).sum()).backward()
    plain = copy.deepcopy(model)
    params = dict(plain.named_parameters())
    want = {name: torch.stack([torch.autograd.grad(plain(x[i:i + 1]).sum() + plain(x[i:i + 1].flip(1)).pow(2).sum(),
                                                   p)[0] for i in range(6)]) for name, p in params.items()}
    norms = opt.sink.squared_norms(list(model.parameters()))
    for name, p in model.named_parameters():
        if materialise:
            assert p.grad_sample.shape == (6, *p.shape)
            torch.testing.assert_close(p.grad_sample, want[name], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(norms[p], want[name].flatten(1).pow(2).sum(1), atol=1e-5, rtol=1e-4)


# -- item 1: several backward passes (several batches) before one step -----------------------------------------


def make_private(mode="fx", materialise=False, n=64, batch_size=16, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    engine = PrivacyEngine()
    kwargs.setdefault("noise_multiplier", 1.0)
    kwargs.setdefault("max_grad_norm", 1.0)
    dp, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size),
        grad_sample_mode=mode, materialise_grad_sample=materialise,
        example_inputs=data.tensors[0][:4], **kwargs)
    return engine, model, dp, opt, loader


def loss_of(dp, batch):
    x, y = batch
    return nn.functional.cross_entropy(dp(x), y)


PRIVATE = [("fx", False), ("fx", True), ("hooks", False)]


@pytest.mark.parametrize("mode,materialise", PRIVATE)
def test_two_poisson_batches_backward_then_one_step_is_refused(mode, materialise):
    """Two Poisson batches, a backward each, one step: clipped as if one batch and accounted at rate q (with
    q = 0.01, sigma = 1, 1000 steps the real epsilon is above 3.4 where 2.1 would be reported). Refused before
    anything moves; after zero_grad the next batch steps and is counted once."""
    engine, model, dp, opt, loader = make_private(mode, materialise)
    batches = iter(loader)
    before = snapshot(model, opt, engine)
    opt.zero_grad()
    loss_of(dp, next(batches)).backward()
    loss_of(dp, next(batches)).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="the data loader handed out 2 batches since the last optimizer step"):
        opt.step()
    assert_unchanged(model, opt, before, engine)
    for batch in batches:  # the rest of the pass, as it should be run
        opt.zero_grad()
        loss_of(dp, batch).backward()
        opt.step()
    assert engine.accountant.history == [(1.0, pytest.approx(0.25), 2)]


@pytest.mark.parametrize("mode,materialise", PRIVATE)
def test_two_batches_backward_then_one_step_is_refused_without_a_dp_loader(mode, materialise):
    """The same with batches of the user's (the loader kept: no DP loader tells the optimizer anything): the
    sink sees a backward pass over another batch."""
    engine, model, dp, opt, _ = make_private(mode, materialise, poisson_sampling=False)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    before = snapshot(model, opt, engine)
    opt.zero_grad()
    loss_of(dp, (x[:4], y[:4])).backward()
    loss_of(dp, (x[4:], y[4:])).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="it was another batch"):
        opt.step()
    assert_unchanged(model, opt, before, engine)


def test_one_backward_over_two_poisson_batches_is_refused():
    """(loss(x1) + loss(x2)).backward(): one pass, so only the data loader can tell two batches of one size
    were used (the sink refuses two sizes)."""
    engine, model, dp, opt, loader = make_private()
    batches = iter(loader)
    before = snapshot(model, opt, engine)
    opt.zero_grad()
    b1, b2 = next(batches), next(batches)
    n = min(len(b1[0]), len(b2[0]))  # (of two sizes, the sink would refuse them itself)
    (loss_of(dp, (b1[0][:n], b1[1][:n])) + loss_of(dp, (b2[0][:n], b2[1][:n]))).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="handed out 2 batches"):
        opt.step()
    assert_unchanged(model, opt, before, engine)


def test_skip_steps_across_two_poisson_batches_are_refused():
    """Accumulating two logical batches with signal_skip_step: refused at the second batch's step."""
    engine, model, dp, opt, loader = make_private()
    batches = iter(loader)
    opt.zero_grad()
    loss_of(dp, next(batches)).backward()
    opt.signal_skip_step()
    opt.step()
    before = snapshot(model, opt, engine)
    opt.zero_grad()
    loss_of(dp, next(batches)).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="handed out 2 batches"):
        opt.step()
    assert_unchanged(model, opt, before, engine)


def test_batch_memory_manager_physical_batches_are_one_step_each_logical_batch():
    """BatchMemoryManager's skip steps are the legitimate way to accumulate: one counted step per logical
    batch."""
    engine, model, dp, opt, loader = make_private(n=64, batch_size=8)  # 8 logical batches of about 8
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as physical:
        for batch in physical:
            opt.zero_grad()
            loss_of(dp, batch).backward()
            opt.step()
    assert opt.steps == 8 and engine.accountant.history == [(1.0, pytest.approx(1 / 8), 8)]


def test_a_pass_left_by_break_does_not_count_against_the_next():
    engine, model, dp, opt, loader = make_private()
    for k, batch in enumerate(loader):
        if k == 2:
            break  # the third batch is handed out and dropped, without a step: nothing of it was used
        opt.zero_grad()
        loss_of(dp, batch).backward()
        opt.step()
    for batch in loader:
        opt.zero_grad()
        loss_of(dp, batch).backward()
        opt.step()
    assert opt.steps == 6 and engine.accountant.history == [(1.0, pytest.approx(0.25), 6)]


def test_a_part_of_a_logical_batch_left_by_break_counts_against_the_next():
    """Skip steps accumulated part of a logical batch, then the pass was left: that part would join the
    next pass's first step, two batches in one."""
    engine, model, dp, opt, loader = make_private()
    batch = next(iter(loader))
    opt.zero_grad()
    loss_of(dp, batch).backward()
    opt.signal_skip_step()
    opt.step()
    before = snapshot(model, opt, engine)
    batch = next(iter(loader))  # a new pass
    opt.zero_grad()
    loss_of(dp, batch).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="handed out 2 batches"):
        opt.step()
    assert_unchanged(model, opt, before, engine)


# -- items 8a and 8b: useless silent steps ------------------------------------------------------------------


@pytest.mark.parametrize("mode,materialise", [("fx", False), ("fx", True), ("ew", False), ("functorch", False)])
def test_calling_the_original_model_is_refused(mode, materialise):
    """The original model shares the parameters but records no per-sample gradient: its gradient would be
    discarded for a counted noise-only step."""
    engine, model, dp, opt, loader = make_private(mode, materialise)
    batch = next(iter(loader))
    before = snapshot(model, opt, engine)
    opt.zero_grad()
    loss_of(model, batch).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="most likely the original model instead of the one make_private"):
        opt.step()
    assert_unchanged(model, opt, before, engine)


@pytest.mark.parametrize("mode,materialise", PRIVATE)
def test_a_step_without_backward_is_refused(mode, materialise):
    engine, model, dp, opt, loader = make_private(mode, materialise)
    next(iter(loader))
    before = snapshot(model, opt, engine)
    opt.zero_grad()
    with pytest.raises(fxdp.errors.PerSampleError, match="found no per-sample gradient since the last step"):
        opt.step()
    assert_unchanged(model, opt, before, engine)
    opt.zero_grad()  # and again: nothing was recorded, nothing moved
    with pytest.raises(fxdp.errors.PerSampleError, match="no per-sample gradient"):
        opt.step()


def empty_batch_loader(**kwargs):
    """make_private over 4 samples in batches of 1 (rate 1/4): a seed whose first batch is empty."""
    for seed in range(100):
        engine, model, dp, opt, loader = make_private(n=4, batch_size=1, seed=seed, **kwargs)
        torch.manual_seed(seed)
        if len(next(iter(loader))[0]) == 0:
            torch.manual_seed(seed)
            return engine, model, dp, opt, loader
    raise AssertionError("no empty first batch in 100 seeds")


def test_an_empty_poisson_batch_steps_with_noise_only_without_backward():
    """The loader told the optimizer its batch was empty: a step with no per-sample gradient is the private
    step (noise only), and it is counted."""
    engine, model, dp, opt, loader = empty_batch_loader()
    before = snapshot(model, opt, engine)
    x, _ = next(iter(loader))
    assert len(x) == 0
    opt.zero_grad()
    opt.step()
    assert opt.steps == 1 and len(engine.accountant.history) == 1
    assert all(not torch.equal(b, p) for b, p in zip(before[0], model.parameters()))


def test_an_empty_poisson_batch_run_through_the_model_steps_with_noise_only():
    engine, model, dp, opt, loader = empty_batch_loader(loss_reduction="sum")
    x, y = next(iter(loader))
    opt.zero_grad()
    nn.functional.cross_entropy(dp(x), y, reduction="sum").backward()
    opt.step()
    assert opt.steps == 1 and engine.accountant.history == [(1.0, 0.25, 1)]


def test_an_empty_logical_batch_through_the_memory_manager_steps_with_noise_only():
    engine, model, dp, opt, loader = empty_batch_loader()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as physical:
        x, _ = next(iter(physical))
        assert len(x) == 0
        opt.zero_grad()
        opt.step()
    assert opt.steps == 1 and len(engine.accountant.history) == 1


# -- item 4: settings changed after make_private -------------------------------------------------------------


BAD_SETTINGS = [
    ("noise_multiplier", math.nan), ("noise_multiplier", -1.0), ("noise_multiplier", math.inf),
    ("noise_multiplier", True), ("noise_multiplier", "1.0"),
    ("max_grad_norm", 0.0), ("max_grad_norm", -1.0), ("max_grad_norm", math.nan), ("max_grad_norm", [1.0]),
    ("expected_batch_size", 0), ("expected_batch_size", 2.5), ("expected_batch_size", None),
    ("loss_reduction", "avg"),
]


@pytest.mark.parametrize("name,value", BAD_SETTINGS)
def test_a_bad_setting_is_refused_when_set_and_nothing_moves(name, value):
    engine, model, dp, opt, loader = make_private()
    batch = next(iter(loader))
    opt.zero_grad()
    loss_of(dp, batch).backward()
    before = snapshot(model, opt, engine)
    old = getattr(opt, name)
    with pytest.raises(fxdp.errors.PrivacySettingError, match=name):
        setattr(opt, name, value)
    assert getattr(opt, name) == old
    opt.step()  # the batch still steps, with the settings it had, and is counted once
    assert engine.accountant.history == [(1.0, pytest.approx(0.25), 1)]
    assert before[1] == 0


@pytest.mark.parametrize("change", ["bound edited in place", "clipping reassigned", "noise behind the setter"])
def test_a_setting_changed_behind_its_setter_is_refused_before_the_step(change):
    per_layer = change == "bound edited in place"
    engine, model, dp, opt, loader = make_private(clipping="per_layer" if per_layer else "flat",
                                                 max_grad_norm=[1.0] * 4 if per_layer else 1.0)
    batch = next(iter(loader))
    opt.zero_grad()
    loss_of(dp, batch).backward()
    before = snapshot(model, opt, engine)
    if change == "bound edited in place":
        opt.max_grad_norm[2] = -1.0
    elif change == "clipping reassigned":
        opt.clipping = "per_layer"
    else:
        opt.__dict__["_noise_multiplier"] = math.nan
    with pytest.raises(fxdp.errors.PrivacySettingError):
        opt.step()
    assert_unchanged(model, opt, before, engine)


def test_a_valid_change_is_what_the_accountant_records():
    engine, model, dp, opt, loader = make_private()
    batches = iter(loader)
    for sigma in (1.0, 2.0):
        opt.noise_multiplier = sigma
        opt.zero_grad()
        loss_of(dp, next(batches)).backward()
        opt.step()
    assert engine.accountant.history == [(1.0, pytest.approx(0.25), 1), (2.0, pytest.approx(0.25), 1)]


def test_the_loader_tells_an_empty_batch_of_any_structure():
    """What EmptyBatchCollate yields for an empty batch reads as empty; a batch with a sample does not."""
    from collections import namedtuple

    from fxdp.data.loader import EmptyBatchCollate, is_empty_batch

    Pair = namedtuple("Pair", "x label")
    samples = [(torch.randn(2), 1), {"ids": torch.arange(3), "text": "a"}, Pair(torch.randn(2), 0)]
    for sample in samples:
        collate = EmptyBatchCollate(torch.utils.data.default_collate, [sample])
        assert is_empty_batch(collate([])), sample
        assert not is_empty_batch(collate([sample, sample])), sample
    assert not is_empty_batch(object())  # a batch of a type of the user's: not known to be empty


# -- a step's batch must come from the loader make_private returned -----------------------------------------


@pytest.mark.parametrize("mode,materialise", PRIVATE)
def test_training_on_the_loader_given_to_make_private_instead_of_the_returned_one_is_refused(mode, materialise):
    """``model, optimizer, _ = make_private(..., data_loader=train_loader)`` then ``for x, y in train_loader``:
    shuffled fixed-size batches, which the accountant would record as Poisson samples."""
    engine, model, dp, opt, _ = make_private(mode, materialise)
    train_loader = DataLoader(TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,))), batch_size=4)
    before = snapshot(model, opt, engine)
    for batch in train_loader:
        opt.zero_grad()
        loss_of(dp, batch).backward()
        with pytest.raises(fxdp.errors.PerSampleError, match="without a batch from the data loader make_private returned"):
            opt.step()
        assert_unchanged(model, opt, before, engine)


def test_one_batch_used_for_two_steps_is_refused():
    """Two steps on one Poisson batch: the second would be accounted as a fresh sample, independent of the
    first, which it is not."""
    engine, model, dp, opt, loader = make_private()
    batch = next(iter(loader))
    opt.zero_grad()
    loss_of(dp, batch).backward()
    opt.step()
    before = snapshot(model, opt, engine)
    opt.zero_grad()
    loss_of(dp, batch).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="a batch already used for a step"):
        opt.step()
    assert_unchanged(model, opt, before, engine)
    assert engine.accountant.history == [(1.0, pytest.approx(0.25), 1)]
