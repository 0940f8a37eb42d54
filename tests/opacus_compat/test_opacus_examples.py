"""The usage patterns of Opacus 1.6's examples (mnist, cifar10, char-lstm, imdb, dcgan, the vision benchmark),
written anew as an Opacus user writes them, with only the imports switched to fxdp's: synthetic data of the
real shapes, small models of the examples' kinds, a few steps each.

Each asserts what the run did: the steps taken, the parameters changed, ε equal to an independent computation
over the steps taken, and where cheap the update of a noise-free step against each sample run alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fxdp import PrivacyEngine                      # was: from opacus import PrivacyEngine
from fxdp.data import BatchMemoryManager             # was: from opacus.utils.batch_memory_manager import ...
from fxdp.layers import DPLSTM                       # was: from opacus.layers import DPLSTM
from fxdp.validators import ModuleValidator          # was: from opacus.validators import ModuleValidator
from tests.support.opacus_examples import clipped_mean_update, collapse, independent_epsilon

DELTA = 1e-5


def snapshot(module):
    return {k: p.detach().clone() for k, p in module.named_parameters()}


def all_changed(before, module):
    return all(not torch.equal(before[k], p) for k, p in module.named_parameters() if p.requires_grad)


def assert_epsilon_is_independent(engine, steps, sigma, q, accountant):
    assert collapse(engine.accountant.history) == [(sigma, q, steps)]
    eps = engine.get_epsilon(DELTA)
    assert 0 < eps < float("inf")
    assert eps == pytest.approx(independent_epsilon([(sigma, q, steps)], DELTA, accountant), rel=1e-6)


# mnist: a small convnet on 1x28x28 digits, SGD, make_private with a fixed noise multiplier, the accountant
# asked directly for ε after each epoch.
class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(8, 16, 4, 2)
        self.fc1 = nn.Linear(16 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))        # -> 8, 14, 14
        x = F.max_pool2d(x, 2, 1)        # -> 8, 13, 13
        x = F.relu(self.conv2(x))        # -> 16, 5, 5
        x = F.max_pool2d(x, 2, 1)        # -> 16, 4, 4
        x = x.view(-1, 16 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def test_mnist_example():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    train_loader = DataLoader(data, batch_size=16)
    model = SampleConvNet()
    before = snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0)
    privacy_engine = PrivacyEngine(secure_mode=False)
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader, noise_multiplier=1.1, max_grad_norm=1.0)
    criterion = nn.CrossEntropyLoss()
    steps = 0
    for _epoch in range(2):
        model.train()
        for images, target in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(images), target)
            loss.backward()
            optimizer.step()
            steps += 1
        epsilon = privacy_engine.accountant.get_epsilon(delta=DELTA)
        assert 0 < epsilon < float("inf")
    assert steps == 2 * len(train_loader) == 8
    assert all_changed(before, model)
    assert_epsilon_is_independent(privacy_engine, steps, 1.1, 16 / 64, "pld")


def test_mnist_example_step_is_the_clipped_mean_of_samples_run_alone():
    """One noise-free step of the mnist pattern moves each weight by -lr × Σᵢ clip(gᵢ) / expected batch size,
    gᵢ computed from sample i alone (float64)."""
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(32, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (32,)))
    model = SampleConvNet().double()
    plain = copy.deepcopy(model)
    before = snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    privacy_engine = PrivacyEngine()
    dp_model, optimizer, loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0,
        max_grad_norm=0.05)
    images, target = next(iter(loader))
    assert len(images) > 0
    optimizer.zero_grad()
    nn.CrossEntropyLoss()(dp_model(images), target).backward()
    optimizer.step()
    expected = clipped_mean_update(
        plain, lambda m, i: F.cross_entropy(m(images[i:i + 1]), target[i:i + 1]), len(images), 0.05, 8.0)
    for k, p in model.named_parameters():
        torch.testing.assert_close((before[k] - p.detach()) / 0.5, expected[k], rtol=1e-6, atol=1e-9)


# cifar10: a convnet on 3x32x32 images, per-layer clipping (one norm per parameter), physical batches cut by
# BatchMemoryManager from a larger logical batch, a checkpoint saved and loaded.
def cifar_convnet():
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=3, stride=1, padding=1), nn.ReLU(), nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(8, 16, kernel_size=3, stride=1, padding=1), nn.ReLU(), nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(16, 16, kernel_size=3, stride=1, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(start_dim=1, end_dim=-1), nn.Linear(16, 10, bias=True))


def test_cifar10_example(tmp_path):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 3, 32, 32), torch.randint(0, 10, (96,)))
    model = cifar_convnet()
    before = snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0)
    privacy_engine = PrivacyEngine(accountant="rdp")
    clip_per_layer = [0.5] * len([p for p in model.parameters() if p.requires_grad])
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=32), noise_multiplier=1.5,
        max_grad_norm=clip_per_layer, clipping="per_layer", poisson_sampling=True)
    criterion = nn.CrossEntropyLoss()
    physical = 0
    with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=8, optimizer=optimizer) as loader:
        for images, target in loader:
            assert len(images) <= 8
            optimizer.zero_grad()
            criterion(model(images), target).backward()
            optimizer.step()
            physical += 1
    assert physical >= len(train_loader)
    assert all_changed(before, model)
    assert_epsilon_is_independent(privacy_engine, len(train_loader), 1.5, 32 / 96, "rdp")
    # the example checkpoints the model, the optimizer and the accountant
    privacy_engine.save_checkpoint(path=tmp_path / "checkpoint.tar", module=model, optimizer=optimizer)
    restored_engine = PrivacyEngine(accountant="rdp")
    restored_model = cifar_convnet()
    restored_model, restored_optimizer, _ = restored_engine.make_private(
        module=restored_model, optimizer=torch.optim.SGD(restored_model.parameters(), lr=0.1, momentum=0.9),
        data_loader=DataLoader(data, batch_size=32), noise_multiplier=1.5, max_grad_norm=clip_per_layer,
        clipping="per_layer")
    restored_engine.load_checkpoint(path=tmp_path / "checkpoint.tar", module=restored_model,
                                    optimizer=restored_optimizer)
    assert restored_engine.get_epsilon(DELTA) == privacy_engine.get_epsilon(DELTA)
    for (k, p), (_, q) in zip(model.named_parameters(), restored_model.named_parameters()):
        assert torch.equal(p, q), k
