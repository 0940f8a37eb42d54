"""fxdp.layers (Opacus's DP layers): the stock torch modules under Opacus's names. Their state_dict keys and
forward are torch's (a state_dict moves either way), and every engine's per-sample gradients equal the
gradients of each sample run alone (float64), PackedSequence inputs included for the engines that run the
model as it is."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence, pad_sequence

import fxdp
from fxdp.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention, SequenceBias
from tests.support.per_sample_reference import assert_grad_samples_match

STOCK = {DPLSTM: nn.LSTM, DPGRU: nn.GRU, DPRNN: nn.RNN}


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(previous)


class Output(nn.Module):
    """A recurrent or attention layer's first output, the one tensor the engines differentiate."""

    def __init__(self, layer: nn.Module, attention: bool = False):
        super().__init__()
        self.layer = layer
        self.attention = attention

    def forward(self, x):
        if self.attention:
            q, k, v = x.unbind(-1)
            return self.layer(q, k, v)[0]
        return self.layer(x)[0]


# -- signatures, state_dict, forward -------------------------------------------------------------------------


def test_constructor_signatures_are_opacus():
    rnn_args = ["input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional",
                "proj_size"]
    for layer in (DPLSTM, DPGRU):
        assert list(inspect.signature(layer).parameters)[:8] == rnn_args
    assert list(inspect.signature(DPRNN).parameters)[:9] == rnn_args + ["nonlinearity"]
    assert list(inspect.signature(DPMultiheadAttention).parameters)[:9] == [
        "embed_dim", "num_heads", "dropout", "bias", "add_bias_kv", "add_zero_attn", "kdim", "vdim", "batch_first"]
    assert list(inspect.signature(SequenceBias).parameters)[:2] == ["embed_dim", "batch_first"]
    # positionally, as Opacus's callers pass them
    lstm = DPLSTM(3, 4, 2, False, True, 0.0, True)
    assert (lstm.num_layers, lstm.bias, lstm.batch_first, lstm.bidirectional) == (2, False, True, True)
    assert DPRNN(3, 4, 1, True, False, 0.0, False, 0, "relu").nonlinearity == "relu"
    with pytest.raises(ValueError, match="DPGRU: proj_size=2, but projections exist only in LSTM"):
        DPGRU(3, 4, proj_size=2)


