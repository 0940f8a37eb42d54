"""The classic text classifier, ``EmbeddingBag(ids, offsets)``: the flat ids hold every sample's tokens one
after another and the offsets say where each sample's bag starts, so a sample is a bag, not a row of ids.

Per-sample gradients are compared with each bag run alone (its ids, offsets ``[0]``), in the graph engine
(with and without example inputs, batches of other lengths after the first) and the hooks engine; a DP step
through ``make_private`` with an independent computation of the clipped sum.
"""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import fxdp
from fxdp.privacy_engine import PrivacyEngine

VOCAB, DIM, CLASSES = 20, 8, 3


class TextClassifier(nn.Module):
    def __init__(self, mode: str = "mean", padding_idx=None):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode=mode, padding_idx=padding_idx)
        self.fc = nn.Linear(DIM, CLASSES)

    def forward(self, ids, offsets):
        return self.fc(self.bag(ids, offsets))


def _bags(lengths, seed: int, pad_first: bool = True):
    """(ids, offsets) of bags of these lengths; the first token is 0 (the padding index where there is one)."""
    ids = torch.randint(1, VOCAB, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    if pad_first:
        ids[0] = 0
    return ids, torch.tensor([0, *itertools.accumulate(lengths)][:-1])


def _alone(ids, offsets):
    """Each bag's (ids, offsets) as a batch of one."""
    ends = [*offsets.tolist()[1:], ids.shape[0]]
    return [(ids[a:b], torch.tensor([0])) for a, b in zip(offsets.tolist(), ends)]


def _assert_bags_match(model, compiled, ids, offsets, reduction: str) -> None:
    """Each parameter's grad_sample, after one backward over the batch, against each bag run alone (on a copy,
    which no engine hooks); sample i's loss is (out_i * R).sum()."""
    reference = copy.deepcopy(model)
    R = torch.randn(1, CLASSES, generator=torch.Generator().manual_seed(5))
    loss = (compiled(ids, offsets) * R).sum()
    (loss / offsets.shape[0] if reduction == "mean" else loss).backward()
    params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        rows = [torch.autograd.grad((reference(*one) * R).sum(), params[name])[0] for one in _alone(ids, offsets)]
        torch.testing.assert_close(p.grad_sample, torch.stack(rows), msg=name)
    for p in model.parameters():
        p.grad_sample = None


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode, padding_idx", [("mean", None), ("sum", None), ("mean", 0), ("sum", 0)])
@pytest.mark.parametrize("engine", ["fx", "fx-without-example-inputs", "hooks"])
def test_per_sample_gradients_equal_each_bag_alone(engine, mode, padding_idx, reduction):
    torch.manual_seed(0)
    model = TextClassifier(mode, padding_idx)
    ids, offsets = _bags([3, 1, 4, 2], seed=0)  # 10 ids, 4 samples
    example = (ids, offsets) if engine == "fx" else None
    compiled = fxdp.compile_for_dp(model, example, loss_reduction=reduction,
                                   grad_sample_mode="hooks" if engine == "hooks" else "fx")
    for lengths, seed in (([3, 1, 4, 2], 0), ([2, 5, 1], 1), ([6], 2), ([1, 1, 1], 3)):
        _assert_bags_match(model, compiled, *_bags(lengths, seed), reduction)
    rep = fxdp.report(compiled)
    if engine == "hooks":
        assert compiled.verification.startswith("verified on a batch of 4: "), compiled.verification
    else:
        assert rep.engine == "fx", str(rep)
        (site,) = [f for f in rep.pass_report("per_sample").changes if f.node == "bag"]
        assert "by the EmbeddingBag rule; input packed@0, batch@0, output batch@0" in site.message


def _collate(items):
    ids = [tokens for tokens, _ in items]
    offsets = torch.tensor([0, *itertools.accumulate(len(t) for t in ids)][:-1], dtype=torch.long)
    labels = torch.tensor([label for _, label in items], dtype=torch.long)
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long), offsets, labels


def _corpus(n: int = 12):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g), i % CLASSES)
            for i in range(n)]


def _clipped_sum(model, ids, offsets, labels, bound: float):
    """sum_i min(1, C / ||g_i||) g_i over the bags, each run alone (as the DP optimizer's clip factor has it)."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for (one_ids, one_offsets), label in zip(_alone(ids, offsets), labels):
        loss = F.cross_entropy(model(one_ids, one_offsets), label.view(1), reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        factor = min(1.0, bound / (norm.item() + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("mode, padding_idx", [("mean", None), ("sum", 0)])
@pytest.mark.parametrize("engine, materialise", [("fx", False), ("fx", True), ("hooks", False)],
                         ids=["fx-bookkeeping", "fx-materialised", "hooks"])
def test_make_private_steps_with_each_bag_clipped_alone(engine, materialise, mode, padding_idx):
    torch.manual_seed(0)
    model = TextClassifier(mode, padding_idx)
    reference = copy.deepcopy(model)
    loader = DataLoader(_corpus(), batch_size=5, collate_fn=_collate)
    dp_model, optimizer, dp_loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=0.3, grad_sample_mode=engine, poisson_sampling=False,
        loss_reduction="sum", materialise_grad_sample=materialise)
    assert fxdp.report(dp_model).engine == engine
    for ids, offsets, labels in dp_loader:
        before = [p.detach().clone() for p in reference.parameters()]
        expected = _clipped_sum(reference, ids, offsets, labels, bound=0.3)
        optimizer.zero_grad()
        F.cross_entropy(dp_model(ids, offsets), labels, reduction="sum").backward()
        if materialise:
            assert model.bag.weight.grad_sample.shape == (offsets.shape[0], VOCAB, DIM)
        optimizer.step()
        with torch.no_grad():
            for p, b, g in zip(reference.parameters(), before, expected):
                p.copy_(b - g)
        for name, (p, q) in zip(dict(model.named_parameters()), zip(model.parameters(), reference.parameters())):
            torch.testing.assert_close(p, q, msg=name)


def test_make_private_with_poisson_sampling_trains_on_bags_and_counts_every_step():
    torch.manual_seed(0)
    model = TextClassifier()
    engine = PrivacyEngine()
    dp_model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_corpus(), batch_size=4, collate_fn=_collate), noise_multiplier=1.0, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    steps = 0
    for ids, offsets, labels in loader:
        optimizer.zero_grad()
        F.cross_entropy(dp_model(ids, offsets), labels).backward()
        optimizer.step()
        steps += 1
    assert steps == len(loader) and len(engine.accountant) == steps
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


class ReadsTheFlatIdsElsewhere(TextClassifier):
    """The mean of every sample's ids added to each sample's features: samples mixed through the flat ids."""

    def forward(self, ids, offsets):
        return self.fc(self.bag(ids, offsets) + ids.float().mean())


class ReordersTheFlatIds(TextClassifier):
    """Flipped ids with the same offsets: a bag then holds another sample's tokens."""

    def forward(self, ids, offsets):
        return self.fc(self.bag(ids.flip(0), offsets))


