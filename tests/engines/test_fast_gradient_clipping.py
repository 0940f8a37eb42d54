"""Opacus's ghost-clipping surface, served by fxdp's book-keeping sink: GradSampleModuleFastGradientClipping /
GradSampleHooksFastGradientClipping, DPLossFastGradientClipping (its per-sample losses and their arithmetic),
DPOptimizerFastGradientClipping, make_private(grad_sample_mode="ghost", criterion=) and its 4-tuple. Clipped
updates are checked against per-sample gradients computed independently with torch.func."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

import fxdp
from fxdp.engines import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from fxdp.optim import DPOptimizerFastGradientClipping

C = 0.5


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
    return model, torch.randn(6, 4), torch.randint(0, 3, (6,))


def per_sample_grads(model, x, y):
    """{name: (N, *shape)} of each sample's cross-entropy, by torch.func (no fxdp)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def expected_update(model, x, y, lr, batch_size):
    grads = per_sample_grads(model, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    factors = (C / (norms + 1e-6)).clamp(max=1.0)
    return {k: v.detach() - lr * torch.einsum("n,n...->...", factors, grads[k]) / batch_size
            for k, v in model.named_parameters()}, norms, factors


@pytest.mark.parametrize("cls", [GradSampleModuleFastGradientClipping, GradSampleHooksFastGradientClipping])
def test_one_step_equals_the_independent_clipped_mean(cls):
    model, x, y = model_and_batch()
    expected, norms, factors = expected_update(copy.deepcopy(model), x, y, lr=1.0, batch_size=6)
    engine = cls(model, max_grad_norm=C)
    run = engine if cls is GradSampleModuleFastGradientClipping else model
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                                                max_grad_norm=C, expected_batch_size=6)
    criterion = DPLossFastGradientClipping(engine, optimizer, nn.CrossEntropyLoss())
    loss = criterion(run(x), y)
    assert isinstance(loss, DPTensorFastGradientClipping) and loss.loss_per_sample.shape == (6,)
    torch.testing.assert_close(torch.tensor(loss.item()), nn.functional.cross_entropy(model(x), y).detach())
    loss.backward()
    # book-kept, not materialised: p.grad_sample is None, as Opacus's ghost clipping leaves it after backward
    assert all(hasattr(p, "grad_sample") and p.grad_sample is None for p in model.parameters())
    torch.testing.assert_close(engine.get_norm_sample(), norms, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(engine.get_clipping_coef(), factors, rtol=1e-4, atol=1e-6)
    optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-4, atol=1e-6)


def test_loss_arithmetic_and_the_sum_reduction():
    model, x, y = model_and_batch()
    expected, _, _ = expected_update(copy.deepcopy(model), x, y, lr=1.0, batch_size=1)  # sum: no 1/N
    engine = GradSampleModuleFastGradientClipping(model, max_grad_norm=C, loss_reduction="sum")
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                                                max_grad_norm=C, expected_batch_size=6, loss_reduction="sum")
    criterion = DPLossFastGradientClipping(engine, optimizer, nn.CrossEntropyLoss(reduction="sum"), "sum")
    loss = criterion(engine(x), y)
    combined = 0.5 * loss + loss / 2 - 0.0  # the same per-sample losses: the same update
    torch.testing.assert_close(combined.loss_per_sample, loss.loss_per_sample)
    torch.testing.assert_close(torch.tensor((-loss).item()), -loss.loss_per_sample.sum().detach())
    combined.backward()
    optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-4, atol=1e-6)


def test_per_token_losses_are_reduced_per_sample():
    engine = GradSampleModuleFastGradientClipping(nn.Linear(3, 5))
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(engine.parameters(), lr=1.0), noise_multiplier=0.0,
                                                max_grad_norm=C, expected_batch_size=2)
    criterion = DPLossFastGradientClipping(engine, optimizer, nn.CrossEntropyLoss(ignore_index=-100))
    logits, target = torch.randn(2 * 4, 5), torch.tensor([1, 2, -100, -100, 0, 1, 2, 3])
    loss = criterion(logits, target, shape=(2, 4))
    tokens = nn.functional.cross_entropy(logits, target, reduction="none", ignore_index=-100).view(2, 4)
    torch.testing.assert_close(loss.loss_per_sample, torch.stack([tokens[0].sum() / 2, tokens[1].sum() / 4]))


