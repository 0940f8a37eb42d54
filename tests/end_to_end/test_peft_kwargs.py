"""Keyword inputs a model's ``forward(**kwargs)`` passes on (a peft model passes ``token_type_ids`` to the BERT it
wraps): captured and trained as the plain model is.

The first tests follow the LoRA part of Opacus's text-classifier tutorial (building_text_classifier.ipynb) with
only its imports switched, on a tiny BERT built from a config: a ``TensorDataset`` of (input_ids, attention_mask,
token_type_ids, labels), ``make_private_with_epsilon(..., criterion=..., grad_sample_mode="ghost")``, each batch
given to the model as keywords, labels too, ``criterion(outputs[1], labels)``, and its evaluation in eval mode
(with the RDP accountant, quicker to calibrate here than the default).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import fxdp
from fxdp import PrivacyEngine  # was: from opacus import PrivacyEngine
from fxdp.diagnostics import ExportShapeError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, T, SAMPLES = 50, 8, 24


def _lora_bert(dropout: float = 0.1, dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = transformers.BertForSequenceClassification(config)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=4, target_modules=["query", "value"],
                           lora_dropout=dropout)
    model = peft.get_peft_model(model, lora).to(dtype)
    for p in model.parameters():  # LoRA's B starts at zero: give it values, so every gradient is exercised
        if p.requires_grad:
            with torch.no_grad():
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model.train()


def _tensors(n: int = SAMPLES, seed: int = 1):
    """What the tutorial's ``_features_to_dataset`` makes: ids, a padding mask, segment ids (premise 0, hypothesis
    1) and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, T), generator=g)
    lengths = torch.randint(4, T + 1, (n,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    segments = ((torch.arange(T)[None, :] >= (lengths[:, None] // 2)) & mask.bool()).long()
    labels = torch.randint(0, 3, (n,), generator=g)
    return ids * mask, mask, segments, labels


def _make_private(model, loader):
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2, eps=1e-8)
    engine = PrivacyEngine(accountant="rdp")  # (the tutorial's default accountant: the same, slower to calibrate)
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, criterion=nn.CrossEntropyLoss(reduction="mean"),
        target_delta=1 / len(loader), target_epsilon=7.5, epochs=1, max_grad_norm=0.1, grad_sample_mode="ghost")
    return engine, model, optimizer, criterion, loader


def _evaluate(model, loader):
    """The tutorial's evaluation: eval mode, no gradients, labels given, ``loss, logits = outputs[:2]``."""
    model.eval()
    losses = []
    for batch in loader:
        with torch.no_grad():
            inputs = {"input_ids": batch[0], "attention_mask": batch[1], "token_type_ids": batch[2], "labels": batch[3]}
            loss, logits = model(**inputs)[:2]
            assert logits.shape == (batch[0].shape[0], 3)
            losses.append(loss.item())
    model.train()
    return sum(losses) / len(losses)


@pytest.mark.parametrize("labels_to_the_model", [True, False])
def test_the_tutorials_lora_cell_trains_with_the_batch_given_as_keywords(labels_to_the_model):
    model = _lora_bert()
    loader = DataLoader(TensorDataset(*_tensors()), batch_size=8)
    test_loader = DataLoader(TensorDataset(*_tensors(6, seed=2)), batch_size=3)
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    engine, model_lora, optimizer, criterion, train_loader = _make_private(model, loader)
    steps = 0
    for step, batch in enumerate(train_loader):
        optimizer.zero_grad()
        inputs = {"input_ids": batch[0], "attention_mask": batch[1], "token_type_ids": batch[2]}
        if labels_to_the_model:
            inputs["labels"] = batch[3]
        outputs = model_lora(**inputs)  # output = loss, logits, ...
        loss = criterion(outputs[1] if labels_to_the_model else outputs.logits, batch[3])
        loss.backward()
        optimizer.step()
        assert math.isfinite(loss.item())
        steps += 1
        if step == 2:
            break
    assert steps == 3
    report = fxdp.report(model_lora)
    assert report.engine == "fx" and report.front_end == "torch.export", str(report)
    assert "token_type_ids" in inspect.signature(type(model_lora).forward).parameters  # captured with it
    assert 0 < engine.get_epsilon(1 / len(loader)) <= 7.5
    assert math.isfinite(_evaluate(model_lora, test_loader))
    # in eval mode under no_grad the compiled graph (its attention dropout captured on) gives way to the model itself
    x = {"input_ids": batch[0], "attention_mask": batch[1], "token_type_ids": batch[2]}
    model_lora.eval()
    with torch.no_grad():
        torch.testing.assert_close(model_lora(**x).logits, model.eval()(**x).logits)
        assert not torch.equal(model_lora.train()(**x).logits, model_lora(**x).logits)  # training: dropout on
    now = dict(model.named_parameters())
    assert all(not torch.equal(now[name], before) for name, before in trained.items())
    assert all(torch.equal(now[name], before) for name, before in frozen.items())


def test_a_dict_loader_gives_the_keywords_forward_passes_on_at_make_private():
    """A collator's dict batch: the model is captured with every tensor of it but the labels, token_type_ids too
    (which peft's forward does not name), and the training loop's ``model(**batch)`` is not captured again."""
    ids, mask, segments, labels = _tensors()
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "token_type_ids": segments[i], "labels": labels[i]}
            for i in range(SAMPLES)]
    engine, model, optimizer, criterion, loader = _make_private(_lora_bert(), DataLoader(rows, batch_size=8))
    assert list(inspect.signature(type(model).forward).parameters) == [
        "self", "input_ids", "attention_mask", "token_type_ids"]
    notes = " ".join(fxdp.report(model).notes)
    assert "(input_ids (2, 8), attention_mask (2, 8), token_type_ids (2, 8)); left out: labels" in notes
    batch = next(iter(loader))
    optimizer.zero_grad()
    outputs = model(**batch)
    criterion(outputs.logits, batch["labels"]).backward()
    optimizer.step()
    assert "graphs, kept" not in " ".join(fxdp.report(model).notes)  # one graph: not captured again


def _assert_per_sample_gradients(model, compiled, inputs, labels):
    F.cross_entropy(compiled(**inputs).logits, labels, reduction="sum").backward()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grad_samples = {name: p.grad_sample for name, p in named}
    assert any("lora_A" in name for name in grad_samples) and any("lora_B" in name for name in grad_samples)
    for _, p in named:
        del p.grad_sample
    model.zero_grad()
    for i in range(labels.shape[0]):
        F.cross_entropy(model(**{k: v[i:i + 1] for k, v in inputs.items()}).logits, labels[i:i + 1],
                        reduction="sum").backward()
        for name, p in named:
            torch.testing.assert_close(grad_samples[name][i], p.grad, atol=1e-10, rtol=1e-8, msg=f"{name}, {i}")
        model.zero_grad()


def test_per_sample_gradients_of_the_lora_parameters_against_batches_of_one():
    model = _lora_bert(dropout=0.0, dtype=torch.float64)
    ids, mask, segments, labels = _tensors(4)
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="sum")
    assert fxdp.report(compiled).engine == "fx", str(fxdp.report(compiled))
    plain = compiled(**{**inputs, "token_type_ids": torch.zeros_like(segments)}).logits
    assert not torch.allclose(plain, compiled(**inputs).logits)  # the segments reach the model
    model.zero_grad()
    _assert_per_sample_gradients(model, compiled, inputs, labels)


