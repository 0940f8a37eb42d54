"""PyTorch's own transformer blocks (nn.MultiheadAttention, nn.TransformerEncoderLayer / DecoderLayer,
nn.TransformerEncoder / Decoder) run decomposed (fxdp.grad_sample.transformer): the compiled model's outputs
equal the stock module's, per-sample gradients equal batches of one, the book-keeping sink's norms and clipped
sums equal them too, and the projections are book-kept (the plan says so, the generic rule never runs), for
batch_first either way, pre- and post-norm, masks of every kind. A learned position table added to the input
(a bare nn.Parameter) gets the output gradient summed over its broadcast dimensions. Float64, small sizes."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.grad_sample.transformer import InProjection, transformer_rule_applies
import fxdp.runtime.ops as ops
from fxdp.sinks.bookkeeping import BookkeepingSink
from tests.support.per_sample_reference import expected_grad_samples

N, L, S, E, H, FF = 3, 4, 5, 8, 2, 12


pytestmark = pytest.mark.usefixtures("float64")  # tight comparisons (tests/support/fixtures.py)


@pytest.fixture
def no_generic_rule(monkeypatch):
    """Fail the test if any site falls back to the generic rule (a per-sample re-run of the op)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the generic per-sample rule ran")

    monkeypatch.setattr(ops, "layout_grad_samples", refuse)


def _causal(n, bool_mask):
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    return mask if bool_mask else torch.zeros(n, n).masked_fill(mask, float("-inf"))


def _padding():
    """Key padding of the S memory positions: sample 1 has its last two masked, sample 2 its last one."""
    mask = torch.zeros(N, S, dtype=torch.bool)
    mask[1, -2:] = True
    mask[2, -1] = True
    return mask


class Net(nn.Module):
    """Batch-first inputs at the model's edge; the block sees them in its own layout."""

    def __init__(self, block, batch_first, call):
        super().__init__()
        self.block, self.batch_first, self.call = block, batch_first, call
        self.head = nn.Linear(E, 3)

    def _in(self, t):
        return t if self.batch_first else t.transpose(0, 1)

    def forward(self, x, memory, padding):
        out = self.call(self, self._in(x), self._in(memory), padding)
        return self.head(torch.tanh(self._in(out)))


def _check(model, inputs, reduction="sum", method=None, bookkept=True):
    """Outputs, per-sample gradients (materialising sink), norms and clipped sums (book-keeping sink)."""
    torch.manual_seed(0)
    expected, R = expected_grad_samples(model, inputs)
    scale = inputs[0].shape[0] if reduction == "mean" else 1
    compiled = fxdp.compile_for_dp(copy.deepcopy(model), example_inputs=inputs, loss_reduction=reduction)
    out = compiled(*inputs)
    with torch.no_grad():
        torch.testing.assert_close(out, model(*inputs), atol=1e-12, rtol=1e-10)
    ((out * R).sum() / scale).backward()
    for name, p in compiled.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-10, rtol=1e-8, msg=lambda m: f"{name}: {m}")
    book = BookkeepingSink(method)
    model = copy.deepcopy(model)
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction=reduction, sink=book)
    ((compiled(*inputs) * R).sum() / scale).backward()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    norms = book.squared_norms(params.values())
    factors = {p: torch.rand(inputs[0].shape[0]) for p in params.values()}
    sums = book.clipped_sums(params.values(), factors)
    for name, p in params.items():
        torch.testing.assert_close(norms[p], expected[name].flatten(1).pow(2).sum(1), atol=1e-10, rtol=1e-8,
                                   msg=lambda m: f"{name} norms: {m}")
        torch.testing.assert_close(sums[p], torch.tensordot(factors[p], expected[name], dims=1), atol=1e-10,
                                   rtol=1e-8, msg=lambda m: f"{name} clipped sum: {m}")
        if bookkept and name.startswith("block.") and "norm" not in name:  # book-kept: p.grad left to the optimizer
            assert p.grad is None, name
    return book, compiled


# -- nn.MultiheadAttention ---------------------------------------------------------------------------------


def _attention_call(kind, need_weights, average, attn_mask, use_padding, is_causal=False):
    def call(net, x, memory, padding):
        q, k, v = {"self": (x, x, x), "cross": (x, memory, memory), "distinct": (x, memory, memory * 2 + 1)}[kind]
        keys = net._in(k)  # batch first
        source = keys.shape[1]
        mask = None
        if attn_mask == "causal":
            mask = _causal(L, True)
        elif attn_mask == "float":
            mask = torch.linspace(-1, 1, L * source).view(L, source)
        elif attn_mask == "per-sample":  # (N * heads, L, S) from the keys: each sample's heads one after another
            n = keys.shape[0]
            mask = 0.1 * keys.sum(-1)[:, None, None, :].expand(n, H, L, source).reshape(n * H, L, source)
        out, weights = net.block(q, k, v, key_padding_mask=padding if use_padding and kind != "self" else None,
                                 need_weights=need_weights, attn_mask=mask, average_attn_weights=average,
                                 is_causal=is_causal)
        if need_weights:  # the weights (N, L, S) or (N, heads, L, S) reach the loss too
            w = (weights if average else weights.mean(1)).mean(-1, keepdim=True)
            out = out + net._in(w)
        return out
    return call


