"""Opacus's DPOptimizer extension points honoured (pre_step, clip_and_accumulate, add_noise, scale_grad), with
fxdp's checks still run; DPPerLayerOptimizer; AdaClipDPOptimizer and what it accounts;
the optimizer's refusals as ValueErrors.

References are plain PyTorch: each sample's gradient from the model run on a batch of one (float64).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import fxdp
from fxdp.diagnostics import PerSampleError, PrivacySettingError, StepRefusedError
from fxdp.optim import AdaClipDPOptimizer, DPOptimizer, DPPerLayerOptimizer

DTYPE = torch.float64


def model_and_batch(seed=0, n=6):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DTYPE)
    return model, torch.randn(n, 4, dtype=DTYPE), torch.randn(n, 2, dtype=DTYPE)


def per_sample_grads(model, x, y):
    """[sample][param] gradients of the summed squared error, one backward per sample."""
    out = []
    for i in range(x.shape[0]):
        model.zero_grad()
        ((model(x[i:i + 1]) - y[i:i + 1]) ** 2).sum().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    return out


def clipped_sum(grads, bound):
    sums = [torch.zeros_like(g) for g in grads[0]]
    for sample in grads:
        norm = torch.sqrt(sum((g ** 2).sum() for g in sample))
        factor = min(1.0, bound / (float(norm) + 1e-6))
        for s, g in zip(sums, sample):
            s += factor * g
    return sums


def backward(private, x, y):
    ((private(x) - y) ** 2).sum().backward()


class ConstantNoise(DPOptimizer):
    """A custom mechanism: adds 1.0 to every coordinate instead of Gaussian noise (deterministic, so its
    effect can be checked exactly)."""

    def add_noise(self):
        for p in self.params:
            p.grad = (p.summed_grad + 1.0).view_as(p)


def test_an_overridden_add_noise_is_honoured_and_warns_about_accounting():
    model, x, y = model_and_batch()
    expected = clipped_sum(per_sample_grads(model, x, y), 0.5)
    private = fxdp.GradSampleModule(model, loss_reduction="sum")
    with pytest.warns(UserWarning, match="ConstantNoise overrides add_noise: its step runs them. fxdp's accountants "
                                         "analyse the default mechanism"):
        opt = ConstantNoise(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=0.5,
                            expected_batch_size=4)
    hooked = []
    opt.attach_step_hook(hooked.append)
    backward(private, x, y)
    opt.step()
    for p, s in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, (s + 1.0) / 4)  # clipped sum + the custom noise, scaled by 1 / 4
    assert hooked == [opt] and opt.steps == 1
    assert all(p.summed_grad is None for p in model.parameters())


def test_the_extension_points_called_through_super_give_the_default_step():
    """A subclass that only observes (calls super) steps exactly as the default one: same seed, same update."""
    calls = []

    class Observed(DPOptimizer):
        def clip_and_accumulate(self):
            calls.append("clip")
            super().clip_and_accumulate()

        def scale_grad(self):
            calls.append("scale")
            super().scale_grad()

    results = []
    for cls in (DPOptimizer, Observed):
        model, x, y = model_and_batch()
        private = fxdp.GradSampleModule(model, loss_reduction="sum")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = cls(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.7, max_grad_norm=0.5,
                      expected_batch_size=4, generator=torch.Generator().manual_seed(3))
        backward(private, x, y)
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert calls == ["clip", "scale"]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_skip_steps_accumulate_into_summed_grad_through_the_overrides():
    model, x, y = model_and_batch(n=8)
    expected = clipped_sum(per_sample_grads(model, x, y), 0.5)
    private = fxdp.GradSampleModule(model, loss_reduction="sum")
    with pytest.warns(UserWarning):
        opt = ConstantNoise(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=0.5,
                            expected_batch_size=8, loss_reduction="sum")
    backward(private, x[:5], y[:5])
    opt.signal_skip_step()
    assert opt.step() is None
    opt.zero_grad()
    assert all(p.summed_grad is not None for p in model.parameters())  # kept for the next physical batch
    backward(private, x[5:], y[5:])
    opt.step()
    for p, s in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, s + 1.0, rtol=1e-5, atol=1e-6)
    assert opt.steps == 1


def test_fxdps_checks_still_run_before_an_overridden_step():
    """A step with no backward pass is refused before the override runs; nothing moves."""
    called = []

    class Custom(DPOptimizer):
        def clip_and_accumulate(self):
            called.append(True)

    model, x, y = model_and_batch()
    fxdp.GradSampleModule(model, loss_reduction="sum")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning):
        opt = Custom(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                     expected_batch_size=4)
    with pytest.raises(StepRefusedError, match="found no per-sample gradient since the last step"):
        opt.step()
    assert not called and opt.steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.noise_multiplier = 1.0
    opt._noise_multiplier = -1.0  # changed behind the setter: refused at the step
    with pytest.raises(PrivacySettingError, match="noise_multiplier must be a finite number >= 0"):
        opt.step()


def test_step_refusals_are_also_value_errors_as_opacus_raises():
    model, x, y = model_and_batch()
    private = fxdp.GradSampleModule(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=4)
    backward(private, x, y)
    opt.step()
    backward(private, x, y)
    with pytest.raises(ValueError, match=r"step\(\) was called again without optimizer.zero_grad\(\)") as error:
        opt.step()
    assert isinstance(error.value, PerSampleError) and isinstance(error.value, RuntimeError)


def test_dp_per_layer_optimizer_clips_each_parameter_to_its_bound():
    model, x, y = model_and_batch()
    grads = per_sample_grads(model, x, y)
    bounds = [0.3, 0.2, 0.4, 0.1]
    private = fxdp.GradSampleModule(model, loss_reduction="sum")
    opt = DPPerLayerOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                              max_grad_norm=bounds, expected_batch_size=6)
    assert opt.clipping == "per_layer" and opt.sensitivity == pytest.approx(math.sqrt(sum(c * c for c in bounds)))
    backward(private, x, y)
    opt.step()
    for k, (p, c) in enumerate(zip(model.parameters(), bounds)):
        want = sum(min(1.0, c / (float(s[k].norm()) + 1e-6)) * s[k] for s in grads) / 6
        torch.testing.assert_close(p.grad, want)


def adaclip(model, **overrides):
    args = dict(noise_multiplier=1.0, target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
                min_clipbound=0.01, unclipped_num_std=4.0, max_grad_norm=1.0, expected_batch_size=6)
    args.update(overrides)
    return AdaClipDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), **args)


def test_adaclip_noise_split_accounts_as_one_gaussian_of_the_users_sigma():
    """sigma_g^-2 + (2 sigma_b)^-2 = sigma^-2: the gradient and the centred count (sensitivity 1/2) together are
    one Gaussian mechanism of the accounted sigma; the accountant's hook records sigma itself."""
    model, _, _ = model_and_batch()
    opt = adaclip(model)
    sigma_g = opt.gradient_noise_multiplier
    assert sigma_g ** -2 + (2 * 4.0) ** -2 == pytest.approx(1.0)
    assert opt.noise_std == pytest.approx(sigma_g * 1.0)
    accountant = fxdp.accounting.create_accountant("rdp")
    opt.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=0.1))
    model2, x, y = model_and_batch()
    private = fxdp.GradSampleModule(model, loss_reduction="sum")
    ((private(x) - y) ** 2).sum().backward()
    opt.step()
    assert accountant.history == [(1.0, 0.1, 1)]
    with pytest.raises(PrivacySettingError, match=r"smaller than 2 \* unclipped_num_std"):
        adaclip(model, noise_multiplier=2.0, unclipped_num_std=1.0)


