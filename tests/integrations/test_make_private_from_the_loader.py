"""make_private on a Hugging Face model without example_inputs, as Opacus users call it: the model is captured
with torch.export from a batch of the dataset's first samples, made by the loader's collate function, without
touching the loader's sampling; keyword inputs (dict batches) and positional ones (``(x, y)`` batches) alike.

Per-sample gradients are checked in float64 against each sample run alone, unpadded."""

from __future__ import annotations

import copy
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


def _assert_per_sample_gradients(model, private, batch, task, labels_to_the_model=False):
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if labels_to_the_model:  # as a transformers user calls it: the loss comes first in the output
        private(**batch)[0].backward()
    else:
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
    assert any("(2, 8)); labels= given to the private model give each sample's own classification loss, computed "
               "outside the graph: fxdp.per_sample_loss; the loader's sampling was not touched" in n
               for n in fxdp.report(private).notes)
    torch.nn.functional.cross_entropy(private(ids[:3]).logits, torch.arange(3) % 2).backward()
    assert model.score.weight.grad_sample.shape == (3, 2, 32)


@pytest.mark.parametrize("task", ["causal_lm", "classification"])
def test_labels_given_to_the_private_model_give_each_samples_own_loss(task):
    """``private(**batch)`` with the labels, as a transformers user calls the model: the output has the loss first, and
    it is the mean of each sample's own loss (for classification, the model's own loss); its per-sample gradients
    match each sample run alone."""
    if task == "causal_lm":
        model, data = gpt2(), Texts()
    else:
        model, data = gpt2(transformers.GPT2ForSequenceClassification, num_labels=3), Texts(classes=3)
    private, _, _ = _private(model, DataLoader(data, batch_size=4), materialise_grad_sample=True)
    assert any(f"left out: labels (given to the private model, they give each sample's own {task} loss" in n
               for n in fxdp.report(private).notes)
    batch = next(iter(DataLoader(data, batch_size=5, shuffle=False)))
    out = private(**batch)
    assert list(out.keys()) == ["loss", "logits"] and out[0] is out.loss
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    torch.testing.assert_close(out.loss, per_sample_loss(model(**inputs).logits, batch["labels"], task).mean())
    if task == "classification":
        torch.testing.assert_close(out.loss, model(**batch).loss)
    model.zero_grad()
    _assert_per_sample_gradients(model, private, batch, task, labels_to_the_model=True)


def test_a_model_captured_from_a_tuple_batch_called_with_its_items_as_keywords_is_captured_again_for_them():
    """Opacus's text-classifier tutorial: the loader yields (input_ids, attention_mask, labels) tuples and the loop
    calls the model with them as keywords. make_private captured the model from the tuple's first item; the first
    call with the keywords captures it again for them (labels left out: their loss is computed outside the graph),
    and the per-sample gradients match each sample run alone, without its padding."""
    model = gpt2(transformers.GPT2ForSequenceClassification, num_labels=3)
    items = [Texts(classes=3)[i] for i in range(12)]
    data = TensorDataset(*(torch.stack([item[k] for item in items]) for k in ("input_ids", "attention_mask", "labels")))
    private, _, _ = _private(model, DataLoader(data, batch_size=4), materialise_grad_sample=True)
    ids, mask, labels = next(iter(DataLoader(data, batch_size=5)))
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    _assert_per_sample_gradients(model, private, batch, "classification", labels_to_the_model=True)
    note = next(n for n in fxdp.report(private).notes if n.startswith("torch.export: captured once per input shape"))
    assert "2 graphs, kept: input_ids (N, 8); input_ids (N, 8), attention_mask (N, 8)" in note, note
    loader_note = next(n for n in fxdp.report(private).notes if n.startswith("make_private captured the model"))
    assert ("from a batch of the data loader's first samples ((2, 8)); labels= given to the private model give each "
            "sample's own classification loss, computed outside the graph") in loader_note, loader_note


