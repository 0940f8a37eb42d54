"""The functorch engine (fxdp/engines/functorch.py) never reads a keyword input with the batch's number of rows as
shared by all samples: it refuses it, naming it; given positionally, the input is batched and per-sample gradients
are each sample's alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdp
from fxdp.diagnostics import UnsupportedInputError
from fxdp.engines.selfcheck import batch_of_one_gradients


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.image_tower = nn.Linear(3, 4)
        self.text_tower = nn.Linear(5, 4)

    def forward(self, image, text=None, scale=None):
        out = (self.image_tower(image) * self.text_tower(text)).sum(1)
        return out if scale is None else out * scale.sum()


def _pairs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=gen, dtype=torch.float64), torch.randn(4, 5, generator=gen, dtype=torch.float64)


def test_a_keyword_input_with_the_batchs_rows_is_refused_naming_it():
    image, text = _pairs()
    compiled = fxdp.compile_for_dp(Pair().double(), grad_sample_mode="functorch")
    with pytest.raises(UnsupportedInputError, match=r"text= \(4, 5\) has the batch's 4 rows at dimension 0.*"
                                                    r"Pass it positionally if it holds one row per sample"):
        compiled(image, text=text)


def test_positional_inputs_are_batched_and_a_keyword_of_another_size_is_shared():
    image, text = _pairs()
    scale = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)  # 3 entries, not 4: no row per sample
    model = Pair().double()
    reference = copy.deepcopy(model)
    expected = batch_of_one_gradients(
        lambda i: reference(image[i:i + 1], text[i:i + 1], scale=scale).sum(), list(reference.named_parameters()), 4)
    compiled = fxdp.compile_for_dp(model, grad_sample_mode="functorch", loss_reduction="sum")
    compiled(image, text, scale=scale).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], msg=lambda m: f"{name}: {m}")