def test_adaclip_moves_the_bound_by_the_centred_unclipped_fraction_over_the_expected_batch_size():
    model, x, y = model_and_batch()
    norms = [float(torch.sqrt(sum((g ** 2).sum() for g in s))) for s in per_sample_grads(model, x, y)]
    bound = sum(sorted(norms)[1:3]) / 2  # 2 of 6 samples unclipped (norm below the bound), 4 clipped
    opt = adaclip(model, noise_multiplier=0.0, max_grad_norm=bound, expected_batch_size=8)
    private = fxdp.GradSampleModule(model, loss_reduction="sum")
    backward(private, x, y)
    opt.step()
    fraction = (2 - 6 / 2) / 8 + 0.5  # the centred count over the EXPECTED batch size (8, not 6)
    assert opt.max_grad_norm == pytest.approx(bound * math.exp(-0.2 * (fraction - 0.5)))


def test_privacy_engine_adaptive_clipping_accounts_the_users_sigma_and_moves_the_bound():
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    loader = DataLoader(TensorDataset(torch.randn(200, 5), torch.randn(200, 2)), batch_size=40)
    engine = fxdp.PrivacyEngineAdaptiveClipping(accountant="rdp")
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                             data_loader=loader, noise_multiplier=1.0, max_grad_norm=1e4,
                                             min_clipbound=0.01, target_unclipped_quantile=0.5)
    assert isinstance(opt, AdaClipDPOptimizer) and opt.unclipped_num_std == 40 / 20  # the expected batch size's
    bounds = []
    for x, y in loader:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        bounds.append(opt.max_grad_norm)
    assert engine.accountant.history == [(1.0, 0.2, 5)]
    assert bounds[-1] < 1e4 * 0.95 ** 5  # a bound above every norm leaves all unclipped: it shrinks each step
    small = nn.Linear(5, 2)
    with pytest.raises(PrivacySettingError, match=r"smaller than 2 \* unclipped_num_std"):  # 2 * 5 / 20 < 1
        fxdp.PrivacyEngineAdaptiveClipping().make_private(
            module=small, optimizer=torch.optim.SGD(small.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(20, 5)), batch_size=5), noise_multiplier=1.0,
            max_grad_norm=1.0)


