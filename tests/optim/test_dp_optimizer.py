"""DPOptimizer: clipping, noise, accumulation and its checks, on the compiled graph and the hooks engine.

References are plain PyTorch: each sample's gradient comes from running the (uncompiled) model on a
batch of one. Models run in float64 so that comparisons can be tight.

Statistical tests. Noise values z_1..z_n should be i.i.d. N(0, s^2). We check the sample mean and the
mean of squares against 5-sigma bounds: mean(z) has std s/sqrt(n), and n*mean(z^2)/s^2 is chi-square
with n degrees of freedom, so mean(z^2)/s^2 has mean 1 and std sqrt(2/n) (and is close to normal for
the n >= 10^4 used here). A correct sampler fails a 5-sigma bound with probability below 1e-6 whatever
the seed; a std off by 5% fails it for the sizes used. Seeds are fixed, so runs are reproducible.
"""

from __future__ import annotations

import ast
import copy
import math
import pathlib

import pytest
import torch
from torch import nn

import fxdp
from fxdp.optim import DPOptimizer
from fxdp.optim.noise import SECURE_DRAWS, gaussian_noise, secure_standard_normal
from fxdp.errors import NonFiniteSampleWarning
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import GradientSink, GradSampleSink, sink_of

ENGINES = ("fx", "hooks")
DTYPE = torch.float64


def assert_gaussian(z: torch.Tensor, std: float) -> None:
    """z looks like i.i.d. N(0, std^2): 5-sigma bounds on the mean and on the mean of squares."""
    z = z.detach().double().flatten()
    n = z.numel()
    assert abs(z.mean().item()) <= 5 * std / math.sqrt(n), (z.mean().item(), std, n)
    ratio = z.pow(2).mean().item() / std**2
    assert abs(ratio - 1) <= 5 * math.sqrt(2 / n), (ratio, n)


class TiedMLP(nn.Module):
    """The input layer's weight is also the output layer's: one parameter, used twice."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6, bias=False)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 6, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.inp(x))))


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE)


def tied(seed=0):
    torch.manual_seed(seed)
    return TiedMLP().to(DTYPE)


def data(n=7, d=6, scale=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    """Inputs and targets; ``scale`` multiplies the targets, so every gradient grows with scale**2 (scaling
    the inputs would saturate tanh instead)."""
    return torch.randn(n, d, generator=g, dtype=DTYPE), torch.randn(n, 1, generator=g, dtype=DTYPE) * scale


def loss_fn(out, y, reduction):
    per_sample = (out * y).pow(2).sum(1)  # any per-sample loss; y broadcasts over the outputs
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


def per_sample_grads(model, x, y):
    """Each sample's gradient, run alone through the plain model: [{param: grad}]."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1], "sum"), params, allow_unused=True)
        rows.append({p: torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)})
    return rows


def dp_step(model, dp_model, x, y, *, reduction="sum", lr=0.0, **kwargs):
    """One logical step on (x, y); returns the optimizer (p.grad holds the private gradient)."""
    kwargs.setdefault("noise_multiplier", 0.0)
    kwargs.setdefault("max_grad_norm", 1.0)
    kwargs.setdefault("expected_batch_size", x.shape[0])
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=lr), loss_reduction=reduction,
                      sink=sink_of(dp_model), **kwargs)
    opt.zero_grad()
    loss_fn(dp_model(x), y, reduction).backward()
    opt.step()
    return opt


def compiled(model, x, mode, reduction="sum"):
    return fxdp.compile_for_dp(model, example_inputs=x, grad_sample_mode=mode, loss_reduction=reduction)


# -- clipping --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("make_model", [mlp, tied], ids=["mlp", "tied"])
def test_flat_clipping_bounds_each_samples_contribution(mode, make_model):
    """Inputs scaled so that every sample is clipped: each sample's contribution, computed by the DP
    optimizer on a batch of one, is its own gradient rescaled to norm C; the batch's clipped sum is
    the sum of the contributions."""
    C = 0.5
    model = make_model()
    x, y = data(scale=10.0)
    dp_model = compiled(model, x, mode)
    reference = per_sample_grads(model, x, y)
    params = list(model.parameters())

    contributions = []
    for i in range(x.shape[0]):
        dp_step(model, dp_model, x[i:i + 1], y[i:i + 1], max_grad_norm=C)
        contributions.append({p: p.grad.clone() for p in params})
    for ref, contrib in zip(reference, contributions):
        ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in ref.values()))
        assert ref_norm > 2 * C  # really clipped
        norm = torch.sqrt(sum(g.pow(2).sum() for g in contrib.values()))
        assert norm <= C
        for p in params:
            torch.testing.assert_close(contrib[p], ref[p] * C / (ref_norm + 1e-6))

    dp_step(model, dp_model, x, y, max_grad_norm=C)
    for p in params:
        torch.testing.assert_close(p.grad, sum(c[p] for c in contributions))


