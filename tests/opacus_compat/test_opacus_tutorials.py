"""The usage patterns of Opacus 1.6's tutorials (the text, image and LSTM classifiers, the guides to grad samplers
and to the module validator, the introduction to advanced features), written anew as an Opacus user writes them,
with only the imports switched to fxdp's: synthetic data of the real shapes, small models, a few steps each.
"""

from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fxdp import PrivacyEngine                                       # was: from opacus import PrivacyEngine
from fxdp.accounting import RDPAccountant                            # was: from opacus.accountants import ...
from fxdp.data import BatchMemoryManager, DPDataLoader               # was: opacus.utils.batch_memory_manager, opacus
from fxdp.engines import GradSampleModule                            # was: from opacus import GradSampleModule
from fxdp.grad_sample import register_grad_sampler                   # was: from opacus.grad_sample import ...
from fxdp.layers import DPLSTM                                       # was: from opacus.layers import DPLSTM
from fxdp.optim import DPOptimizer                                   # was: from opacus.optimizers import DPOptimizer
from fxdp.validators import (ModuleValidator, register_module_fixer,  # was: opacus.validators(.utils)
                             register_module_validator, UnsupportedModuleError)
from tests.support.opacus_examples import clipped_mean_update, collapse, independent_epsilon

DELTA = 1e-5


def snapshot(module):
    return {k: p.detach().clone() for k, p in module.named_parameters()}


def changed(before, module):
    return {k for k, p in module.named_parameters() if not torch.equal(before[k], p)}


# Text classifier with fast gradient clipping: a BERT sequence classifier whose lower layers are frozen, made
# private with grad_sample_mode="ghost" and criterion=, which returns the criterion to call for the loss.
# Only the imports switched. make_private captures the model from the first item of the loader's tuple batches;
# the loop passes the batch's items as keywords, so the first call captures the model again for them (once).
# labels= goes to the model, as in the tutorial: the output has a loss first (each sample's own, computed outside
# the graph) and the logits second, which the tutorial's criterion takes.
def test_text_classifier_tutorial():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=128, num_labels=3)
    model = transformers.BertForSequenceClassification(config)
    trainable_layers = [model.bert.encoder.layer[-1], model.bert.pooler, model.classifier]
    for p in model.parameters():
        p.requires_grad = False
    for layer in trainable_layers:
        for p in layer.parameters():
            p.requires_grad = True
    plain, before = model, snapshot(model)
    n, seq = 24, 128                      # MAX_SEQ_LENGTH of the tutorial
    input_ids = torch.randint(0, 30522, (n, seq))
    attention_mask = torch.ones(n, seq, dtype=torch.long)
    attention_mask[::2, 100:] = 0         # padded reviews
    token_type_ids = torch.zeros(n, seq, dtype=torch.long)
    data = TensorDataset(input_ids, attention_mask, token_type_ids, torch.randint(0, 3, (n,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, eps=1e-8)
    privacy_engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, train_dataloader = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=8), target_delta=DELTA,
        target_epsilon=7.5, epochs=1, max_grad_norm=0.1, grad_sample_mode="ghost",
        criterion=torch.nn.CrossEntropyLoss())
    model.train()
    steps = 0
    for batch in train_dataloader:
        optimizer.zero_grad()
        inputs = {"input_ids": batch[0], "attention_mask": batch[1], "token_type_ids": batch[2], "labels": batch[3]}
        outputs = model(**inputs)  # output = loss, logits, hidden_states, attentions
        loss = criterion(outputs[1], batch[3])
        loss.backward()
        optimizer.step()
        steps += 1
    assert steps == len(train_dataloader) == 3
    moved = changed(before, plain)
    assert moved == {k for k, p in plain.named_parameters() if p.requires_grad} and moved
    eps = privacy_engine.get_epsilon(DELTA)
    assert 7.5 - 0.01 <= eps <= 7.5
    assert collapse(privacy_engine.accountant.history) == [(optimizer.noise_multiplier, 8 / 24, 3)]
    assert eps == pytest.approx(independent_epsilon(privacy_engine.accountant.history, DELTA, "rdp"), rel=1e-9)