ATTENTION = [
    # kind, batch_first, need_weights, average, attn_mask, padding, bias, reduction
    ("self", True, False, True, None, False, True, "sum"),
    ("self", False, False, True, "causal", False, True, "mean"),
    ("self", True, True, True, "float", False, True, "sum"),
    ("self", False, True, False, None, False, False, "mean"),
    ("cross", True, False, True, None, True, True, "mean"),
    ("cross", False, True, True, "float", True, True, "sum"),
    ("cross", True, True, False, "per-sample", False, True, "sum"),
    ("distinct", False, False, True, "per-sample", True, True, "mean"),
    ("distinct", True, True, True, None, True, False, "sum"),
]


@pytest.mark.parametrize("config", ATTENTION, ids=["-".join(str(c) for c in config) for config in ATTENTION])
def test_multihead_attention(config, no_generic_rule):
    kind, batch_first, need_weights, average, attn_mask, padding, bias, reduction = config
    torch.manual_seed(ATTENTION.index(config))
    block = nn.MultiheadAttention(E, H, batch_first=batch_first, bias=bias)
    model = Net(block, batch_first, _attention_call(kind, need_weights, average, attn_mask, padding))
    book, compiled = _check(model, (torch.randn(N, L, E), torch.randn(N, S, E), _padding()), reduction,
                            method=(None, "ghost", "per_sample")[ATTENTION.index(config) % 3])
    views = [m for m in book.plans if isinstance(m, InProjection)]
    assert len(views) == 1 and views[0].weight is compiled.block.in_proj_weight
    change = next(c for c in fxdp.report(compiled).pass_report("per_sample").changes if c.node == "block")
    assert "by the transformer rule" in change.message


def test_multihead_attention_with_the_causal_hint(no_generic_rule):
    """is_causal with a causal mask: torch hands the hint to scaled_dot_product_attention (no mask)."""
    torch.manual_seed(1)
    model = Net(nn.MultiheadAttention(E, H, batch_first=True), True,
                _attention_call("self", False, True, "causal", False, is_causal=True))
    _check(model, (torch.randn(N, L, E), torch.randn(N, S, E), _padding()))


@pytest.mark.parametrize("extra", [{"add_bias_kv": True}, {"add_zero_attn": True}, {"kdim": 6, "vdim": 6}])
def test_attention_options_torch_has_beyond_the_decomposition_take_the_generic_rule(extra):
    torch.manual_seed(2)
    block = nn.MultiheadAttention(E, H, batch_first=True, **extra)
    assert not transformer_rule_applies(block)
    memory = torch.randn(N, S, extra.get("kdim", E))

    def call(net, x, mem, padding):
        return net.block(x, mem, mem, need_weights=False)[0]

    _, compiled = _check(Net(block, True, call), (torch.randn(N, L, E), memory, _padding()), bookkept=False)
    change = next(c for c in fxdp.report(compiled).pass_report("per_sample").changes if c.node == "block")
    assert "by the generic rule" in change.message


# -- encoder and decoder layers, and their stacks ------------------------------------------------------------


def _encoder_layer_call(use_mask, use_padding, is_causal=False):
    def call(net, x, memory, padding):
        mask = _causal(L, False) if use_mask else None
        # positional: the layer names them (src, src_mask, ...), the stack (src, mask, ...)
        return net.block(x, mask, padding[:, :L] if use_padding else None, is_causal)
    return call


def _decoder_call(use_mask, use_padding):
    def call(net, x, memory, padding):
        return net.block(x, memory, tgt_mask=_causal(L, True) if use_mask else None,
                         memory_key_padding_mask=padding if use_padding else None,
                         tgt_key_padding_mask=padding[:, :L] if use_padding else None)
    return call


LAYERS = [
    # block, batch_first, norm_first, activation, mask, padding, reduction
    ("encoder-layer", True, False, "relu", False, False, "sum"),
    ("encoder-layer", False, True, "gelu", True, True, "mean"),
    ("encoder-layer", True, True, nn.GELU(), True, False, "mean"),
    ("decoder-layer", True, False, "relu", True, True, "sum"),
    ("decoder-layer", False, True, "gelu", False, True, "mean"),
    ("encoder", True, False, "gelu", True, True, "mean"),
    ("encoder", False, True, "relu", False, False, "sum"),
    ("decoder", True, True, "relu", True, True, "sum"),
    ("decoder", False, False, "gelu", True, False, "mean"),
]