@pytest.mark.parametrize("mode", ENGINES)
def test_small_gradients_are_not_clipped(mode):
    model = mlp()
    x, y = data(scale=0.001)
    dp_model = compiled(model, x, mode)
    reference = per_sample_grads(model, x, y)
    dp_step(model, dp_model, x, y, max_grad_norm=100.0)
    for p in model.parameters():
        torch.testing.assert_close(p.grad, sum(r[p] for r in reference))


@pytest.mark.parametrize("mode", ENGINES)
def test_per_layer_clipping_bounds_each_parameter(mode):
    bounds = [0.3, 0.1, 0.2, 0.05]
    model = mlp()
    x, y = data(scale=10.0)
    dp_model = compiled(model, x, mode)
    reference = per_sample_grads(model, x, y)
    params = list(model.parameters())
    for i in range(x.shape[0]):
        dp_step(model, dp_model, x[i:i + 1], y[i:i + 1], max_grad_norm=bounds, clipping="per_layer")
        for p, C in zip(params, bounds):
            ref = reference[i][p]
            assert ref.norm() > C
            assert p.grad.norm() <= C
            torch.testing.assert_close(p.grad, ref * C / (ref.norm() + 1e-6))


def test_per_layer_bounds_must_match_the_parameters():
    model = mlp()
    with pytest.raises(ValueError, match=r"3 bounds .* 4 trainable parameters \(0.weight, 0.bias, 2.weight, 2.bias\)"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=[1.0] * 3,
                    expected_batch_size=4, clipping="per_layer",
                    param_names={p: n for n, p in model.named_parameters()})
    with pytest.raises(ValueError, match="per_layer"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=[1.0] * 4,
                    expected_batch_size=4)


# -- noise -----------------------------------------------------------------------------------------


def wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 100), nn.Tanh(), nn.Linear(100, 50)).to(DTYPE)  # 15150 coordinates


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_noise_has_std_sigma_times_C(mode, reduction):
    sigma, C, expected = 1.3, 0.7, 10
    model = wide_model()
    x, y = data(n=8, d=100, scale=5.0)
    dp_model = compiled(model, x, mode, reduction)
    params = list(model.parameters())
    dp_step(model, dp_model, x, y, reduction=reduction, max_grad_norm=C, expected_batch_size=expected)
    clean = [p.grad.clone() for p in params]
    dp_step(model, dp_model, x, y, reduction=reduction, max_grad_norm=C, expected_batch_size=expected,
            noise_multiplier=sigma, generator=torch.Generator().manual_seed(3))
    scale = expected if reduction == "mean" else 1
    noise = torch.cat([((p.grad - g) * scale).flatten() for p, g in zip(params, clean)])
    assert_gaussian(noise, sigma * C)


def test_per_layer_noise_std_is_sigma_times_the_total_bound():
    sigma, bounds = 0.8, [0.3, 0.1, 0.2, 0.4]
    model = wide_model()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=sigma, max_grad_norm=bounds,
                      expected_batch_size=1, loss_reduction="sum", clipping="per_layer",
                      generator=torch.Generator().manual_seed(5))
    opt.zero_grad()
    opt.observe_batch(empty=True)  # what the data loader says of an empty batch
    opt.step()  # nothing recorded: p.grad is pure noise
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert_gaussian(noise, sigma * math.sqrt(sum(c * c for c in bounds)))


def test_a_wrong_std_fails_the_statistical_test():
    """The bounds of assert_gaussian are tight enough to catch a std off by 5%."""
    z = torch.randn(15150, generator=torch.Generator().manual_seed(0), dtype=DTYPE) * 1.05
    with pytest.raises(AssertionError):
        assert_gaussian(z, 1.0)


