"""The usage patterns of Opacus 1.6's tutorials (the text, image and LSTM classifiers, the guides to grad samplers
and to the module validator, the introduction to advanced features), written anew as an Opacus user writes them,
with only the imports switched to fxdp's: synthetic data of the real shapes, small models, a few steps each.
"""

from __future__ import annotations

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
from tests.support.opacus_examples import collapse, independent_epsilon

DELTA = 1e-5


def snapshot(module):
    return {k: p.detach().clone() for k, p in module.named_parameters()}


def changed(before, module):
    return {k for k, p in module.named_parameters() if not torch.equal(before[k], p)}


# Text classifier with fast gradient clipping: a BERT sequence classifier whose lower layers are frozen, made
# private with grad_sample_mode="ghost" and criterion=, which returns the criterion to call for the loss.
# Two edits beyond the imports (docs/migrating_from_opacus.md, "Not yet"): the loader yields tuples that the loop
# passes as keywords, so make_private is given those keywords as example_inputs (from a tuple batch it captures
# the model from the first item alone); and labels= is not passed to the model (fxdp refuses a loss computed
# inside the model; the tutorial's loss is the criterion's, outside, anyway).
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
        criterion=torch.nn.CrossEntropyLoss(),
        example_inputs=dict(input_ids=input_ids[:2], attention_mask=attention_mask[:2],       # edit 1
                            token_type_ids=token_type_ids[:2]))
    model.train()
    steps = 0
    for batch in train_dataloader:
        optimizer.zero_grad()
        inputs = {"input_ids": batch[0], "attention_mask": batch[1], "token_type_ids": batch[2]}  # edit 2: no labels
        outputs = model(**inputs)
        loss = criterion(outputs[0], batch[3])
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