def test_a_keyword_the_capture_did_not_see_is_captured_for_the_call():
    """Compiled from input_ids and attention_mask, the model called with token_type_ids too is captured again
    with them (never run on a graph that leaves them out), and its per-sample gradients are right."""
    model = _lora_bert(dropout=0.0, dtype=torch.float64)
    ids, mask, segments, labels = _tensors(4)
    compiled = fxdp.compile_for_dp(model, example_inputs={"input_ids": ids, "attention_mask": mask},
                                   loss_reduction="sum")
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}
    _assert_per_sample_gradients(model, compiled, inputs, labels)
    assert "token_type_ids" in inspect.signature(type(compiled).forward).parameters
    assert "(2 graphs, kept: input_ids (N, 8), attention_mask (N, 8); input_ids (N, 8), attention_mask (N, 8), " \
           "token_type_ids (N, 8))" in " ".join(fxdp.report(compiled).notes)


class _Passes(nn.Module):
    """A wrapper whose ``forward(**kwargs)`` reads a flag, and a tensor only when its values say so (data-dependent
    control flow, which torch.export cannot capture)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 2)

    def forward(self, x, **kwargs):
        y = self.layer(x)
        if kwargs.get("double"):
            y = y * 2
        if "shift" in kwargs and bool(kwargs["shift"].sum() > 0):
            y = y + kwargs["shift"]
        return y


def test_a_flag_of_another_value_is_captured_again_and_an_uncapturable_keyword_refused():
    model = _Passes()
    x = torch.randn(4, 3)
    compiled = fxdp.compile_for_dp(model, example_inputs={"x": x, "double": True})
    assert fxdp.report(compiled).front_end == "torch.export"
    torch.testing.assert_close(compiled(x=x, double=True), model(x=x, double=True))
    torch.testing.assert_close(compiled(x=x, double=False), model(x=x, double=False))  # not the graph of True
    assert "x (N, 3), double=True; x (N, 3), double=False)" in " ".join(fxdp.report(compiled).notes)
    with pytest.raises(ExportShapeError) as info:
        compiled(x=x, double=True, shift=torch.ones(4, 2))
    message = str(info.value)
    assert "this call passes x, double, shift" in message
    assert "make it private with example_inputs= a dict of every keyword your training loop passes" in message


def _peft_model_without_task_type():
    """A LoRA BERT made with ``peft.get_peft_model`` and no ``task_type``: a plain ``PeftModel``, in float64."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config),
                                peft.LoraConfig(r=4, target_modules=["query", "value"])).double().train()
    assert type(model) is peft.PeftModel
    for p in model.parameters():
        if p.requires_grad:
            with torch.no_grad():
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model