@pytest.mark.parametrize("mode", ENGINES)
def test_empty_batch_still_steps_with_noise(mode):
    """A logical batch with no sample (Poisson sampling can draw one) is a step: noise only, scaled by
    the expected batch size, and the parameters move."""
    sigma, C, expected = 1.0, 2.0, 16
    model = wide_model()
    x, y = data(n=4, d=100)
    dp_model = compiled(model, x, mode, "mean")
    before = [p.detach().clone() for p in model.parameters()]
    hooked = []
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=sigma, max_grad_norm=C,
                      expected_batch_size=expected, sink=sink_of(dp_model), generator=torch.Generator().manual_seed(0))
    opt.attach_step_hook(hooked.append)
    opt.zero_grad()
    opt.observe_batch(empty=True)  # the data loader handed out an empty batch, which the loop did not run
    opt.step()
    assert hooked == [opt] and opt.steps == 1
    moved = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
    assert_gaussian(moved * expected, sigma * C)


def test_empty_batch_with_zero_rows_steps_with_noise():
    """Per-sample gradients with zero rows (an engine that ran backward on an empty batch)."""
    model = wide_model()
    for p in model.parameters():
        p.grad_sample = torch.zeros(0, *p.shape, dtype=p.dtype)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=1, loss_reduction="sum", generator=torch.Generator().manual_seed(0))
    opt.step()
    assert_gaussian(torch.cat([p.grad.flatten() for p in model.parameters()]), 1.0)
    assert all(p.grad_sample.shape[0] == 0 for p in model.parameters())  # left until zero_grad(), as on Opacus
    opt.zero_grad()
    assert all(p.grad_sample is None for p in model.parameters())


@pytest.mark.parametrize("mode", ENGINES)
def test_unused_parameter_gets_noise_and_frozen_parameter_nothing(mode):
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(6, 3), "unused": nn.Linear(100, 100), "frozen": nn.Linear(6, 3)}).to(DTYPE)
    model.frozen.requires_grad_(False)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m["used"](x) + self.m["frozen"](x)

    net = Net()
    x, y = data()
    dp_net = compiled(net, x, mode)
    frozen_before = model.frozen.weight.detach().clone()
    opt = dp_step(net, dp_net, x, y, lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                  generator=torch.Generator().manual_seed(0))
    assert model.frozen.weight.grad is None and torch.equal(model.frozen.weight, frozen_before)
    assert_gaussian(model.unused.weight.grad, 1.0)
    assert len(opt._trainable_params()) == 4
    # noise off: the unused parameter's gradient is exactly zero
    dp_step(net, dp_net, x, y)
    assert torch.count_nonzero(model.unused.weight.grad) == 0 and model.used.weight.grad.norm() > 0


# -- scaling and accumulation ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ENGINES)
def test_mean_divides_by_the_expected_batch_size_not_the_actual_one(mode):
    x, y = data(n=7)
    grads = {}
    for reduction in ("mean", "sum"):
        model = mlp()  # a model per engine: the hooks of one wrapper stay on the model
        dp_model = compiled(model, x, mode, reduction)
        dp_step(model, dp_model, x, y, reduction=reduction, max_grad_norm=0.5, expected_batch_size=10)
        grads[reduction] = [p.grad.clone() for p in model.parameters()]
    for g_mean, g_sum in zip(grads["mean"], grads["sum"]):
        assert g_sum.norm() > 0
        torch.testing.assert_close(g_mean * 10, g_sum)


def test_mean_needs_an_expected_batch_size():
    with pytest.raises(ValueError, match="expected_batch_size"):
        DPOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                    expected_batch_size=None)


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("zero_grad_each_physical_step", [True, False])
def test_accumulation_over_physical_steps_equals_one_logical_step(mode, zero_grad_each_physical_step):
    x, y = data(n=12, scale=3.0)
    results = []
    for splits in ([12], [5, 7], [4, 4, 4]):
        model = mlp()
        dp_model = compiled(model, x, mode, "mean")
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), noise_multiplier=0.0,
                          max_grad_norm=0.3, expected_batch_size=12, sink=sink_of(dp_model))
        hooked = []
        opt.attach_step_hook(hooked.append)
        for _ in range(2):  # two logical steps, so momentum state counts too
            opt.zero_grad()
            start = 0
            for k, size in enumerate(splits):
                if zero_grad_each_physical_step and k > 0:
                    opt.zero_grad()
                loss_fn(dp_model(x[start:start + size]), y[start:start + size], "mean").backward()
                start += size
                last = k == len(splits) - 1
                opt.signal_skip_step(not last)
                opt.step()
                assert len(hooked) == opt.steps  # a logical step only after the last physical batch
        assert len(hooked) == 2 and opt.steps == 2
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b)


