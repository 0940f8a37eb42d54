"""Which inputs carry the batch is never guessed (fxdp/passes/batch_inputs.py): an input with the batch's number
of rows is never read as shared by all samples unless the user names the batched inputs (``batch_inputs=``), or
the data loader's batch does.

The model: two towers, CLIP-style, an image and a text embedding per sample, and optionally the similarity of
every image with every caption (``u @ v.T``, which mixes samples). Read with the text shared by all samples, that
model holds together; it used to be compiled so, and the text tower's per-sample gradients were wrong."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fxdp
from fxdp.diagnostics import BatchDimAnalysisError, BatchMixingError
from fxdp.engines.selfcheck import batch_of_one_gradients

N, IMAGE, TEXT, D = 4, 3, 5, 6


class Towers(nn.Module):
    def __init__(self, similarity: bool):
        super().__init__()
        self.image_tower = nn.Linear(IMAGE, D)
        self.text_tower = nn.Sequential(nn.Linear(TEXT, D), nn.Tanh(), nn.Linear(D, D))
        self.similarity = similarity

    def forward(self, image, text):
        u, v = self.image_tower(image), self.text_tower(text)
        if self.similarity:
            return u @ v.T, u, v  # every image against every caption
        return u, v


class CapturedTowers(Towers):
    """The same model as torch.fx cannot trace it (it branches on a size), as make_private captures it with
    torch.export from the loader's batch."""

    def forward(self, image, text):
        if image.shape[0] > 0:
            return super().forward(image, text)
        return image, text


SIMILARITY_LINE = inspect.getsourcelines(Towers.forward)[1] + 3


def own_pair_loss(u, v):
    """Each sample's loss reads only its own pair: agreement and distance of its image and text embeddings."""
    return -(u * v).sum(1) + ((u - v) ** 2).mean(1)


def pairs(n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, IMAGE, generator=gen, dtype=torch.float64),
            torch.randn(n, TEXT, generator=gen, dtype=torch.float64))


def alone(model, image, text):
    """{name: (N, *shape)}: the gradient of each sample's loss with that sample run alone (the definition)."""
    named = [(k, p) for k, p in model.named_parameters()]
    return batch_of_one_gradients(lambda i: own_pair_loss(*model(image[i:i + 1], text[i:i + 1])[-2:]).sum(),
                                  named, image.shape[0])


def assert_both_towers_right(model, expected):
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], msg=lambda m: f"{name}: {m}")
    assert {n.split(".")[0] for n in expected} == {"image_tower", "text_tower"}


# -- compile_for_dp ---------------------------------------------------------------------------------


@pytest.mark.parametrize("with_example", [True, False], ids=["example_inputs", "first_batch"])
@pytest.mark.parametrize("named", [None, ("image", "text")], ids=["found", "batch_inputs"])
def test_both_towers_are_batched_and_their_per_sample_gradients_are_each_sample_alone(named, with_example):
    model = Towers(similarity=False).double()
    image, text = pairs()
    expected = alone(copy.deepcopy(model), image, text)
    compiled = fxdp.compile_for_dp(model, (image, text) if with_example else None, loss_reduction="sum",
                                   batch_inputs=named)
    own_pair_loss(*compiled(image, text)).sum().backward()
    assert_both_towers_right(model, expected)


@pytest.mark.parametrize("with_example", [True, False], ids=["example_inputs", "first_batch"])
def test_the_similarity_model_is_refused_until_the_batched_inputs_are_named(with_example):
    image, text = pairs()
    compiled = None if with_example else fxdp.compile_for_dp(Towers(similarity=True).double())
    with pytest.raises(BatchDimAnalysisError) as refused:
        fxdp.compile_for_dp(Towers(similarity=True).double(), (image, text)) if with_example else compiled(image, text)
    message = str(refused.value)
    assert "'image' (4, 3), 'text' (4, 5) both have 4 rows at dimension 0" in message
    assert f"operator.matmul at tests/passes/test_batch_inputs_never_guessed.py:{SIMILARITY_LINE} " \
           "(return u @ v.T, u, v  # every image against every caption) mixes samples" in message
    assert "only with 'text' read as shared by all samples" in message
    assert "batch_inputs=('image', 'text')" in message and "batch_inputs=('image',) if 'text' really is" in message
    # named, the model is refused for what it does, at the line that does it
    with pytest.raises(BatchMixingError) as mixing:
        compiled = fxdp.compile_for_dp(Towers(similarity=True).double(), (image, text) if with_example else None,
                                       batch_inputs=("image", "text"))
        compiled(image, text)
    [finding] = mixing.value.findings
    assert finding.op == "operator.matmul" and finding.location.line == SIMILARITY_LINE
    assert "combines every sample with every other" in finding.message


def test_a_batch_of_one_is_read_by_the_same_rule():
    """Analysed on one sample, the text is not read as shared either (the engine chosen then would keep that
    reading for later batches); the model without the similarity then trains right on batches of several."""
    with pytest.raises(BatchDimAnalysisError, match=r"'image' \(1, 3\), 'text' \(1, 5\) both have 1 row at"):
        fxdp.compile_for_dp(Towers(similarity=True).double(), pairs(n=1))
    model = Towers(similarity=False).double()
    compiled = fxdp.compile_for_dp(model, pairs(n=1), loss_reduction="sum")
    image, text = pairs()
    expected = alone(copy.deepcopy(model), image, text)
    own_pair_loss(*compiled(image, text)).sum().backward()
    assert_both_towers_right(model, expected)


