"""Compiled models survive torch.save/torch.load, pickle and deepcopy (report and sink included), give
correct per-sample gradients afterwards, and return the model's own output type."""

from __future__ import annotations

import collections
import copy
import dataclasses
import io
import pickle
import typing

import pytest
import torch
from torch import nn

import fxdp
from fxdp.sinks.contract import GradSampleSink, sink_of
from tests.support.per_sample_reference import batch_loss, expected_grad_samples


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


def _double(module, inputs, output):
    return output * 2


def x_of(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _saved_and_loaded(m):
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _saved_and_loaded,
}


def _compiled(kind):
    torch.manual_seed(0)
    model = Net().double()
    if kind == "fx+whole-model":
        model.register_forward_hook(_double)
    if kind == "fx-with-inputs":
        return fxdp.compile_for_dp(model, example_inputs=x_of(5, 4))
    return fxdp.compile_for_dp(model, grad_sample_mode="fx" if kind.startswith("fx") else kind)


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("kind", ["fx", "fx-with-inputs", "fx+whole-model", "hooks", "functorch", "ew"])
def test_a_copy_of_a_compiled_model_is_a_working_compiled_model(kind, how):
    compiled = _compiled(kind)
    report = fxdp.report(compiled)
    duplicate = COPIES[how](compiled)
    assert fxdp.report(duplicate) == report  # the report, findings and engine included
    assert isinstance(sink_of(duplicate), GradSampleSink) and sink_of(duplicate) is not sink_of(compiled)

    # the copy's per-sample gradients are right, on its own parameters, and the original's are untouched
    x = x_of(5, 4)
    params = dict(duplicate.named_parameters())
    plain = Net().double()
    plain.load_state_dict({k.replace("_module.", "").replace("module.", ""): v for k, v in duplicate.state_dict().items()})
    if kind == "fx+whole-model":
        plain.register_forward_hook(_double)
    expected, R = expected_grad_samples(plain, x)
    torch.testing.assert_close(duplicate(x), plain(x))
    batch_loss(duplicate(x), R, "mean").backward()
    for name, p in params.items():
        short = name.replace("_module.", "").replace("module.", "")
        torch.testing.assert_close(p.grad_sample, expected[short], atol=1e-10, rtol=1e-8, msg=lambda m: f"{name}: {m}")
    assert all(getattr(p, "grad_sample", None) is None for p in compiled.parameters())


def test_a_model_compiled_without_inputs_still_analyses_its_first_batch_after_a_copy():
    compiled = _compiled("fx")
    duplicate = pickle.loads(pickle.dumps(compiled))
    duplicate(x_of(5, 4))
    assert "batch_dim: run on the first batch" in fxdp.report(duplicate).notes
    assert "batch_dim: run on the first batch" not in fxdp.report(compiled).notes


def test_a_copy_of_a_hooks_wrapper_does_not_hook_the_original_model():
    torch.manual_seed(0)
    model = Net().double()
    wrapper = fxdp.compile_for_dp(model, grad_sample_mode="hooks")
    duplicate = copy.deepcopy(wrapper)
    duplicate(x_of(5, 4)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert duplicate.module.fc.weight.grad_sample.shape == (5, 3, 4)  # once, not twice
    wrapper(x_of(5, 4)).sum().backward()
    assert model.fc.weight.grad_sample.shape == (5, 3, 4)


# -- the model's own output type ---------------------------------------------------------------------


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class ModelOutputLike(collections.OrderedDict):
    """An OrderedDict subclass, as Hugging Face's ModelOutput."""


class Pair(typing.NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


class Returns(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = self.fc(x)
        if self.kind == "dataclass":
            return Output(logits=y)
        if self.kind == "ordered-dict":
            return ModelOutputLike(logits=y)
        return Pair(y, torch.tanh(y))


@pytest.mark.parametrize("how", [None, *COPIES])
@pytest.mark.parametrize("kind", ["dataclass", "ordered-dict", "namedtuple"])
@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_a_compiled_model_returns_the_models_own_output_type(kind, mode, how):
    torch.manual_seed(0)
    model = Returns(kind).double()
    compiled = fxdp.compile_for_dp(model, grad_sample_mode=mode, loss_reduction="sum")
    if how is not None:
        compiled = COPIES[how](compiled)
        model = compiled.module if mode == "hooks" else compiled
    out = compiled(x_of(5, 4))
    assert type(out) is type(Returns(kind).double()(x_of(1, 4)))
    logits = out["logits"] if kind == "ordered-dict" else out.logits
    logits.sum().backward()
    weight = model.fc.weight
    torch.testing.assert_close(weight.grad_sample, torch.ones(5, 3, 1, dtype=torch.float64) * x_of(5, 4).unsqueeze(1))
