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


# char-lstm: names as padded sequences of character ids, an embedding, DPLSTM (batch first) and a linear head
# on the last time step; Adam; ε asked from the engine.
class CharNNClassifier(nn.Module):
    def __init__(self, embedding_size, hidden_size, output_size, num_lstm_layers=1, bidirectional=False,
                 vocab_size=256):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.lstm = DPLSTM(embedding_size, hidden_size, num_layers=num_lstm_layers, bidirectional=bidirectional,
                           batch_first=True)
        self.out_layer = nn.Linear(hidden_size * (2 if bidirectional else 1), output_size)

    def forward(self, x, hidden=None):
        x = self.embedding(x)            # -> [B, T, D]
        x, _ = self.lstm(x, hidden)      # -> [B, T, H]
        x = x[:, -1, :]                  # -> [B, H]
        return self.out_layer(x)         # -> [B, C]


@pytest.mark.parametrize("bidirectional", [False, True])
def test_char_lstm_example(bidirectional):
    torch.manual_seed(0)
    names = torch.randint(1, 256, (48, 15))
    names[::3, 10:] = 0                  # shorter names, padded with 0 as the example's collate does
    data = TensorDataset(names, torch.randint(0, 18, (48,)))
    model = CharNNClassifier(16, 32, 18, num_lstm_layers=2, bidirectional=bidirectional)
    before = snapshot(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    privacy_engine = PrivacyEngine(secure_mode=False)
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=12), noise_multiplier=1.0,
        max_grad_norm=1.5)
    criterion = nn.CrossEntropyLoss()
    steps = 0
    for x, y in train_loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        steps += 1
    assert steps == len(train_loader) == 4
    # an Opacus example iterates every parameter; Adam moves every one that got a gradient (the rows of the
    # embedding no sample used get only noise, which moves them too)
    assert all_changed(before, model)
    assert_epsilon_is_independent(privacy_engine, steps, 1.0, 12 / 48, "pld")


def test_char_lstm_step_is_the_clipped_mean_of_samples_run_alone():
    torch.manual_seed(2)
    names = torch.randint(1, 40, (16, 7))
    data = TensorDataset(names, torch.randint(0, 5, (16,)))
    model = CharNNClassifier(6, 8, 5, vocab_size=40).double()
    plain = copy.deepcopy(model)
    before = snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    dp_model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0,
        max_grad_norm=0.1)
    x, y = next(iter(loader))
    assert len(x) > 0
    optimizer.zero_grad()
    F.cross_entropy(dp_model(x), y).backward()
    optimizer.step()
    expected = clipped_mean_update(plain, lambda m, i: F.cross_entropy(m(x[i:i + 1]), y[i:i + 1]), len(x), 0.1, 8.0)
    for k, p in model.named_parameters():
        torch.testing.assert_close(before[k] - p.detach(), expected[k], rtol=1e-6, atol=1e-9)


# imdb: reviews as 256 token ids, an embedding averaged over the sequence and a linear layer; Adam;
# make_private_with_epsilon for a target ε over the epochs planned.
class SampleNet(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.fc1 = nn.Linear(16, 2)

    def forward(self, x):
        x = self.emb(x)                  # -> [B, T, 16]
        x = x.mean(1)                    # -> [B, 16]
        return self.fc1(x)               # -> [B, 2]


def test_imdb_example():
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, 1000, (40, 256)), torch.randint(0, 2, (40,)))
    model = SampleNet(vocab_size=1000)
    before = snapshot(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    privacy_engine = PrivacyEngine()
    epochs = 2
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=10), target_epsilon=3.0,
        target_delta=DELTA, epochs=epochs, max_grad_norm=1.0)
    criterion = nn.CrossEntropyLoss()
    steps = 0
    for _epoch in range(epochs):
        for data_, label in train_loader:
            optimizer.zero_grad()
            predictions = model(data_).squeeze(1)
            loss = criterion(predictions, label)
            loss.backward()
            optimizer.step()
            steps += 1
    assert steps == epochs * len(train_loader) == 8
    assert all_changed(before, model)
    epsilon = privacy_engine.get_epsilon(DELTA)
    assert 3.0 - 0.01 <= epsilon <= 3.0      # the target, within make_private_with_epsilon's tolerance
    assert_epsilon_is_independent(privacy_engine, steps, optimizer.noise_multiplier, 10 / 40, "pld")