# what each engine says: the graph reads flipped ids given to the layer as a batch of 10 whose order the flip
# reverses; the hooks engine's test of the model on its first batch fails (the graph engine hands a model whose
# packed ids reach an op it cannot serve to the hooks engine, as the whole-model engine cannot split them)
REFUSED = {
    ("fx", ReadsTheFlatIdsElsewhere): (fxdp.errors.BatchMixingError, "mixes samples, so it cannot be trained"),
    ("fx", ReordersTheFlatIds): (fxdp.errors.BatchMixingError, "The model mixes samples across the batch dimension"),
    ("fx-without-example-inputs", ReadsTheFlatIdsElsewhere): (fxdp.errors.NotPrivateError, "fxdp cannot follow the batch"),
    ("fx-without-example-inputs", ReordersTheFlatIds): (fxdp.errors.BatchMixingError, "The model mixes samples"),
    ("hooks", ReadsTheFlatIdsElsewhere): (fxdp.errors.BatchMixingError, "mixes samples, so it cannot be trained"),
    ("hooks", ReordersTheFlatIds): (fxdp.errors.BatchMixingError, "mixes samples, so it cannot be trained"),
}


@pytest.mark.parametrize("model_class", [ReadsTheFlatIdsElsewhere, ReordersTheFlatIds])
@pytest.mark.parametrize("engine", ["fx", "fx-without-example-inputs", "hooks"])
def test_flat_ids_read_by_another_op_are_refused(model_class, engine):
    torch.manual_seed(0)
    model = model_class()
    before = [p.detach().clone() for p in model.parameters()]
    ids, offsets = _bags([3, 1, 4, 2], seed=0)
    error, match = REFUSED[engine, model_class]
    with pytest.raises(error, match=re.escape(match)):
        compiled = fxdp.compile_for_dp(model, example_inputs=(ids, offsets) if engine == "fx" else None,
                                       grad_sample_mode="hooks" if engine == "hooks" else "fx")
        if (engine, model_class) == ("fx", ReadsTheFlatIdsElsewhere):
            rep = fxdp.report(compiled)
            assert rep.engine == "hooks" and rep.fallback_reason.startswith(
                "input(s) 'ids' hold the samples' entries one after another"), str(rep)
            assert any(f.node == "float_1" and "receives the samples' entries packed one after another" in f.message
                       for f in rep.findings), str(rep)
        compiled(ids, offsets).sum().backward()
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(model.parameters(), before))
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_the_hooks_engine_refuses_a_bag_layer_given_other_flat_indices_than_the_models():
    """Without its test of the model, the hooks engine still checks each call of a bag layer fed flat indices."""
    torch.manual_seed(0)
    model = ReordersTheFlatIds()
    wrapped = fxdp.GradSampleModule(model, verify=False)
    with pytest.raises(fxdp.errors.NotPrivateError, match=re.escape("layer 'bag' (EmbeddingBag) takes flat indices")):
        wrapped(*_bags([3, 1, 4, 2], seed=0))
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


class LastOffsetIncluded(TextClassifier):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, DIM, include_last_offset=True)


@pytest.mark.parametrize("engine", ["fx", "hooks"])
def test_include_last_offset_runs_on_the_hooks_engine(engine):
    """N + 1 offsets, the last one ending the last bag: no input has a row per sample for the graph to read, so
    the graph engine hands the model to the hooks engine, which counts the bags."""
    torch.manual_seed(0)
    model = LastOffsetIncluded()
    ids, starts = _bags([3, 1, 4, 2], seed=0)
    offsets = torch.cat([starts, torch.tensor([ids.shape[0]])])
    compiled = fxdp.compile_for_dp(model, example_inputs=(ids, offsets), loss_reduction="sum", grad_sample_mode=engine)
    assert fxdp.report(compiled).engine == "hooks"
    reference = copy.deepcopy(model)
    compiled(ids, offsets).sum().backward()
    params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        rows = [torch.autograd.grad(reference(one_ids, torch.tensor([0, one_ids.shape[0]])).sum(), params[name])[0]
                for one_ids, _ in _alone(ids, starts)]
        torch.testing.assert_close(p.grad_sample, torch.stack(rows), msg=name)
    assert compiled.verification.startswith("verified on a batch of 4: "), compiled.verification