def test_a_peft_model_without_task_type_takes_every_input_through_kwargs():
    """``PeftModel.forward(*args, **kwargs)`` names no input: each keyword is captured by its own name."""
    model = _peft_model_without_task_type()
    ids, mask, segments, labels = _tensors(3)
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="sum")
    assert fxdp.report(compiled).engine == "fx", str(fxdp.report(compiled))
    _assert_per_sample_gradients(model, compiled, inputs, labels)


def test_labels_given_to_a_peft_model_without_task_type_give_each_samples_own_loss():
    """``PeftModel.forward(*args, **kwargs)`` names no labels: fxdp looks through it to the model it wraps, whose
    forward takes them, and the private model's loss is each sample's own (its per-sample gradients are those of
    batches of one), where the model's own loss would have been averaged over the batch inside the graph."""
    model = _peft_model_without_task_type()
    ids, mask, segments, labels = _tensors(4)
    loader = DataLoader(TensorDataset(ids, mask, segments, labels), batch_size=4)
    private, optimizer, _, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        criterion=nn.CrossEntropyLoss(reduction="sum"), noise_multiplier=1.0, max_grad_norm=1.0,
        grad_sample_mode="ghost", poisson_sampling=False, loss_reduction="sum", materialise_grad_sample=True)
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}
    out = private(**inputs, labels=labels)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels, reduction="sum"))
    out.loss.backward()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grad_samples = {name: p.grad_sample.clone() for name, p in named}
    optimizer.zero_grad(set_to_none=True)
    for i in range(4):
        model.zero_grad()
        model(**{k: v[i:i + 1] for k, v in inputs.items()}, labels=labels[i:i + 1]).loss.backward()
        for name, p in named:
            torch.testing.assert_close(grad_samples[name][i], p.grad, atol=1e-10, rtol=1e-8, msg=f"{name}, {i}")
