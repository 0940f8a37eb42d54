"""``torch.compile`` of the private model ``make_private`` returns (graph engine): the same steps as eager, and the
checks that must still run on every call (the structure watch and the batch guard run eagerly under torch.compile:
:func:`fxdp.runtime.guards.run_eagerly`). Graph breaks and per-sample gradients against batches of one:
test_torch_compile_graph.py.

The tests compile with ``backend="aot_eager"``: dynamo and AOTAutograd as torch.compile runs them, without
inductor's C++ compilation (minutes on this machine's 2 cores); one test runs inductor on a small MLP.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fxdp
from fxdp.privacy_engine import PrivacyEngine
from tests.support.private_steps import parameters_after_steps

torch._dynamo = pytest.importorskip("torch._dynamo")

# the one-head attention model benchmarks/compile_speed.py times
_spec = importlib.util.spec_from_file_location("fxdp_bench_models", Path(__file__).parents[2] / "benchmarks" / "models.py")
bench_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_models)


def _mlp():
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 3), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 3))


MODELS = {
    "mlp": (_mlp, lambda n: torch.randn(n, 10)),
    "cnn": (_cnn, lambda n: torch.randn(n, 1, 8, 8)),
    "attention": (bench_models.OneHeadAttention, lambda n: torch.randint(0, 20, (n, 6))),
}


def _train(make, make_x, noise, compiled, backend="aot_eager", steps=2):
    """Parameters after each of ``steps`` private steps (make_private, Poisson sampling, seeded noise)."""
    torch.manual_seed(0)
    model = make()
    data = TensorDataset(make_x(48), torch.randint(0, 3, (48,)))
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=noise, max_grad_norm=0.5, example_inputs=(make_x(8),),
        noise_generator=torch.Generator().manual_seed(1))
    run = torch.compile(private, backend=backend) if compiled else private
    return parameters_after_steps(run, optimizer, loader, model, steps), engine.accountant.history


@pytest.mark.parametrize("name, noise", [("mlp", 0.0), ("mlp", 1.0), ("cnn", 1.0), ("attention", 1.0)])
def test_compiled_private_model_takes_the_same_steps_as_eager(name, noise):
    make, make_x = MODELS[name]
    eager, eager_history = _train(make, make_x, noise, compiled=False)
    compiled, compiled_history = _train(make, make_x, noise, compiled=True)
    assert len(eager) == len(compiled) == 2
    for step, (want, got) in enumerate(zip(eager, compiled)):
        for p_want, p_got in zip(want, got):
            torch.testing.assert_close(p_got, p_want, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
    assert compiled_history == eager_history
    moved = [float((a - b).abs().max()) for a, b in zip(eager[0], eager[-1])]
    assert max(moved) > 1e-3  # the steps did something


def test_inductor_takes_the_same_steps_as_eager():
    make, make_x = MODELS["mlp"]
    eager, _ = _train(make, make_x, 1.0, compiled=False, steps=2)
    compiled, _ = _train(make, make_x, 1.0, compiled=True, backend="inductor", steps=2)
    for want, got in zip(eager, compiled):
        for p_want, p_got in zip(want, got):
            # inductor may fuse and reorder float32 arithmetic: a few units in the last place
            torch.testing.assert_close(p_got, p_want, atol=1e-5, rtol=1e-4)


class Merged(nn.Module):
    """A Linear on ``(N * T, d)``: its layout (the batch merged with T) is analysed per sequence length."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        n, t, d = x.shape
        return self.head(torch.tanh(self.fc(x.reshape(n * t, d))).reshape(n, t, d).sum(1))


def _alone(model, x, param):
    return torch.stack([torch.autograd.grad(model(x[i:i + 1]).sum(), param)[0] for i in range(x.shape[0])])


def test_new_shapes_under_torch_compile_are_analysed_before_their_backward():
    model = Merged()
    compiled = torch.compile(fxdp.compile_for_dp(model, (torch.randn(4, 3, 8),), loss_reduction="sum"),
                             backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's recompile-limit warning
        for shape in [(4, 3, 8), (4, 5, 8), (6, 2, 8), (5, 9, 8), (3, 4, 8), (2, 7, 8), (7, 1, 8), (4, 6, 8),
                      (3, 3, 8), (5, 5, 8)]:
            x = torch.randn(*shape)
            for p in model.parameters():
                p.grad_sample = None
            compiled(x).sum().backward()
            torch.testing.assert_close(model.fc.weight.grad_sample, _alone(model, x, model.fc.weight),
                                       atol=1e-5, rtol=1e-4, msg=lambda m: f"{shape}: {m}")


def test_a_layer_replaced_after_torch_compile_is_compiled_in():
    model = _mlp()
    x = torch.randn(4, 10)
    compiled = torch.compile(fxdp.compile_for_dp(model, (x,), loss_reduction="sum"), backend="aot_eager")
    compiled(x).sum().backward()
    model[4] = nn.Linear(16, 3)
    for p in model.parameters():
        p.grad_sample = None
    out = compiled(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    torch.testing.assert_close(model[4].weight.grad_sample, _alone(model, x, model[4].weight), atol=1e-5, rtol=1e-4)


def test_a_parameter_unfrozen_after_torch_compile_gets_per_sample_gradients():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    x = torch.randn(4, 10)
    compiled = torch.compile(fxdp.compile_for_dp(model, (x,), loss_reduction="sum"), backend="aot_eager")
    compiled(x).sum().backward()
    assert getattr(model[0].weight, "grad_sample", None) is None
    model[0].weight.requires_grad_(True)
    eager = copy.deepcopy(model)
    compiled(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad_sample, _alone(eager, x, eager[0].weight), atol=1e-5, rtol=1e-4)
