"""Under ``torch.compile``, PyTorch's own transformer blocks (``nn.TransformerEncoder``, ``nn.MultiheadAttention``),
whose layers the runtime calls one by one with a site made at each call (fxdp/runtime/ops.py ``_transformer_call``):
the compiled backward delivers through the block's site (it failed with an AttributeError on the site dynamo had
built while tracing), the forward is one graph, and the per-sample gradients are those of batches of one (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdp
from tests.support.counting_backend import CountingBackend

torch._dynamo = pytest.importorskip("torch._dynamo")
pytestmark = pytest.mark.usefixtures("float64")


class Encoder(nn.Module):
    """Token embeddings plus a learned position table (a bare parameter), a stock pre-norm encoder of ``layers``
    layers, a head on the mean over the sequence."""

    def __init__(self, layers: int):
        super().__init__()
        self.tok = nn.Embedding(20, 8)
        self.pos = nn.Parameter(torch.randn(1, 5, 8) * 0.1)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.encoder(self.tok(ids) + self.pos).mean(1))


class Attention(nn.Module):
    """A stock multi-head attention on (N, T, d), batch first."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.attention(x, x, x, need_weights=False)
        return self.head(out.mean(1))


MODELS = {
    "encoder, 1 layer": (lambda: Encoder(1), lambda n: torch.randint(0, 20, (n, 5))),
    "encoder, 3 layers": (lambda: Encoder(3), lambda n: torch.randint(0, 20, (n, 5))),
    "multi-head attention": (Attention, lambda n: torch.randn(n, 5, 8)),
}


def _alone(model, x):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(model(x[i:i + 1]).pow(2).sum(), params) for i in range(x.shape[0])]
    return {p: torch.stack([r[k] for r in rows]) for k, p in enumerate(params)}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_stock_block_is_one_graph_and_gives_the_per_sample_gradients_of_batches_of_one(name):
    make, make_x = MODELS[name]
    torch.manual_seed(0)
    model = make()
    private = fxdp.compile_for_dp(model, (make_x(4),), loss_reduction="sum")
    assert "transformer" in {site.rule for site in private.fxdp_batch_guard.sites}  # the block's own rule
    torch._dynamo.reset()
    backend = CountingBackend()
    compiled = torch.compile(private, backend=backend)
    graphs = []  # dynamo's graphs so far, after each step
    for n in (4, 4, 6):  # compiled, the same again, another batch size (the batch guard runs)
        x = make_x(n)
        for p in model.parameters():
            p.grad_sample = None
        compiled(x).pow(2).sum().backward()
        graphs.append(backend.graphs)
        for p, want in _alone(model, x).items():
            torch.testing.assert_close(p.grad_sample, want, atol=1e-10, rtol=1e-8)
    assert graphs[0] == 1  # one forward, one graph, whatever the number of layers (before: a break per block)


def test_a_stock_encoder_under_aot_autograd_gives_the_per_sample_gradients_of_batches_of_one():
    make, make_x = MODELS["encoder, 3 layers"]
    torch.manual_seed(0)
    model = make()
    compiled = torch.compile(fxdp.compile_for_dp(model, (make_x(4),)), backend="aot_eager")
    x = make_x(4)
    compiled(x).pow(2).sum(1).mean().backward()
    for p, want in _alone(model, x).items():
        torch.testing.assert_close(p.grad_sample, want, atol=1e-10, rtol=1e-8)