def test_an_input_named_shared_is_read_as_shared():
    """The user's word: with the text named shared (zero-shot classes, say), the model compiles and only the image
    tower sees per-sample data."""
    model = Towers(similarity=True).double()
    image, text = pairs()
    compiled = fxdp.compile_for_dp(model, (image, text), batch_inputs=("image",), loss_reduction="sum")
    compiled(image, text)[0].sum().backward()
    assert model.image_tower.weight.grad_sample.shape == (N, D, IMAGE)


# -- a (T, T) mask with T == N ------------------------------------------------------------------------


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, x, mask):
        h = self.proj(x)
        scores = (h @ h.transpose(1, 2)).masked_fill(mask, -1e9).softmax(-1)
        return self.head(scores @ h)


def masked_inputs(n, t):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, t, D, generator=gen, dtype=torch.float64), torch.ones(t, t, dtype=torch.bool).triu(1)


def test_a_mask_whose_size_differs_from_the_batch_is_shared():
    x, mask = masked_inputs(4, 5)
    assert fxdp.find_batch_dim_violations(Masked().double(), (x, mask)) == []


def test_a_mask_with_the_batchs_number_of_rows_is_refused_until_named_then_trains_right():
    x, mask = masked_inputs(4, 4)
    with pytest.raises(BatchDimAnalysisError, match=r"'x' \(4, 4, 6\), 'mask' \(4, 4\) both have 4 rows.*"
                                                    r"batch_inputs=\('x',\) if 'mask' really is the same for every "
                                                    r"sample \(or analyse with a batch whose size differs"):
        fxdp.compile_for_dp(Masked().double(), (x, mask))
    model = Masked().double()
    gen = torch.Generator().manual_seed(2)
    R = torch.randn(1, 4, 2, generator=gen, dtype=torch.float64)
    named = [(k, p) for k, p in model.named_parameters()]
    expected = batch_of_one_gradients(lambda i: (model(x[i:i + 1], mask) * R).sum(), named, 4)
    compiled = fxdp.compile_for_dp(model, (x, mask), batch_inputs=("x",), loss_reduction="sum")
    (compiled(x, mask) * R).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], msg=lambda m: f"{name}: {m}")


# -- make_private, as users call it -------------------------------------------------------------------


def private(model, loader, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return fxdp.PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                             noise_multiplier=0.0, max_grad_norm=0.5, poisson_sampling=False,
                                             **kwargs)


def clipped_mean(expected, name, bound=0.5):
    """The private step's gradient without noise: each sample's gradient clipped (over all parameters), mean."""
    norms = sum(v.flatten(1).pow(2).sum(1) for v in expected.values()).sqrt()
    factors = (bound / (norms + 1e-6)).clamp(max=1.0)
    return (expected[name] * factors.view(-1, *[1] * (expected[name].dim() - 1))).sum(0) / N


@pytest.mark.parametrize("captured", [False, True], ids=["traced", "captured_from_the_loader"])
def test_make_private_with_a_loader_of_pairs_takes_a_private_step_right_for_both_towers(captured):
    model = (CapturedTowers if captured else Towers)(similarity=False).double()
    image, text = pairs()
    expected = alone(copy.deepcopy(model), image, text)
    loader = DataLoader(TensorDataset(image, text), batch_size=N) if not captured else \
        DataLoader(Pairs(image, text), batch_size=N)
    compiled, optimizer, loader = private(model, loader)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    for batch in loader:
        optimizer.zero_grad()
        out = compiled(*batch) if not captured else compiled(**batch)
        own_pair_loss(*out).mean().backward()
        optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), clipped_mean(expected, name),
                                   msg=lambda m: f"{name}: {m}")


class Pairs(Dataset):
    """(image, text) pairs as a dict per sample, as a Hugging Face-style collate hands them out."""

    def __init__(self, image, text):
        self.image, self.text = image, text

    def __len__(self):
        return self.image.shape[0]

    def __getitem__(self, i):
        return {"image": self.image[i], "text": self.text[i]}


def test_make_private_refuses_the_similarity_model_and_names_the_fix():
    image, text = pairs()
    compiled, _, loader = private(Towers(similarity=True).double(), DataLoader(TensorDataset(image, text),
                                                                                batch_size=N))
    with pytest.raises(BatchDimAnalysisError, match=r"both have 4 rows.*make_private\(\.\.\., batch_inputs="):
        for batch in loader:
            compiled(*batch)
    compiled, _, loader = private(Towers(similarity=True).double(), DataLoader(TensorDataset(image, text),
                                                                                batch_size=N),
                                  batch_inputs=("image", "text"))
    with pytest.raises(BatchMixingError) as mixing:
        for batch in loader:
            compiled(*batch)
    assert [f.location.line for f in mixing.value.findings] == [SIMILARITY_LINE]


def test_the_loaders_batch_names_the_batched_inputs_of_a_captured_model():
    """Captured from the loader's batch, both inputs came from its collate (one row per sample): the similarity is
    refused for mixing samples, at make_private, with no question asked."""
    image, text = pairs()
    with pytest.raises(BatchMixingError) as mixing:
        private(CapturedTowers(similarity=True).double(), DataLoader(Pairs(image, text), batch_size=N))
    assert any(f.kind.name == "MIXES_SAMPLES" for f in mixing.value.findings)
