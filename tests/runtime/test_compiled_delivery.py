"""Under ``torch.compile`` the DP-aware layers deliver their captures from the compiled backward
(fxdp/runtime/compiled_delivery.py): one graph for the whole forward, whatever the number of layers, and the
per-sample gradients of batches of one (float64, aot_eager and inductor)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdp
from fxdp.diagnostics.errors import PerSampleError
from fxdp.sinks.contract import sink_of
from tests.support.counting_backend import CountingBackend

torch._dynamo = pytest.importorskip("torch._dynamo")
pytestmark = pytest.mark.usefixtures("float64")

_spec = importlib.util.spec_from_file_location("fxdp_bench_models", Path(__file__).parents[2] / "benchmarks" / "models.py")
bench_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_models)


def _mlp(layers: int) -> nn.Sequential:
    inner = [m for _ in range(layers - 2) for m in (nn.Tanh(), nn.Linear(16, 16))]
    return nn.Sequential(nn.Linear(10, 16), *inner, nn.ReLU(), nn.Linear(16, 3))


class AddedPosition(nn.Module):
    """A bare parameter added to per-sample data (a learned position table), then a Linear on (N, T, d)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, 8))
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(torch.tanh(x + self.pos)).sum(1)


MODELS = {
    "mlp2": (lambda: _mlp(2), lambda n: torch.randn(n, 10)),
    "mlp8": (lambda: _mlp(8), lambda n: torch.randn(n, 10)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(144, 3)),
            lambda n: torch.randn(n, 1, 8, 8)),
    "attention": (bench_models.OneHeadAttention, lambda n: torch.randint(0, 20, (n, 6))),
    "added position": (AddedPosition, lambda n: torch.randn(n, 5, 8)),
}


def _alone(model, x):
    """Per-sample gradients of every trainable parameter, each sample run as a batch of one (what
    ``p.grad_sample`` holds, whatever the loss reduction)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(model(x[i:i + 1]).pow(2).sum(), params) for i in range(x.shape[0])]
    return {p: torch.stack([r[k] for r in rows]) for k, p in enumerate(params)}


def _loss(out, loss_reduction):
    per_sample = out.pow(2).flatten(1).sum(1)
    return per_sample.sum() if loss_reduction == "sum" else per_sample.mean()


@pytest.mark.parametrize("name", list(MODELS))
def test_the_forward_is_one_graph_whatever_the_number_of_layers(name):
    make, make_x = MODELS[name]
    torch.manual_seed(0)
    model, x = make(), make_x(4)
    private = fxdp.compile_for_dp(model, (x,))
    assert fxdp.report(private).engine == "fx"
    torch._dynamo.reset()
    backend = CountingBackend()
    torch.compile(private, backend=backend)(x).sum().backward()
    assert backend.graphs == 1  # (before compiled_delivery.py: one more per DP-aware layer, 3 for mlp2, 15 for mlp8)
    torch._dynamo.reset()
    assert torch._dynamo.explain(private)(x).graph_break_count == 0
    assert all(getattr(p, "grad_sample", None) is not None for p in model.parameters())


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_per_sample_gradients_are_those_of_batches_of_one(name, loss_reduction):
    make, make_x = MODELS[name]
    torch.manual_seed(0)
    model = make()
    private = fxdp.compile_for_dp(model, (make_x(4),), loss_reduction=loss_reduction)
    compiled = torch.compile(private, backend="aot_eager")
    for n in (4, 4, 6):  # the same batch size again (no compilation), then another (the batch guard runs)
        x = make_x(n)
        for p in model.parameters():
            p.grad_sample = None
        _loss(compiled(x), loss_reduction).backward()
        for p, want in _alone(model, x).items():
            torch.testing.assert_close(p.grad_sample, want, atol=1e-10, rtol=1e-8)


def test_where_torch_cannot_trace_the_delivery_each_layer_keeps_its_hook_and_the_gradients_are_right(monkeypatch):
    """On a torch whose dynamo cannot trace the delivery (2.11), the eager hook runs instead: a graph break per
    DP-aware layer, and the same per-sample gradients."""
    from fxdp.runtime import compiled_delivery

    monkeypatch.setattr(compiled_delivery, "TRACEABLE", False)
    make, make_x = MODELS["mlp8"]
    torch.manual_seed(0)
    model = make()
    private = fxdp.compile_for_dp(model, (make_x(4),))
    torch._dynamo.reset()
    backend = CountingBackend()
    x = make_x(4)
    _loss(torch.compile(private, backend=backend)(x), "mean").backward()
    assert backend.graphs > 1
    for p, want in _alone(model, x).items():
        torch.testing.assert_close(p.grad_sample, want, atol=1e-10, rtol=1e-8)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["mlp8", "added position"])
def test_inductor_per_sample_gradients_are_those_of_batches_of_one(name):
    """In float64, as aot_eager: inductor may fuse and reorder the arithmetic, which moves float64 results by
    a few units in their last place, far below the tolerance."""
    make, make_x = MODELS[name]
    torch.manual_seed(0)
    model = make()
    compiled = torch.compile(fxdp.compile_for_dp(model, (make_x(4),)), backend="inductor")
    for _ in range(2):
        x = make_x(4)
        for p in model.parameters():
            p.grad_sample = None
        _loss(compiled(x), "mean").backward()
        for p, want in _alone(model, x).items():
            torch.testing.assert_close(p.grad_sample, want, atol=1e-10, rtol=1e-8)


def test_two_forward_calls_before_one_backward_add_up_per_sample():
    """The forward call a capture belongs to is read when the compiled forward runs, not when it was traced."""
    model = _mlp(3)
    compiled = torch.compile(fxdp.compile_for_dp(model, (torch.randn(4, 10),), loss_reduction="sum"),
                             backend="aot_eager")
    x1, x2 = torch.randn(4, 10), torch.randn(4, 10)
    for _ in range(2):
        for p in model.parameters():
            p.grad_sample = None
        (_loss(compiled(x1), "sum") + _loss(compiled(x2), "sum")).backward()
        want1, want2 = _alone(model, x1), _alone(model, x2)
        for p in model.parameters():
            torch.testing.assert_close(p.grad_sample, want1[p] + want2[p], atol=1e-10, rtol=1e-8)


def test_two_batch_sizes_before_one_backward_are_refused():
    model = _mlp(3)
    private = fxdp.compile_for_dp(model, (torch.randn(4, 10),), loss_reduction="sum")
    compiled = torch.compile(private, backend="aot_eager")
    (compiled(torch.randn(4, 10)).sum() + compiled(torch.randn(3, 10)).sum()).backward()
    with pytest.raises(PerSampleError, match=r"batches of \[3, 4\] samples"):
        sink_of(private).squared_norms(list(model.parameters()))