# -- errors a user sees --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ENGINES)
def test_forgotten_zero_grad_is_an_error(mode):
    model = mlp()
    x, y = data()
    dp_model = compiled(model, x, mode)
    opt = dp_step(model, dp_model, x, y, lr=0.1)
    loss_fn(dp_model(x), y, "sum").backward()
    with pytest.raises(RuntimeError, match=r"without optimizer.zero_grad\(\)"):
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss_fn(dp_model(x), y, "sum").backward()
    opt.step()  # fine once zero_grad was called
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", [*ENGINES, "fx+bookkeeping"])
def test_a_sample_with_a_non_finite_per_sample_gradient_is_dropped_with_a_warning_naming_it(mode):
    """Its contribution is 0 (as if clipped to 0: the step stays private, and no inf or NaN reaches the sum);
    the others are clipped and added as always, checked against batches of one."""
    C = 0.5
    model = mlp()
    x, y = data(scale=10.0)
    x[3, 2] = float("inf")
    reference = per_sample_grads(model, x, y)
    expected = {}
    for i, ref in enumerate(reference):
        if i != 3:
            norm = torch.sqrt(sum(g.pow(2).sum() for g in ref.values()))
            for q, g in ref.items():
                expected[q] = expected.get(q, 0) + g * min(1.0, C / (float(norm) + 1e-6))
    dp_model = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction="sum",
                                   sink=BookkeepingSink() if mode == "fx+bookkeeping" else None,
                                   grad_sample_mode="fx" if mode == "fx+bookkeeping" else mode)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
                      expected_batch_size=7, loss_reduction="sum", sink=sink_of(dp_model),
                      param_names={p: n for n, p in model.named_parameters()})
    opt.zero_grad()
    loss_fn(dp_model(x), y, "sum").backward()
    with pytest.warns(NonFiniteSampleWarning, match=r"parameter '0.weight' is not finite .* 1 of 7 samples \(first: "
                                                    r"sample 3\): those samples contribute nothing"):
        opt.step()
    for q in model.parameters():
        torch.testing.assert_close(q.grad, expected[q])


def _sample_1_not_finite(sink, fill: float):
    """An MLP's parameters with per-sample gradients of 3 samples (all ``fill``) but a NaN in sample 1's gradient of
    the third parameter; their values before any step; a DP optimizer reading them through ``sink``."""
    params = list(mlp().parameters())
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad_sample = torch.full((3, *p.shape), fill, dtype=p.dtype)
    params[2].grad_sample[1, 0, 0] = float("nan")
    return params, before, DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                                       expected_batch_size=3, sink=sink)


def test_a_sink_that_cannot_drop_samples_refuses_the_step_saying_where_the_parameter_is():
    class CannotDrop(GradSampleSink):
        drop_samples = GradientSink.drop_samples

    params, before, opt = _sample_1_not_finite(CannotDrop(), fill=0.0)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[2\] of shape \(3, 5\)' is not finite .* "
                                           r"cannot leave those samples out"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, params))


def test_per_sample_gradients_of_different_batches_are_an_error():
    model = mlp()
    params = list(model.parameters())
    for p, rows in zip(params, (4, 4, 3, 4)):
        p.grad_sample = torch.zeros(rows, *p.shape, dtype=p.dtype)
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                      param_names={p: n for n, p in model.named_parameters()})
    with pytest.raises(RuntimeError, match="'0.weight' has per-sample gradients for 4 samples but '2.weight' for 3"):
        opt.step()


@pytest.mark.parametrize("mode", ENGINES)
def test_a_gradient_without_per_sample_gradient_is_an_error(mode):
    """A parameter of the optimizer used outside the compiled model would lose its update silently."""
    model = mlp()
    extra = nn.Parameter(torch.ones((), dtype=DTYPE))
    x, y = data()
    dp_model = compiled(model, x, mode)
    opt = DPOptimizer(torch.optim.SGD([*model.parameters(), extra], lr=0.1), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=7, sink=sink_of(dp_model), param_names={extra: "extra"})
    opt.zero_grad()
    loss_fn(dp_model(x) * extra, y, "mean").backward()
    with pytest.raises(RuntimeError, match="parameter 'extra' received a gradient in backward but no per-sample"):
        opt.step()