def _block(kind, batch_first, norm_first, activation):
    common = dict(dim_feedforward=FF, dropout=0.0, activation=activation, batch_first=batch_first,
                  norm_first=norm_first)
    if kind == "encoder-layer":
        return nn.TransformerEncoderLayer(E, H, **common)
    if kind == "decoder-layer":
        return nn.TransformerDecoderLayer(E, H, **common)
    if kind == "encoder":
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, **common), 2, norm=nn.LayerNorm(E),
                                     enable_nested_tensor=False)
    return nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **common), 2, norm=nn.LayerNorm(E))


@pytest.mark.parametrize("config", LAYERS, ids=["-".join(str(c) for c in config) for config in LAYERS])
def test_encoder_and_decoder_layers_and_stacks(config, no_generic_rule):
    kind, batch_first, norm_first, activation, mask, padding, reduction = config
    torch.manual_seed(LAYERS.index(config))
    block = _block(kind, batch_first, norm_first, activation)
    for p in block.parameters():  # away from torch's init (zero biases, unit norms): every term shows
        p.data.add_(torch.randn_like(p) * 0.1)
    call = _decoder_call(mask, padding) if kind.startswith("decoder") else _encoder_layer_call(mask, padding)
    book, compiled = _check(Net(block, batch_first, call), (torch.randn(N, L, E), torch.randn(N, S, E), _padding()),
                            reduction, method=(None, "ghost", "per_sample")[LAYERS.index(config) % 3])
    attentions = [m for m in compiled.block.modules() if isinstance(m, nn.MultiheadAttention)]
    assert {id(m.weight) for m in book.plans if isinstance(m, InProjection)} == {id(m.in_proj_weight) for m in attentions}


def test_an_encoder_layer_with_the_causal_hint_and_a_frozen_attention(no_generic_rule):
    torch.manual_seed(4)
    block = _block("encoder-layer", True, False, "relu")
    block.self_attn.requires_grad_(False)
    _check(Net(block, True, _encoder_layer_call(True, False, is_causal=True)),
           (torch.randn(N, L, E), torch.randn(N, S, E), _padding()))


class Classifier(nn.Module):
    """Token embedding, a learned position table (a bare parameter), a stock encoder, a linear head."""

    def __init__(self, vocab=20, d=E, t=L, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, t, d) * 0.1)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, H, FF, dropout=0.0, batch_first=True),
                                             layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, ids):
        return self.head(self.encoder(self.tok(ids) + self.pos).mean(1))


def test_every_parameter_of_a_stock_encoder_classifier_is_planned_book_kept():
    torch.manual_seed(5)
    ids = torch.randint(0, 20, (N, L))
    compiled = fxdp.compile_for_dp(Classifier(), example_inputs=ids, sink=BookkeepingSink())
    notes = [n for n in fxdp.report(compiled).notes if n.startswith("book-keeping:")]
    plans = {line.split("'")[1]: line for line in notes}
    for i in range(2):
        for name, layer in (("self_attn.in_proj", "InProjection"), ("self_attn.out_proj", "NonDynamicallyQuantizableLinear"),
                            ("linear1", "Linear"), ("linear2", "Linear")):
            line = plans[f"encoder.layers.{i}.{name}"]
            assert f"({layer}): ghost" in line or f"({layer}): per_sample" in line, line
        for norm in ("norm1", "norm2"):
            assert f"({'LayerNorm'}): materialise" in plans[f"encoder.layers.{i}.{norm}"]
    assert "(parameter): summed (" in plans["_operator.add"] and "'pos'" in plans["_operator.add"]
    assert "(Embedding): index" in plans["tok"] and "(Linear): outer" in plans["head"]
    validate = fxdp.report(compiled).pass_report("validate").findings
    assert not [f for f in validate if f.node == "encoder" and "generic" in f.message]


def test_a_stock_encoder_classifier_trains_privately_without_the_generic_rule(no_generic_rule):
    torch.manual_seed(6)
    model = Classifier()
    ids = torch.randint(0, 20, (N, L))
    _check(model, (ids,), "mean")


def test_no_grad_and_eval_keep_torchs_own_forward():
    """Without gradients nothing is decomposed: torch's inference fast path (nested tensors for padding) runs."""
    torch.manual_seed(7)
    model = Classifier()
    ids = torch.randint(0, 20, (N, L))
    compiled = fxdp.compile_for_dp(copy.deepcopy(model), example_inputs=ids).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids), atol=1e-12, rtol=1e-10)