# dcgan: only the discriminator is private. Each step runs it on a real batch and on the generator's fakes
# (detached), adds the two losses and takes one backward and one private step; then the generator trains
# through the discriminator with its own plain optimizer. The discriminator's output is squeezed to (N,).
NZ, NGF, NDF, NC = 16, 4, 4, 3


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(NGF * 8), nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 8, NGF * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF * 4), nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 4, NGF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF * 2), nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF), nn.ReLU(True),
            nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False), nn.Tanh())   # -> NC x 64 x 64

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False), nn.GroupNorm(2, NDF * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, NDF * 4, 4, 2, 1, bias=False), nn.GroupNorm(2, NDF * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 4, NDF * 8, 4, 2, 1, bias=False), nn.GroupNorm(2, NDF * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


def test_dcgan_example():
    torch.manual_seed(0)
    data = TensorDataset(torch.rand(32, NC, 64, 64) * 2 - 1)
    net_g, net_d = Generator(), Discriminator()
    before_g, before_d = snapshot(net_g), snapshot(net_d)
    criterion = nn.BCELoss()
    optimizer_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    privacy_engine = PrivacyEngine(secure_mode=False)
    net_d, optimizer_d, dataloader = privacy_engine.make_private(
        module=net_d, optimizer=optimizer_d, data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0,
        max_grad_norm=1.0)
    steps = 0
    for (real_data,) in dataloader:
        # (1) the discriminator, privately: real batch labelled 1, fakes labelled 0
        optimizer_d.zero_grad(set_to_none=True)
        batch_size = real_data.size(0)
        output = net_d(real_data)
        err_d_real = criterion(output, torch.full((batch_size,), 1.0))
        fake = net_g(torch.randn(batch_size, NZ, 1, 1))
        output = net_d(fake.detach())
        err_d_fake = criterion(output, torch.full((batch_size,), 0.0))
        err_d = err_d_fake + err_d_real
        err_d.backward()
        optimizer_d.step()
        optimizer_d.zero_grad(set_to_none=True)
        # (2) the generator, through the discriminator, with its plain optimizer
        optimizer_g.zero_grad()
        err_g = criterion(net_d(fake), torch.full((batch_size,), 1.0))
        err_g.backward()
        optimizer_g.step()
        steps += 1
    assert steps == len(dataloader) == 4
    assert all_changed(before_d, net_d)
    assert all_changed(before_g, net_g)
    assert_epsilon_is_independent(privacy_engine, steps, 1.0, 8 / 32, "pld")


# the vision benchmark: a ResNet on 3x32x32 images whose BatchNorms ModuleValidator.fix replaces (GroupNorm),
# validated, made private, one SGD step on a batch of 64.
class BasicBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


def small_resnet():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         BasicBlock(8), BasicBlock(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def vision_benchmark_models():
    yield "small_resnet", small_resnet
    try:
        import torchvision
    except Exception:  # noqa: BLE001  (no torchvision build beside this torch: the small ResNet only)
        return
    yield "resnet18", lambda: torchvision.models.resnet18(num_classes=10)


@pytest.mark.parametrize("name, make", list(vision_benchmark_models()))
def test_vision_benchmark_example(name, make):
    torch.manual_seed(0)
    model = make()
    assert ModuleValidator.validate(model, strict=False)      # its BatchNorms are reported
    model = ModuleValidator.fix(model)
    assert ModuleValidator.validate(model, strict=False) == []
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    before = snapshot(model)
    data = TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    privacy_engine = PrivacyEngine()
    model, optimizer, loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=64), noise_multiplier=1.0,
        max_grad_norm=1.0)
    for images, target in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(images), target).backward()
        optimizer.step()
    assert all_changed(before, model)
    assert_epsilon_is_independent(privacy_engine, 1, 1.0, 1.0, "pld")


def test_dcgan_discriminator_step_pairs_each_real_sample_with_its_fake():
    """The discriminator sees two batches before one backward: sample i's gradient is that of its real image's
    loss plus its fake's (as Opacus sums them), clipped as one; checked noise-free against each pair run
    alone (float64)."""
    torch.manual_seed(3)
    net_d = Discriminator().double()
    plain = copy.deepcopy(net_d)
    before = snapshot(net_d)
    real = torch.rand(8, NC, 64, 64, dtype=torch.float64) * 2 - 1
    fake = torch.rand(8, NC, 64, 64, dtype=torch.float64) * 2 - 1
    dp_d, optimizer_d, loader = PrivacyEngine().make_private(
        module=net_d, optimizer=torch.optim.SGD(net_d.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(real, fake), batch_size=8), noise_multiplier=0.0, max_grad_norm=0.01)
    real_batch, fake_batch = next(iter(loader))
    n = len(real_batch)
    assert n > 0
    optimizer_d.zero_grad(set_to_none=True)
    err_real = F.binary_cross_entropy(dp_d(real_batch), torch.ones(n, dtype=torch.float64))
    err_fake = F.binary_cross_entropy(dp_d(fake_batch), torch.zeros(n, dtype=torch.float64))
    (err_fake + err_real).backward()
    optimizer_d.step()

    def pair_loss(m, i):
        return (F.binary_cross_entropy(m(real_batch[i:i + 1]), torch.ones(1, dtype=torch.float64))
                + F.binary_cross_entropy(m(fake_batch[i:i + 1]), torch.zeros(1, dtype=torch.float64)))

    expected = clipped_mean_update(plain, pair_loss, n, 0.01, 8.0)
    for k, p in net_d.named_parameters():
        torch.testing.assert_close(before[k] - p.detach(), expected[k], rtol=1e-6, atol=1e-9)