def test_bad_settings_are_refused():
    params = list(mlp().parameters())
    sgd = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPOptimizer(sgd, noise_multiplier=-1.0, max_grad_norm=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
        DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=0.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="secure_mode"):
        DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, secure_mode=True,
                    generator=torch.Generator())
    opt = DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    with pytest.raises(TypeError, match="already a DPOptimizer"):
        DPOptimizer(opt, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)


# -- the optimizer's surface ---------------------------------------------------------------------------


def test_closure_lr_scheduler_and_proxied_attributes():
    model = mlp()
    x, y = data()
    dp_model = compiled(model, x, "fx", "mean")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DPOptimizer(sgd, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=7, sink=sink_of(dp_model))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def closure():
        opt.zero_grad()
        loss = loss_fn(dp_model(x), y, "mean")
        loss.backward()
        return loss

    loss = opt.step(closure)
    sched.step()
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert opt.param_groups is sgd.param_groups and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.state is sgd.state and opt.defaults is sgd.defaults and opt.original_optimizer is sgd


@pytest.mark.parametrize("mode", ENGINES)
def test_state_dict_round_trip_continues_the_same_run(mode):
    """Two steps, save, two more; a fresh optimizer loaded from the save takes the same two steps
    (Adam's moments, the step count and the noise generator's position are all restored)."""
    x, y = data(n=8)

    def run(model, opt, dp_model, steps):
        for _ in range(steps):
            opt.zero_grad()
            loss_fn(dp_model(x), y, "mean").backward()
            opt.step()

    def make(model, dp_model, seed):
        return DPOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), noise_multiplier=0.7, max_grad_norm=1.0,
                           expected_batch_size=8, sink=sink_of(dp_model), generator=torch.Generator().manual_seed(seed))

    model = mlp()
    dp_model = compiled(model, x, mode, "mean")
    opt = make(model, dp_model, 0)
    run(model, opt, dp_model, 2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(model, opt, dp_model, 2)

    resumed = mlp(seed=5)
    resumed.load_state_dict(saved_model)
    dp_resumed = compiled(resumed, x, mode, "mean")
    opt2 = make(resumed, dp_resumed, 123)
    opt2.load_state_dict(saved_opt)
    assert opt2.steps == 2
    run(resumed, opt2, dp_resumed, 2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def test_load_state_dict_refuses_another_clipping_mode():
    params = list(mlp().parameters())
    flat = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    per_layer = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=[1.0] * 4,
                            expected_batch_size=4, clipping="per_layer")
    with pytest.raises(ValueError, match="clipping='flat'"):
        per_layer.load_state_dict(flat.state_dict())


# -- secure mode ---------------------------------------------------------------------------------------


def test_secure_normal_has_mean_0_and_std_1():
    z = secure_standard_normal(200_000)
    assert z.dtype == torch.float64 and z.shape == (200_000,)
    assert_gaussian(z, 1.0)
    # not a constant or a repeated draw
    assert not torch.equal(z, secure_standard_normal(200_000))


def test_secure_noise_matches_reference_dtype_device_and_std():
    ref = torch.empty(300, 400, dtype=torch.float32)
    noise = gaussian_noise(ref, 2.5, secure_mode=True)
    assert noise.shape == ref.shape and noise.dtype == torch.float32
    assert_gaussian(noise, 2.5)
    assert SECURE_DRAWS >= 2  # the sum of several draws is what guards against the floating-point attack


@pytest.mark.parametrize("mode", ENGINES)
def test_secure_mode_step_adds_noise_of_the_right_std(mode):
    sigma, C = 1.1, 0.4
    model = wide_model()
    x, y = data(n=8, d=100, scale=5.0)
    dp_model = compiled(model, x, mode)
    params = list(model.parameters())
    dp_step(model, dp_model, x, y, max_grad_norm=C)
    clean = [p.grad.clone() for p in params]
    dp_step(model, dp_model, x, y, max_grad_norm=C, noise_multiplier=sigma, secure_mode=True)
    assert_gaussian(torch.cat([(p.grad - g).flatten() for p, g in zip(params, clean)]), sigma * C)


def test_sink_none_reads_grad_sample():
    opt = DPOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=4)
    assert isinstance(opt.sink, GradSampleSink)