# -- a parameter added to per-sample data ----------------------------------------------------------------------


class Added(nn.Module):
    def __init__(self, shape, op, first, time_major):
        super().__init__()
        self.pos, self.op, self.first, self.time_major = nn.Parameter(torch.randn(shape)), op, first, time_major
        self.fc = nn.Linear(E, 3)

    def forward(self, x):
        x = x.transpose(0, 1) if self.time_major else x
        h = self.op(self.pos, x) if self.first else self.op(x, self.pos)
        h = h.transpose(0, 1) if self.time_major else h
        return self.fc(torch.tanh(h))


ADDED = [  # shape, op, parameter first, time-major, subtracted
    ((1, L, E), operator.add, False, False, False), ((L, E), operator.sub, False, False, True),
    ((E,), torch.add, True, False, False), ((L, 1), operator.sub, True, False, False),
    ((L, 1, E), torch.sub, False, True, True), ((1, 1, E), lambda a, b: a.add(b), False, False, False),
    ((1, L, 1), lambda a, b: a.sub(b), False, False, True)]


@pytest.mark.parametrize("config", ADDED, ids=[f"{c[0]}-{k}" for k, c in enumerate(ADDED)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_parameter_added_to_per_sample_data(config, reduction, no_generic_rule):
    torch.manual_seed(ADDED.index(config))
    shape, op, first, time_major, subtracted = config
    _, compiled = _check(Added(shape, op, first, time_major), (torch.randn(N, L, E),), reduction)
    line = next(n for n in fxdp.report(compiled).notes if "'pos'" in n)
    assert "(parameter): summed (" in line
    assert ("subtracted from per-sample data" in line) == subtracted, line


def test_an_addition_with_alpha_takes_the_generic_rule():
    torch.manual_seed(9)
    model = Added((1, L, E), lambda a, b: torch.add(a, b, alpha=0.5), False, False)
    _, compiled = _check(model, (torch.randn(N, L, E),))
    line = next(n for n in fxdp.report(compiled).notes if "'pos'" in n)
    assert "(generic): materialise" in line, line


@pytest.mark.parametrize("kind", ["encoder-layer", "decoder-layer"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_dropout_in_stock_layers(kind, batch_first, no_generic_rule):
    """Dropout (in the attention and the feed-forward block) is part of the forward the per-sample gradients
    are taken of, and draws the same masks as torch's own layer: with the same seed, the compiled model's output
    is the stock model's, and each sample's gradient is that of its own loss in the batch."""
    torch.manual_seed(10)
    block = _block(kind, batch_first, False, "relu")
    for m in block.modules():
        if isinstance(m, (nn.Dropout, nn.MultiheadAttention)):
            setattr(m, "p" if isinstance(m, nn.Dropout) else "dropout", 0.3)
    call = _decoder_call(True, True) if kind == "decoder-layer" else _encoder_layer_call(False, True)
    model = Net(block, batch_first, call)
    inputs = (torch.randn(N, L, E), torch.randn(N, S, E), _padding())
    params = dict(model.named_parameters())
    torch.manual_seed(11)
    out = model(*inputs)
    R = torch.randn(out.shape[1:])
    expected = {name: [] for name in params}
    for i in range(N):  # sample i's loss, through the batch's own forward (its dropout masks)
        grads = torch.autograd.grad((out[i] * R).sum(), list(params.values()), retain_graph=True)
        for name, g in zip(params, grads):
            expected[name].append(g)
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="sum")
    torch.manual_seed(11)
    dp_out = compiled(*inputs)
    torch.testing.assert_close(dp_out, out.detach(), atol=1e-12, rtol=1e-10)  # the same random masks
    (dp_out * R).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(p.grad_sample, torch.stack(expected[name]), atol=1e-10, rtol=1e-8,
                                   msg=lambda m: f"{name}: {m}")


def test_a_hook_added_after_compiling_is_run():
    """torch's forward runs the hooks of the block's modules; the decomposition would not, so a block with a hook
    is not decomposed (a hook there before compiling sends the whole model to the whole-model engine)."""
    torch.manual_seed(12)
    model = Net(_block("encoder-layer", True, False, "relu"), True, _encoder_layer_call(False, True))
    inputs = (torch.randn(N, L, E), torch.randn(N, S, E), _padding())
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="sum")
    model.block.linear1.register_forward_hook(lambda module, args, out: out * 2)
    expected, R = expected_grad_samples(model, inputs)
    out = compiled(*inputs)
    with torch.no_grad():
        torch.testing.assert_close(out, model(*inputs), atol=1e-12, rtol=1e-10)
    (out * R).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-10, rtol=1e-8, msg=lambda m: f"{name}: {m}")
