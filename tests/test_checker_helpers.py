"""Opacus's checking utilities in fxdp.checker: the batch-of-one reference and an engine's grad_sample as two
dicts, the engine alone (empty batches too), and the small helpers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdp.grad_sample  # noqa: F401  (registers the built-in rules)
from fxdp.checker import (
    are_state_dict_equal,
    check_per_sample_gradients_are_correct,
    clone_module,
    compute_engine_grad_sample,
    compute_grad_samples_microbatch_and_engine,
    get_grad_sample_modes,
    is_batch_empty,
)
from fxdp.diagnostics.errors import EmptyBatchError
from fxdp.grad_sample.registry import register_grad_sampler


def _linear_reference(layer: nn.Linear, x: torch.Tensor, loss_reduction: str):
    """Independent of both: d<W x_i + b, R>/dW = R x_i^T, with R the checker's fixed projection (seed 0)."""
    r = torch.randn(layer.out_features, generator=torch.Generator().manual_seed(0))
    return {"weight": torch.einsum("o,ni->noi", r, x), "bias": r.expand(x.shape[0], -1)}


@pytest.mark.parametrize("mode", get_grad_sample_modes(use_ew=True))
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_both_dicts_equal_an_independent_formula(mode, reduction):
    torch.manual_seed(0)
    layer, x = nn.Linear(5, 3), torch.randn(4, 5)
    one_by_one, engine = compute_grad_samples_microbatch_and_engine(x, layer, loss_reduction=reduction,
                                                                    grad_sample_mode=mode)
    expected = _linear_reference(layer, x, reduction)
    assert one_by_one.keys() == engine.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(one_by_one[name], expected[name])
        torch.testing.assert_close(engine[name], expected[name])
    assert layer.weight.grad is None  # copies were run


def test_batch_second_and_a_custom_chunking():
    torch.manual_seed(0)
    layer, x = nn.Linear(5, 3), torch.randn(6, 4, 5)  # (T, N, d)
    one_by_one, engine = compute_grad_samples_microbatch_and_engine(x, layer, batch_first=False,
                                                                    grad_sample_mode="hooks")
    assert engine["weight"].shape == (4, 3, 5)
    torch.testing.assert_close(engine["weight"], one_by_one["weight"])

    bag = nn.EmbeddingBag(10, 3, mode="sum")
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 3])
    bounds = [0, 2, 3, 6]

    def bags(x):
        ids, _ = x
        for a, b in zip(bounds, bounds[1:]):
            yield ids[a:b], torch.tensor([0])

    one_by_one, engine = compute_grad_samples_microbatch_and_engine((ids, offsets), bag, grad_sample_mode="hooks",
                                                                    chunk_method=bags)
    assert engine["weight"].shape == (3, 10, 3)
    torch.testing.assert_close(engine["weight"], one_by_one["weight"])
    assert one_by_one["weight"][0, 3].abs().sum() == 0 and one_by_one["weight"][1, 3].abs().sum() > 0


def test_a_wrong_rule_makes_the_two_dicts_differ():
    class Gain(nn.Module):
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.g

    # a class of this test only: its rule (twice the right value) reaches no other test
    register_grad_sampler(Gain)(lambda m, a, b: {m.g: 2 * (a[0] * b)})
    one_by_one, engine = compute_grad_samples_microbatch_and_engine(torch.randn(4, 3), Gain(),
                                                                    grad_sample_mode="hooks")
    torch.testing.assert_close(engine["g"], 2 * one_by_one["g"])


def test_empty_batches():
    layer = nn.Linear(5, 3)
    with pytest.raises(RuntimeError, match="empty"):
        compute_grad_samples_microbatch_and_engine(torch.randn(0, 5), layer)
    with pytest.raises(EmptyBatchError):  # a RuntimeError too, as Opacus's checker raises
        check_per_sample_gradients_are_correct(torch.randn(0, 5), layer)
    with pytest.raises(RuntimeError):  # empty in another dimension: no gradient to compare either
        check_per_sample_gradients_are_correct(torch.randn(3, 0, 5), layer)
    grad_samples = compute_engine_grad_sample(torch.randn(0, 5), layer, grad_sample_mode="hooks")
    assert grad_samples["weight"].shape == (0, 3, 5)


def test_small_helpers():
    assert get_grad_sample_modes() == ["fx", "hooks", "functorch"]
    assert get_grad_sample_modes(use_ew=True)[-1] == "ew"
    assert is_batch_empty(torch.zeros(0, 3)) and not is_batch_empty(torch.zeros(2, 3))
    assert is_batch_empty((torch.zeros(0), torch.zeros(2))) and not is_batch_empty((torch.zeros(2),))

    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    copy = clone_module(model)
    assert copy is not model and are_state_dict_equal(model.state_dict(), copy.state_dict())
    with torch.no_grad():
        copy[0].weight += 1
    assert not are_state_dict_equal(model.state_dict(), copy.state_dict())
    assert model[0].weight.data_ptr() != copy[0].weight.data_ptr()
    assert not are_state_dict_equal({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    assert not are_state_dict_equal({"a": torch.zeros(2)}, {"a": torch.zeros(1)})  # no broadcasting