# -- p.summed_grad after the default step -------------------------------------------------------------------


MATERIALISING = {  # engine -> the private model, per-sample gradients materialised as p.grad_sample
    "hooks": lambda model: fxdp.GradSampleModule(model, loss_reduction="sum"),
    "ew": lambda model: fxdp.engines.ExpandedWeightsGradSampleModule(model, loss_reduction="sum"),
    "functorch": lambda model: fxdp.engines.FunctorchGradSampleModule(model, loss_reduction="sum"),
    "fx": lambda model: fxdp.compile_for_dp(model, example_inputs=(torch.zeros(2, 4, dtype=DTYPE),),
                                            loss_reduction="sum"),
}


@pytest.mark.parametrize("engine", sorted(MATERIALISING))
def test_the_default_step_leaves_grad_sample_and_summed_grad_with_materialised_per_sample_gradients(engine):
    """As on Opacus: after step(), p.grad_sample holds the per-sample gradients and p.summed_grad the un-noised
    clipped sum (not scaled), until zero_grad(). A backward pass before zero_grad() replaces those rows (never
    adds to them: ExpandedWeights adds to a p.grad_sample it finds), and the step after it is still refused."""
    model, x, y = model_and_batch()
    samples = per_sample_grads(model, x, y)
    expected = clipped_sum(samples, 0.5)
    private = MATERIALISING[engine](model)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0, max_grad_norm=0.5,
                      expected_batch_size=6, loss_reduction="mean")
    backward(private, x, y)
    opt.step()
    for k, (p, s) in enumerate(zip(model.parameters(), expected)):
        torch.testing.assert_close(p.summed_grad, s)  # not divided by the expected batch size, as on Opacus
        assert not torch.allclose(p.grad, s / 6)  # the noised gradient is another tensor
        torch.testing.assert_close(p.grad_sample, torch.stack([sample[k] for sample in samples]))
    _, x2, y2 = model_and_batch(seed=1, n=6)
    samples2 = per_sample_grads(copy.deepcopy(model), x2, y2)  # (a copy: the hooks engine's layers record calls)
    backward(private, x2, y2)  # no zero_grad() first
    for k, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad_sample, torch.stack([sample[k] for sample in samples2]))
    with pytest.raises(StepRefusedError, match="without optimizer.zero_grad"):
        opt.step()
    opt.zero_grad()
    assert all(p.summed_grad is None and p.grad_sample is None for p in model.parameters())


def test_a_skipped_step_shows_the_clipped_sum_so_far_as_summed_grad_until_the_real_step():
    """As on Opacus (its per-layer clipping test reads p.summed_grad after signal_skip_step): after a skipped
    step p.summed_grad is the logical batch's clipped sum so far, kept by zero_grad(); the real step adds its
    physical batch and steps on the whole."""
    model, x, y = model_and_batch()
    before = [p.detach().clone() for p in model.parameters()]
    first = clipped_sum(per_sample_grads(model, x[:4], y[:4]), 0.5)
    both = clipped_sum(per_sample_grads(model, x, y), 0.5)
    private = fxdp.GradSampleModule(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=0.5,
                      expected_batch_size=6, loss_reduction="sum")
    backward(private, x[:4], y[:4])
    opt.signal_skip_step()
    opt.step()
    opt.zero_grad()
    for p, s in zip(model.parameters(), first):
        torch.testing.assert_close(p.summed_grad, s)
    backward(private, x[4:], y[4:])
    opt.step()
    for p, b, s in zip(model.parameters(), before, both):
        torch.testing.assert_close(p.summed_grad, s)
        torch.testing.assert_close(p.detach(), b - s)


def test_book_keeping_keeps_no_second_copy_of_the_gradients():
    model, x, y = model_and_batch()
    from fxdp.sinks.bookkeeping import BookkeepingSink

    sink = BookkeepingSink()  # (make_private's default)
    private = fxdp.compile_for_dp(model, example_inputs=(x,), loss_reduction="sum", sink=sink)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0, max_grad_norm=0.5,
                      expected_batch_size=6, loss_reduction="sum", sink=sink)
    backward(private, x, y)
    opt.step()
    assert all(getattr(p, "summed_grad", None) is None for p in model.parameters())