# Image classifier: a ResNet (here a small one) with BatchNorm, validated and fixed by ModuleValidator,
# RMSprop, make_private_with_epsilon, BatchMemoryManager cutting logical batches into physical ones.
def small_resnet():
    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), Block(8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def test_image_classifier_tutorial():
    torch.manual_seed(0)
    model = small_resnet()
    errors = ModuleValidator.validate(model, strict=False)
    assert len(errors) == 3 and all(isinstance(e, UnsupportedModuleError) for e in errors)
    with pytest.warns(UserWarning):
        model = ModuleValidator.fix(model)
    assert ModuleValidator.validate(model, strict=False) == []
    before = snapshot(model)
    data = TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    privacy_engine = PrivacyEngine()
    epochs, max_physical_batch_size = 2, 8
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=32), epochs=epochs,
        target_epsilon=50, target_delta=DELTA, max_grad_norm=1.2)
    criterion = nn.CrossEntropyLoss()
    for _epoch in range(epochs):
        model.train()
        with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=max_physical_batch_size,
                                optimizer=optimizer) as memory_safe_data_loader:
            for images, target in memory_safe_data_loader:
                assert len(images) <= max_physical_batch_size
                optimizer.zero_grad()
                output = model(images)
                loss = criterion(output, target)
                preds = output.detach().argmax(dim=1)
                assert preds.shape == target.shape
                loss.backward()
                optimizer.step()
    assert changed(before, model) == set(before)
    eps = privacy_engine.get_epsilon(DELTA)
    assert 50 - 0.01 <= eps <= 50
    history = collapse(privacy_engine.accountant.history)
    assert history == [(optimizer.noise_multiplier, 0.5, epochs * len(train_loader))]
    assert eps == pytest.approx(independent_epsilon(history, DELTA, "pld"), rel=1e-6)


# LSTM name classifier: characters as byte ids, an embedding, a DPLSTM and a linear head; names of many
# lengths padded; the DPLSTM holds nn.LSTM's state-dict keys, so a stock LSTM's weights load into it.
class CharByteRNN(nn.Module):
    def __init__(self, n_hidden=32, n_categories=18, embedding_size=8):
        super().__init__()
        self.embedding = nn.Embedding(256 + 1, embedding_size)   # one id per byte, one for padding
        self.lstm = DPLSTM(embedding_size, n_hidden, num_layers=1, batch_first=True)
        self.out_layer = nn.Linear(n_hidden, n_categories)

    def forward(self, x, hidden=None):
        x, _ = self.lstm(self.embedding(x), hidden)
        return self.out_layer(x[:, -1, :])


def test_lstm_name_classifier_tutorial():
    torch.manual_seed(0)
    assert set(DPLSTM(8, 32, batch_first=True).state_dict()) == set(nn.LSTM(8, 32, batch_first=True).state_dict())
    names = torch.randint(0, 256, (40, 12))
    names[:, 9:] = 256                    # padded to the longest name
    data = TensorDataset(names, torch.randint(0, 18, (40,)))
    model = CharByteRNN()
    before = snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    privacy_engine = PrivacyEngine(accountant="rdp")
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=10), noise_multiplier=1.3,
        max_grad_norm=1.5)
    criterion = nn.CrossEntropyLoss()
    for x, y in train_loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert changed(before, model) == set(before)
    history = collapse(privacy_engine.accountant.history)
    assert history == [(1.3, 0.25, 4)]
    assert privacy_engine.get_epsilon(DELTA) == pytest.approx(independent_epsilon(history, DELTA, "rdp"), rel=1e-9)


# Guide to grad samplers: a layer of one's own (an elementwise scale), its per-sample gradient rule registered
# with register_grad_sampler as fn(layer, activations, backprops) -> {parameter: per-sample gradient}.
class ScaleLayer(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.scale


@register_grad_sampler(ScaleLayer)
def compute_scale_layer_grad_sample(layer: ScaleLayer, activations: List[torch.Tensor],
                                    backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    activations = activations[0]
    return {layer.scale: torch.einsum("n...i,n...i->ni", backprops, activations)}


def test_grad_sampler_guide():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), ScaleLayer(5), nn.ReLU(), nn.Linear(5, 2)).double()
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 2, (7,))
    # per-sample gradients through the rule, against each sample run alone
    gsm = GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(gsm(x), y, reduction="sum").backward()
    for i in range(7):
        alone = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum"),
                                    model[1].scale)[0]
        torch.testing.assert_close(model[1].scale.grad_sample[i], alone)
    gsm._close() if hasattr(gsm, "_close") else gsm.remove_hooks()
    # and in training, through make_private
    model = nn.Sequential(nn.Linear(6, 5), ScaleLayer(5), nn.ReLU(), nn.Linear(5, 2))
    before = snapshot(model)
    privacy_engine = PrivacyEngine(accountant="rdp")
    dp_model, optimizer, loader = privacy_engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(32, 6), torch.randint(0, 2, (32,))), batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0)
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(dp_model(xb), yb).backward()
        optimizer.step()
    assert changed(before, model) == set(before)
    assert collapse(privacy_engine.accountant.history) == [(1.0, 0.25, 4)]