@pytest.mark.parametrize("layer", [DPLSTM, DPGRU, DPRNN])
def test_recurrent_state_dict_is_the_stock_modules(layer):
    dp = layer(3, 4, num_layers=2, bidirectional=True)
    stock = STOCK[layer](3, 4, num_layers=2, bidirectional=True)
    assert list(dp.state_dict()) == list(stock.state_dict())
    assert "weight_ih_l0" in dp.state_dict() and "bias_hh_l1_reverse" in dp.state_dict()
    dp.load_state_dict(stock.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(dp.state_dict()[key], value)
    STOCK[layer](3, 4, num_layers=2, bidirectional=True).load_state_dict(dp.state_dict())
    assert isinstance(dp, STOCK[layer])


@pytest.mark.parametrize("kdim, bias_kv, bias", [(None, False, True), (None, True, False), (3, True, True)])
def test_attention_state_dict_is_the_stock_modules(kdim, bias_kv, bias):
    options = dict(bias=bias, add_bias_kv=bias_kv, kdim=kdim, vdim=kdim)
    dp, stock = DPMultiheadAttention(8, 2, **options), nn.MultiheadAttention(8, 2, **options)
    assert list(dp.state_dict()) == list(stock.state_dict())
    expected = {"out_proj.weight", "in_proj_weight" if kdim is None else "k_proj_weight"}
    expected |= {"in_proj_bias"} if bias else set()
    expected |= {"bias_k", "bias_v"} if bias_kv else set()
    assert expected <= set(dp.state_dict())
    dp.load_state_dict(stock.state_dict())
    stock.load_state_dict(dp.state_dict())
    assert list(SequenceBias(5).state_dict()) == ["bias"]


def _packed(lengths, features, batch_first, enforce_sorted):
    padded = pad_sequence([torch.randn(n, features) for n in lengths], batch_first=batch_first)
    return pack_padded_sequence(padded, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted)


@pytest.mark.parametrize("layer", [DPLSTM, DPGRU, DPRNN])
@pytest.mark.parametrize("inputs", ["tensor", "packed", "packed-unsorted", "with-state"])
def test_recurrent_forward_equals_torchs(layer, inputs):
    stock = STOCK[layer](5, 4, num_layers=2, bidirectional=True, batch_first=True)
    dp = layer(5, 4, num_layers=2, bidirectional=True, batch_first=True)
    dp.load_state_dict(stock.state_dict())
    x = torch.randn(3, 6, 5) if inputs in ("tensor", "with-state") else _packed(
        [6, 4, 1] if inputs == "packed" else [2, 6, 3], 5, True, inputs == "packed")
    args = (x,)
    if inputs == "with-state":
        h = torch.randn(4, 3, 4)
        args = (x, (h, torch.randn(4, 3, 4)) if layer is DPLSTM else h)
    expected, got = stock(*args), dp(*args)
    flat = [t for t in torch.utils._pytree.tree_leaves(expected)]
    assert len(flat) == len(torch.utils._pytree.tree_leaves(got))
    for a, b in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("options", [dict(), dict(add_bias_kv=True, add_zero_attn=True), dict(kdim=3, vdim=5),
                                     dict(bias=False, batch_first=True)])
def test_attention_forward_equals_torchs(options):
    stock, dp = nn.MultiheadAttention(8, 2, **options), DPMultiheadAttention(8, 2, **options)
    dp.load_state_dict(stock.state_dict())
    shape = (2, 4) if options.get("batch_first") else (4, 2)
    q, k, v = torch.randn(*shape, 8), torch.randn(*shape, options.get("kdim", 8)), torch.randn(
        *shape, options.get("vdim", 8))
    mask = torch.tensor([[False, False, True, False], [False, True, False, False]])
    for a, b in zip(stock(q, k, v, key_padding_mask=mask), dp(q, k, v, key_padding_mask=mask)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_sequence_bias_appends_its_bias_as_a_step():
    time_major, batch_first = SequenceBias(3), SequenceBias(3, batch_first=True)
    x = torch.randn(5, 2, 3)
    out = time_major(x)
    assert out.shape == (6, 2, 3) and torch.equal(out[:5], x)
    assert torch.equal(out[5], time_major.bias.detach().expand(2, 3))
    out = batch_first(x.transpose(0, 1))
    assert out.shape == (2, 6, 3) and torch.equal(out[:, 5], batch_first.bias.detach().expand(2, 3))


# -- per-sample gradients against each sample alone ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["fx", "hooks", "functorch"])
@pytest.mark.parametrize("layer", [DPLSTM, DPGRU, DPRNN])
@pytest.mark.parametrize("batch_first", [True, False])
def test_recurrent_per_sample_gradients(mode, layer, batch_first):
    model = Output(layer(4, 5, num_layers=2, bidirectional=True, batch_first=batch_first))
    x = torch.randn(3, 4, 4) if batch_first else torch.randn(4, 3, 4)
    for reduction in ("sum", "mean"):
        assert_grad_samples_match(model, x, batch_dim=0 if batch_first else 1, loss_reduction=reduction, mode=mode,
                                  atol=1e-9, rtol=1e-7)


def test_fx_trains_dp_layers_with_the_recurrent_rule():
    compiled = fxdp.compile_for_dp(Output(DPLSTM(4, 5, batch_first=True)), example_inputs=torch.randn(2, 3, 4))
    text = str(fxdp.report(compiled))
    assert "layer 'layer' (DPLSTM): per-sample gradients by the recurrent" in " ".join(text.split())


@pytest.mark.parametrize("mode", ["fx", "hooks", "functorch"])
@pytest.mark.parametrize("options", [dict(), dict(add_bias_kv=True, add_zero_attn=True, bias=False),
                                     dict(kdim=4, vdim=4)])
def test_attention_per_sample_gradients(mode, options):
    model = Output(DPMultiheadAttention(4, 2, **options), attention=True)
    x = torch.randn(5, 3, 4, 3)  # (T, N, E) query, key and value stacked last
    for reduction in ("sum", "mean"):
        assert_grad_samples_match(model, x, batch_dim=1, loss_reduction=reduction, mode=mode, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("mode", ["fx", "hooks", "functorch"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_sequence_bias_per_sample_gradients(mode, batch_first):
    model = nn.Sequential(nn.Linear(4, 4), SequenceBias(4, batch_first))
    x = torch.randn(3, 5, 4) if batch_first else torch.randn(5, 3, 4)
    for reduction in ("sum", "mean"):
        assert_grad_samples_match(model, x, batch_dim=0 if batch_first else 1, loss_reduction=reduction, mode=mode,
                                  atol=1e-9, rtol=1e-7)


def test_sequence_bias_empty_batch_gives_empty_grad_samples():
    model = SequenceBias(4, batch_first=True)
    wrapped = fxdp.GradSampleModule(model)
    wrapped(torch.randn(0, 5, 4)).sum().backward()
    assert model.bias.grad_sample.shape == (0, 4)


def _packed_reference(model, sequences, batch_first):
    """Each sample's gradient of ``<out.data, R_i>`` run alone, and the batch's summed loss."""
    params = dict(model.named_parameters())
    Rs = [torch.randn(n, 2 * 5) for n in (len(s) for s in sequences)]
    rows = []
    for s, R in zip(sequences, Rs):
        out = model(pack_padded_sequence(s.unsqueeze(0 if batch_first else 1), [len(s)], batch_first=batch_first))
        rows.append(torch.autograd.grad((out.data * R).sum(), list(params.values())))
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}, Rs


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("layer", [DPLSTM, DPGRU, DPRNN])
@pytest.mark.parametrize("enforce_sorted", [True, False])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_recurrent_per_sample_gradients_of_packed_sequences(mode, layer, enforce_sorted, reduction):
    batch_first = not enforce_sorted
    lengths = [5, 3, 1] if enforce_sorted else [2, 5, 3]
    sequences = [torch.randn(n, 4) for n in lengths]
    model = Output(layer(4, 5, num_layers=2, bidirectional=True, batch_first=batch_first))
    expected, Rs = _packed_reference(copy.deepcopy(model), sequences, batch_first)
    x = pack_padded_sequence(pad_sequence(sequences, batch_first=batch_first), lengths, batch_first=batch_first,
                             enforce_sorted=enforce_sorted)
    wrapped = fxdp.compiler.wrap_model(model, mode, batch_first=batch_first, loss_reduction=reduction)
    out = wrapped(x)
    assert isinstance(out, PackedSequence)
    padded, _ = pad_packed_sequence(out, batch_first=True)
    loss = sum((padded[i, :n] * R).sum() for i, (n, R) in enumerate(zip(lengths, Rs)))
    (loss / len(lengths) if reduction == "mean" else loss).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-9, rtol=1e-7, msg=lambda m: f"{name}: {m}")


def test_functorch_refuses_a_packed_input_whose_output_is_not_packed():
    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = DPLSTM(4, 5, batch_first=True)

        def forward(self, x):
            return pad_packed_sequence(self.lstm(x)[0], batch_first=True)[0]

    model = Padded()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = fxdp.compiler.wrap_model(model, "functorch")
    with pytest.raises(TypeError, match="needs a PackedSequence output, whose rows say which sample each gradient "
                                        "row belongs to, but Padded.forward returned a Tensor"):
        wrapped(_packed([3, 2], 4, True, True))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_compiled_graph_refuses_a_first_batch_of_packed_sequences_with_what_to_do():
    model = Output(DPGRU(4, 5))
    compiled = fxdp.compile_for_dp(model)  # no example inputs: the first batch is analysed
    with pytest.raises(fxdp.errors.BatchDimAnalysisError, match="input 'x' is a PackedSequence, which the compiled graph "
                                                         "does not take yet; use grad_sample_mode='hooks'"):
        compiled(_packed([3, 2], 4, False, True))
    assert all(getattr(p, "grad_sample", None) is None and p.grad is None for p in model.parameters())
    # with example inputs, compile_for_dp chooses the hooks engine up front
    assert fxdp.report(fxdp.compile_for_dp(model, example_inputs=(_packed([3, 2], 4, False, True),))).engine == "hooks"