def test_labels_of_a_model_whose_loss_fxdp_does_not_know_are_refused_and_nothing_moves():
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, 3)

        def forward(self, input_ids, labels=None):
            logits = self.head(self.emb(input_ids))
            if labels is None:
                return logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    model = Tagger()
    ids = torch.randint(2, VOCAB, (6, T), generator=torch.Generator().manual_seed(1))
    loader = DataLoader([{"input_ids": i, "labels": i % 3} for i in ids], batch_size=3)
    private, _, _ = _private(model, loader, example_inputs={"input_ids": ids[:2]})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedInputError) as info:
        private(input_ids=ids[:3], labels=ids[:3] % 3)
    message = str(info.value)
    assert "the private model was given 'labels'" in message and "averaged over the whole batch" in message
    assert "fxdp cannot tell which loss this model computes" in message
    assert "fxdp.per_sample_loss.per_sample_loss(outputs.logits, labels, task) does" in message
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


def _of_length(data, indices, length):
    """A batch of the given samples, padded to ``length`` (a collator padding to the longest sample)."""
    batch = next(iter(DataLoader(torch.utils.data.Subset(data, indices), batch_size=len(indices))))
    assert int(batch["attention_mask"].sum(1).max()) <= length
    return {k: v[:, :length] for k, v in batch.items()}


def test_batches_of_another_length_in_successive_steps_are_captured_again_and_stay_exact():
    """The graph holds the captured length (8): a batch of length 5 is captured again, and 8 again puts the first
    graph back; each batch's per-sample gradients match its samples run alone."""
    model, data = gpt2(), Texts()
    private, _, _ = _private(model, DataLoader(data, batch_size=4), materialise_grad_sample=True)
    first = type(private)
    for indices, length in (([0, 1, 2], 8), ([3, 7, 11], 5), ([2, 3, 6, 7], 6), ([4, 5], 8)):
        _assert_per_sample_gradients(model, private, _of_length(data, indices, length), "causal_lm")
        for p in model.parameters():
            p.grad_sample = None
        model.zero_grad()
    assert type(private) is first
    note = fxdp.report(private).notes[-1]
    assert note == ("torch.export: captured once per input shape seen (3 graphs, kept: input_ids (N, 8), "
                    "attention_mask (N, 8); input_ids (N, 5), attention_mask (N, 5); input_ids (N, 6), "
                    "attention_mask (N, 6))")


def test_two_lengths_of_one_batch_in_one_step_add_up_per_sample_across_the_graphs():
    """One batch run at two lengths (padded to 8, and to its longest sample, 6: two graphs) before one backward:
    within a step row i is sample i in every forward call, so its gradient is the sum of both uses, 2 g_i, which
    the book-kept step clips per sample (noise 0); g_i computed with the sample alone, unpadded."""
    model, data = gpt2(), Texts()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    private, dp_optimizer, _ = fxdp.PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=4), noise_multiplier=0.0,
        max_grad_norm=0.05, loss_reduction="sum", poisson_sampling=False)  # batches of our own
    views = [_of_length(data, [2, 3, 6], 8), _of_length(data, [2, 3, 6], 6)]
    losses = [per_sample_loss(private(**{k: v for k, v in x.items() if k != "labels"}).logits, x["labels"],
                              "causal_lm").sum() for x in views]
    assert "(2 graphs" in fxdp.report(private).notes[-1]
    dp_optimizer.zero_grad()
    (losses[0] + losses[1]).backward()
    dp_optimizer.step()
    params = list(reference.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(3):
        one = _unpadded(views[0], i)
        label = one.pop("labels")
        grads = torch.autograd.grad(2 * per_sample_loss(reference(**one).logits, label, "causal_lm").sum(), params)
        factor = min(1.0, 0.05 / (torch.sqrt(sum((g ** 2).sum() for g in grads)).item() + 1e-6))
        total = [t + g * factor for t, g in zip(total, grads)]
    for (name, p), q, s in zip(model.named_parameters(), params, total):
        torch.testing.assert_close(p, q - 0.5 * s, atol=1e-10, rtol=1e-8, msg=name)