def test_mismatched_reductions_are_refused():
    engine = GradSampleModuleFastGradientClipping(nn.Linear(3, 2))
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(engine.parameters(), lr=1.0), noise_multiplier=0.0,
                                                max_grad_norm=C, expected_batch_size=2)
    with pytest.raises(ValueError, match="loss reduction must be one"):
        DPLossFastGradientClipping(engine, optimizer, nn.CrossEntropyLoss(reduction="sum"))
    with pytest.raises(ValueError, match="cannot combine"):
        DPTensorFastGradientClipping(engine, optimizer, torch.ones(2), "mean") + \
            DPTensorFastGradientClipping(engine, optimizer, torch.ones(2), "sum")
    with pytest.raises(TypeError, match="computes no per-sample gradients"):
        DPLossFastGradientClipping(nn.Linear(3, 2), optimizer, nn.CrossEntropyLoss())


def test_make_private_ghost_returns_the_four_tuple_and_steps_as_the_independent_computation():
    model, x, y = model_and_batch()
    reference = copy.deepcopy(model)
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    engine = fxdp.PrivacyEngine()
    dp_model, optimizer, criterion, dp_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=C, grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(),
        poisson_sampling=False)
    assert isinstance(criterion, DPLossFastGradientClipping)
    xb, yb = next(iter(dp_loader))
    expected, _, _ = expected_update(reference, xb, yb, lr=1.0, batch_size=optimizer.expected_batch_size)
    optimizer.zero_grad()
    criterion(dp_model(xb), yb).backward()
    optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-4, atol=1e-6)
    assert len(engine.accountant) == 1


def test_ghost_fsdp_on_a_model_not_sharded_is_refused_before_anything_changes():
    """Opacus's ghost_fsdp is accepted for a fully_shard model (tests/distributed/test_fully_sharded.py)."""
    model, x, y = model_and_batch()
    engine = fxdp.PrivacyEngine()
    with pytest.raises(ValueError, match="ghost_fsdp.*is for a model sharded with.*fully_shard"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                            data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=1.0,
                            max_grad_norm=C, grad_sample_mode="ghost_fsdp")
    assert len(engine.accountant) == 0


def test_a_ghost_norm_rounded_below_zero_is_zero_not_nan():
    """A sample whose gradient is ~0 (a saturated softmax): <A Aᵀ, G Gᵀ> can round to a tiny negative value,
    whose square root would make its clip factor, and every parameter, NaN. The update must stay the
    independent one."""
    class Saturating(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.norm, self.wide = nn.Linear(2, 2), nn.LayerNorm(2), nn.Linear(2, 1024)
            self.narrow, self.out = nn.Linear(1024, 10), nn.Linear(10, 1)

        def forward(self, x):
            h = self.wide(self.norm(torch.relu(self.fc1(x))))
            return torch.softmax(self.out(self.narrow(h)).flatten(1), dim=1)

    for seed in (0, 1):  # seeds where a ghost norm rounds below 0
        torch.manual_seed(seed)
        model, x, y = Saturating(), torch.randn(10, 5, 2), torch.randint(0, 2, (10, 5)).float()
        reference = copy.deepcopy(model)
        params = {k: v.detach() for k, v in reference.named_parameters()}
        grads = vmap(grad(lambda p, xi, yi: nn.functional.cross_entropy(functional_call(reference, p, (xi[None],)),
                                                                         yi[None])), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
        factors = (C / (norms + 1e-6)).clamp(max=1.0)
        engine = GradSampleModuleFastGradientClipping(model, max_grad_norm=C)
        optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                                                    max_grad_norm=C, expected_batch_size=10)
        DPLossFastGradientClipping(engine, optimizer, nn.CrossEntropyLoss())(engine(x), y).backward()
        assert bool((engine.get_norm_sample() >= 0).all())
        optimizer.step()
        for name, p in model.named_parameters():
            expected = params[name] - torch.einsum("n,n...->...", factors, grads[name]) / 10
            torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-6)