# Guide to the module validator: validate() lists what DP-SGD cannot train, is_valid() says whether the list is
# empty, fix() replaces what it can; one's own rules for one's own layer, registered Opacus's way (a fixer
# written def fix(module)).
class MyNorm(nn.Module):
    """Normalises over the batch dimension, as BatchNorm does: it mixes samples."""

    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x):
        return (x - x.mean(0)) * self.weight


@register_module_validator(MyNorm)
def validate_my_norm(module: MyNorm) -> List[UnsupportedModuleError]:
    return [UnsupportedModuleError("MyNorm normalises over the batch: replace it with nn.LayerNorm")]


@register_module_fixer(MyNorm)
def fix_my_norm(module: MyNorm) -> nn.Module:
    return nn.LayerNorm(module.weight.shape[0])


def test_module_validator_guide():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 30 * 30, 8), MyNorm(8),
                          nn.Linear(8, 2))
    errors = ModuleValidator.validate(model, strict=False)
    assert len(errors) == 2
    assert any("MyNorm normalises over the batch" in str(e) for e in errors)
    assert not ModuleValidator.is_valid(model)
    with pytest.raises(UnsupportedModuleError):
        ModuleValidator.validate(model, strict=True)
    with pytest.warns(UserWarning):
        fixed = ModuleValidator.fix(model)
    assert ModuleValidator.is_valid(fixed)
    assert isinstance(fixed[4], nn.LayerNorm) and isinstance(fixed[1], nn.GroupNorm)
    assert isinstance(model[4], MyNorm)           # fix() returns a fixed copy
    # the fixed model trains privately
    before = snapshot(fixed)
    dp_model, optimizer, loader = PrivacyEngine().make_private(
        module=fixed, optimizer=torch.optim.SGD(fixed.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 2, (16,))), batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0)
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(dp_model(xb), yb).backward()
        optimizer.step()
    assert changed(before, fixed) == set(before)


# Introduction to advanced features: the three pieces PrivacyEngine ties together, built by hand (GradSampleModule,
# DPOptimizer, DPDataLoader), an accountant fed by the optimizer's step hook; then a DPOptimizer subclass with
# Laplace noise of its own (which fxdp runs, warning that its accountants analyse the Gaussian mechanism).
class SampleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.fc1(x))


DATASET = TensorDataset(torch.randn(100, 16), torch.randint(0, 2, (100,)))


def test_advanced_features_intro_the_pieces_by_hand():
    torch.manual_seed(0)
    model = GradSampleModule(SampleNet())
    before = snapshot(model)
    data_loader = DPDataLoader.from_data_loader(DataLoader(DATASET, batch_size=10), distributed=False)
    sample_rate = 1 / len(data_loader)
    expected_batch_size = int(len(data_loader.dataset) * sample_rate)
    optimizer = DPOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.05), noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=expected_batch_size)
    accountant = RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    steps = 0
    for x, y in data_loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    assert steps == len(data_loader) == 10
    assert changed(before, model) == set(before)
    assert collapse(accountant.history) == [(1.0, 0.1, 10)]
    assert accountant.get_epsilon(delta=DELTA) == pytest.approx(
        independent_epsilon([(1.0, 0.1, 10)], DELTA, "rdp"), rel=1e-9)


class LaplaceDPOptimizer(DPOptimizer):
    def add_noise(self):
        for p in self.params:
            noise = torch.distributions.Laplace(loc=0, scale=self.noise_multiplier * self.max_grad_norm).sample(
                p.summed_grad.shape)
            p.grad = (p.summed_grad + noise).view_as(p.grad if p.grad is not None else p)


def test_advanced_features_intro_a_laplace_optimizer():
    torch.manual_seed(0)
    plain = SampleNet()
    reference = copy.deepcopy(plain)
    model = GradSampleModule(plain)
    with pytest.warns(UserWarning, match="LaplaceDPOptimizer overrides add_noise"):
        optimizer = LaplaceDPOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.05), noise_multiplier=1.0,
                                       max_grad_norm=1.0, expected_batch_size=10)
    x, y = DATASET.tensors[0][:10], DATASET.tensors[1][:10]
    before = [p.detach().clone() for p in plain.parameters()]
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    torch.manual_seed(7)
    optimizer.step()
    # the step is the clipped mean of the samples run alone plus the Laplace draws the subclass made, in its
    # order, over the expected batch size
    torch.manual_seed(7)
    noise = [torch.distributions.Laplace(loc=0, scale=1.0).sample(p.shape) for p in plain.parameters()]
    clipped = clipped_mean_update(reference, lambda m, i: F.cross_entropy(m(x[i:i + 1]), y[i:i + 1]), 10, 1.0, 10.0)
    for (k, _), b, p, z in zip(reference.named_parameters(), before, plain.parameters(), noise):
        torch.testing.assert_close((b - p.detach()) / 0.05, clipped[k] + z / 10, rtol=1e-4, atol=1e-5)