def test_load_state_dict_keeps_the_optimizers_noise_and_bounds_with_a_warning():
    """As on Opacus: the settings stay the optimizer's; the state (steps) is the checkpoint's."""
    params = list(mlp().parameters())
    saved = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=0.5,
                        expected_batch_size=4)
    saved.steps = 3
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=2.0, max_grad_norm=0.5, expected_batch_size=8)
    with pytest.warns(UserWarning, match=r"saved with noise_multiplier=1.0, expected_batch_size=4; this optimizer "
                                         r"keeps its own noise_multiplier=2.0, expected_batch_size=8"):
        opt.load_state_dict(saved.state_dict())
    assert (opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size, opt.steps) == (2.0, 0.5, 8, 3)


def test_load_state_dict_refuses_a_logical_batch_in_progress_clipped_to_another_bound():
    """Skipped steps' clipped sums were clipped to the checkpoint's bound; the noise of the step that finishes
    them follows this optimizer's: a larger saved bound would be under-noised."""
    model = mlp()
    saved = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=2.0,
                        expected_batch_size=4)
    for p in model.parameters():
        p.grad_sample = torch.ones(2, *p.shape)
    saved.signal_skip_step()
    saved.step()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=0.5,
                      expected_batch_size=4)
    with pytest.raises(ValueError, match=r"logical batch in progress .* clipped to max_grad_norm=2.0"):
        opt.load_state_dict(saved.state_dict())
    opt.max_grad_norm = 2.0
    opt.load_state_dict(saved.state_dict())
    assert len(opt.step_state.summed) == len(list(model.parameters()))


def test_optim_imports_nothing_from_fxdp_but_the_sink_contract():
    """fxdp/optim depends only on fxdp/sinks/contract.py, so any sink (materialising, book-keeping)
    serves it and the engines can change freely."""
    package = pathlib.Path(fxdp.__file__).parent / "optim"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                assert not isinstance(node, ast.ImportFrom), f"{path.name}: relative import"
                continue
            for name in names:
                if name == "fxdp" or name.startswith("fxdp."):
                    allowed = name == "fxdp.sinks.contract" or name.startswith("fxdp.optim")
                    assert allowed, f"{path.name} imports {name}"


class Mixed(nn.Module):
    """An embedding, a convolution, a layer norm, an attention block and a linear head: each book-keeping family."""

    def __init__(self):
        super().__init__()
        self.emb, self.conv = nn.Embedding(11, 6), nn.Conv1d(6, 6, 3, padding=1)
        self.norm, self.attn = nn.LayerNorm(6), nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, tokens):
        h = self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        h = self.norm(h)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


@pytest.mark.parametrize("book_kept", [True, False], ids=["bookkeeping", "materialised"])
def test_a_dropped_sample_adds_nothing_in_every_layer_family(book_kept):
    """Sample 2's loss weighted by inf makes its gradient non-finite in every layer: the step is the clipped sum
    of the other samples, each computed alone."""
    torch.manual_seed(0)
    model = Mixed().to(DTYPE)
    tokens = torch.randint(0, 11, (5, 7))
    weights = torch.ones(5, dtype=DTYPE)
    weights[2] = float("inf")
    C, params = 0.3, list(model.parameters())
    expected = [torch.zeros_like(p) for p in params]
    for i in (0, 1, 3, 4):
        grads = torch.autograd.grad(model(tokens[i:i + 1]).pow(2).sum(), params)
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        for e, g in zip(expected, grads):
            e += g * min(1.0, C / (norm + 1e-6))
    dp = fxdp.compile_for_dp(model, example_inputs=tokens, loss_reduction="sum",
                             sink=BookkeepingSink() if book_kept else None)
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=5,
                      loss_reduction="sum", sink=sink_of(dp))
    (dp(tokens).pow(2).sum(1) * weights).sum().backward()
    with pytest.warns(NonFiniteSampleWarning, match=r"for 1 of 5 samples \(first: sample 2\)"):
        opt.step()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e)


def test_a_sink_that_keeps_a_dropped_sample_refuses_the_step_before_anything_moves():
    """After non-finite samples are dropped, a clipped sum that is still not finite (a sink that said it dropped the
    record and did not) is refused: the NaN would otherwise reach the noised gradient."""
    class ForgetsToDrop(GradSampleSink):
        def drop_samples(self, params, dropped):
            pass

    params, before, opt = _sample_1_not_finite(ForgetsToDrop(), fill=1.0)
    with pytest.warns(NonFiniteSampleWarning, match="1 of 3 samples"), \
            pytest.raises(RuntimeError, match="a clipped sum is not finite after the samples with a non-finite "
                                              "per-sample gradient were dropped"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, params))
