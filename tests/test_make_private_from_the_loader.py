"""make_private on a Hugging Face model without example_inputs, as Opacus users call it: the model is captured
with torch.export from a batch of the dataset's first samples, made by the loader's collate function, without
touching the loader's sampling; keyword inputs (dict batches) and positional ones (``(x, y)`` batches) alike.

Per-sample gradients are checked in float64 against each sample run alone, unpadded."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fxdp
from fxdp.diagnostics import GradientCheckpointingError, UnsupportedInputError

transformers = pytest.importorskip("transformers")
from fxdp.integrations.transformers import per_sample_loss  # noqa: E402

VOCAB, T = 50, 8


def gpt2(cls=None, **extra):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                                  pad_token_id=0, **extra)
    torch.manual_seed(0)
    return (cls or transformers.GPT2LMHeadModel)(cfg).double().train()


class Texts(Dataset):
    """Right-padded token sequences of different lengths, as a collator pads them to one length (T); labels of
    -100 on the padding. ``noisy``: each item also draws from torch's, Python's and NumPy's global generators, as
    an augmentation would."""

    def __init__(self, n: int = 12, noisy: bool = False, classes: int = 0):
        gen = torch.Generator().manual_seed(5)
        self.ids = torch.randint(2, VOCAB, (n, T), generator=gen)
        self.lengths = [T - (i % 4) for i in range(n)]
        self.noisy, self.classes = noisy, classes

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        n = self.lengths[i]
        ids = self.ids[i].clone()
        ids[n:] = 0
        item = {"input_ids": ids, "attention_mask": (torch.arange(T) < n).long()}
        if self.classes:
            item["labels"] = torch.tensor(i % self.classes)
        else:
            item["labels"] = torch.where(torch.arange(T) < n, ids, torch.tensor(-100))
        if self.noisy:
            item["draw"] = torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand())])
        return item


def _private(model, loader, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return fxdp.PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                             noise_multiplier=1.0, max_grad_norm=1.0, **kwargs)


def _unpadded(batch, i):
    n = int(batch["attention_mask"][i].sum())
    return {k: v[i:i + 1, :n] if v.dim() == 2 else v[i:i + 1] for k, v in batch.items()}


def _assert_per_sample_gradients(model, private, batch, task):
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    per_sample_loss(private(**inputs).logits, labels, task).mean().backward()
    got = {name: p.grad_sample.clone() for name, p in model.named_parameters()}
    for i in range(labels.shape[0]):
        one = _unpadded(batch, i)
        model.zero_grad()
        label = one.pop("labels")
        per_sample_loss(model(**one).logits, label, task).sum().backward()
        for name, p in model.named_parameters():
            expected = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(got[name][i], expected, atol=1e-9, rtol=1e-7, msg=f"{name}, sample {i}")


@pytest.mark.parametrize("task", ["causal_lm", "classification"])
def test_a_transformers_model_is_captured_from_the_loaders_first_batch(task):
    """Each sample's loss is its own tokens' (labels -100 on the padding, which differs between samples); the per-
    sample gradients match each sample run alone without its padding."""
    if task == "causal_lm":
        model, data = gpt2(), Texts()
    else:
        model, data = gpt2(transformers.GPT2ForSequenceClassification, num_labels=3), Texts(classes=3)
    private, _, _ = _private(model, DataLoader(data, batch_size=4), materialise_grad_sample=True)
    report = fxdp.report(private)
    assert report.engine == "fx" and report.front_end == "torch.export", str(report)
    note = next(n for n in report.notes if n.startswith("make_private captured the model"))
    assert "(input_ids (2, 8), attention_mask (2, 8)); left out: labels" in note
    batch = next(iter(DataLoader(data, batch_size=5, shuffle=False)))  # five samples, four lengths of padding
    _assert_per_sample_gradients(model, private, batch, task)


def test_the_capture_leaves_the_loaders_sampling_as_it_was():
    """The batches (which samples, and what their random draws gave) are those the loader would hand out had
    make_private been given example_inputs, and the global generators are where they would be."""
    def batches_after(example_inputs):
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        data = Texts(noisy=True)
        _, _, loader = _private(gpt2(), DataLoader(data, batch_size=4), example_inputs=example_inputs)
        state = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
        return [{k: v.clone() for k, v in b.items()} for epoch in range(2) for b in loader], state

    example = {k: v for k, v in next(iter(DataLoader(Texts(), batch_size=2))).items() if k != "labels"}
    captured, state = batches_after(None)
    given, state_given = batches_after(example)
    assert torch.equal(state[0], state_given[0]) and state[1] == state_given[1] and (state[2] == state_given[2]).all()
    assert len(captured) == len(given) == 6
    assert sum(len(b["input_ids"]) for b in captured) > 0
    for a, b in zip(captured, given):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tuple_batch_gives_its_first_item_as_the_positional_input():
    model = gpt2(transformers.GPT2ForSequenceClassification, num_labels=2)
    ids = torch.randint(2, VOCAB, (6, T), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(ids, torch.arange(6) % 2), batch_size=3)
    private, _, _ = _private(model, loader, materialise_grad_sample=True)
    assert fxdp.report(private).engine == "fx"
    assert any("(2, 8)); the loader's sampling was not touched" in n for n in fxdp.report(private).notes)
    torch.nn.functional.cross_entropy(private(ids[:3]).logits, torch.arange(3) % 2).backward()
    assert model.score.weight.grad_sample.shape == (3, 2, 32)


def test_labels_given_to_the_captured_model_are_refused_and_nothing_moves():
    model = gpt2()
    private, optimizer, loader = _private(model, DataLoader(Texts(), batch_size=4))
    before = [p.detach().clone() for p in model.parameters()]
    batch = next(iter(DataLoader(Texts(), batch_size=3)))
    with pytest.raises(UnsupportedInputError) as info:
        private(**batch)
    message = str(info.value)
    assert "the private model was given 'labels', which make_private left out" in message
    assert "averaged over the whole batch" in message
    assert "fxdp.integrations.transformers.per_sample_loss(outputs.logits, labels, task)" in message
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_gradient_checkpointing_is_refused_with_what_to_do():
    model = gpt2()
    model.gradient_checkpointing_enable()
    with pytest.raises(GradientCheckpointingError) as info:
        _private(model, DataLoader(Texts(), batch_size=4))
    assert "gradient checkpointing is on in GPT2LMHeadModel (layers transformer, transformer.h.0)" in str(info.value)
    assert "Call model.gradient_checkpointing_disable() (or activation_checkpointing_disable()) before making the model private" in str(info.value)
    model.gradient_checkpointing_disable()
    private, _, _ = _private(model, DataLoader(Texts(), batch_size=4))
    assert fxdp.report(private).engine == "fx"


def test_a_model_export_cannot_capture_either_falls_back_and_the_report_says_it_was_tried():
    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else -self.fc(x)  # a branch on the data: no graph holds both

    loader = DataLoader(TensorDataset(torch.randn(6, 4), torch.zeros(6)), batch_size=3)
    private, _, _ = _private(Branches(), loader)
    report = fxdp.report(private)
    assert report.engine == "hooks" and report.front_end is None
    assert "nor captured by torch.export" in report.fallback_reason
    assert any(n.startswith("make_private tried to capture the model (see the reason) from a batch of the data "
                            "loader's first samples ((2, 4))") for n in report.notes)
