"""Real-model pieces: subclasses of layers that override ``forward``, parametrized layers
(weight_norm, spectral_norm, a user's parametrization), torchvision's blocks, RNNs over packed sequences.

The checks compare ``p.grad_sample`` with batches of one, in the graph engine (``fx``, not the
whole-model fallback) and in the hooks engine; packed sequences run in the hooks engine (fx cannot
trace pack_padded_sequence), which the report says.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fxdp
from fxdp.grad_sample.conv import conv_grad_sample
from fxdp.grad_sample.embedding import embedding_grad_sample
from fxdp.grad_sample.linear import linear_grad_sample
from fxdp.grad_sample.registry import PARAMETRIZED, find_grad_sampler, register_grad_sampler, rule_name
from fxdp.passes.batch_rules import find_batch_rule
from fxdp.frontends.fx import is_leaf_layer
from tests.support.per_sample_reference import assert_grad_samples_match, batch_loss, expected_grad_samples
from tests.support.torchvision_like import TINY, ShiftedWindowAttention, StochasticDepth, tiny_convnext, tv_ops, tv_swin

N = 4


pytestmark = pytest.mark.usefixtures("float64")  # tight comparisons (tests/support/fixtures.py)


def engine_of(compiled) -> str:
    return fxdp.report(compiled).engine


# --------------------------------------------------------------------------------------------
# Subclasses that override forward
# --------------------------------------------------------------------------------------------


class CosineLinear(nn.Linear):
    """A Linear whose rows are normalised in forward: the Linear rule would be wrong for it."""

    def forward(self, x):
        return F.linear(x, F.normalize(self.weight, dim=1), self.bias)


class ScaledConv(nn.Conv2d):
    def forward(self, x):
        return self._conv_forward(x, self.weight * 2.0, self.bias).tanh()


class PositionsFromMask(nn.Embedding):
    """Like OPT's learned positional embedding: fed the attention mask, positions by cumsum."""

    def __init__(self, num_positions: int, dim: int, offset: int = 2):
        super().__init__(num_positions + offset, dim)
        self.offset = offset

    def forward(self, attention_mask):
        positions = (torch.cumsum(attention_mask, dim=1) * attention_mask).long() - 1
        return super().forward(positions + self.offset)


class PlainLinear(nn.Linear):
    pass


class Head(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.layer(x)))


class MaskModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = PositionsFromMask(6, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, mask):
        return self.out(self.pos(mask)).sum(1)


def padded_mask(n=N, t=5):
    mask = torch.ones(n, t)
    for i in range(n):
        mask[i, : i % t] = 0  # left padding of different lengths
    return mask


def test_a_rule_serves_a_subclass_only_if_it_keeps_the_forward():
    assert find_grad_sampler(CosineLinear(3, 3)) is None and rule_name(CosineLinear) is None
    assert find_grad_sampler(ScaledConv(1, 1, 1)) is None
    assert find_grad_sampler(PositionsFromMask(3, 2)) is None
    assert find_grad_sampler(PlainLinear(3, 3)) is linear_grad_sample and rule_name(PlainLinear) == "Linear"
    assert find_grad_sampler(nn.Conv2d(1, 1, 1)) is conv_grad_sample
    assert find_grad_sampler(nn.Embedding(2, 2)) is embedding_grad_sample
    # the batch rules of layers follow the same lookup, and so does the tracer
    assert find_batch_rule(CosineLinear(3, 3)) is None
    assert find_batch_rule(PlainLinear(3, 3)) is find_batch_rule(nn.Linear(3, 3)) is not None
    assert not is_leaf_layer(CosineLinear(3, 3)) and is_leaf_layer(PlainLinear(3, 3))
    # torch's own families keep their rules (LSTM overrides RNNBase's forward)
    assert find_batch_rule(nn.LSTM(2, 2)) is find_batch_rule(nn.GRU(2, 2)) is not None
    assert find_batch_rule(nn.CrossEntropyLoss()) is not None and find_batch_rule(nn.BatchNorm2d(2)) is not None


def test_type_registry_serves_subclasses_by_its_own_policy():
    from fxdp.registry import TypeRegistry

    class Base:
        def forward(self):
            return 1

    class Same(Base):
        pass

    class Overrides(Same):
        def forward(self):
            return 2

    class Below(Overrides):  # inherits the override
        pass

    rules = TypeRegistry(unless_overridden="forward")
    rules.register(Base)("base rule")
    assert [rules.find(c) for c in (Base, Same, Overrides, Below)] == ["base rule", "base rule", None, None]
    assert rules.owner(Below) is None and rules.owner(Same) is Base
    rules.register(Overrides)("own rule")
    assert rules.find(Below) == "own rule"
    saved = rules.snapshot()
    rules.register(Base, subclasses=True)("any subclass")
    assert rules.find(Same) == "any subclass" and rules.find(Below) == "own rule"
    rules.restore(saved)
    assert rules.find(Same) == "base rule" and rules.find(Overrides) == "own rule"
    validators = TypeRegistry()  # no policy: every subclass, as validators want
    validators.register(Base)("check")
    assert validators.find(Below) == "check"


def test_an_instance_that_replaces_forward_has_no_rule():
    layer = nn.Linear(3, 3)
    layer.forward = lambda x: F.linear(x, layer.weight.exp())
    assert find_grad_sampler(layer) is None


def test_a_rule_registered_for_subclasses_serves_those_that_override_forward():
    class Base(nn.Linear):
        pass

    class Override(Base):
        def forward(self, x):
            return super().forward(x) * 2

    @register_grad_sampler(Base, subclasses=True)
    def rule(module, activations, backprops):
        return {}

    assert find_grad_sampler(Override(2, 2)) is rule
    register_grad_sampler(Base)(rule)  # registered again without: the override is no longer served
    assert find_grad_sampler(Override(2, 2)) is None and find_grad_sampler(Base(2, 2)) is rule


def test_validators_still_see_subclasses_that_override_forward():
    class MyBatchNorm(nn.BatchNorm1d):
        def forward(self, x):
            return super().forward(x) * 2

    errors = fxdp.validators.ModuleValidator.validate(nn.Sequential(MyBatchNorm(3)), strict=False)
    assert errors, "a BatchNorm subclass keeps running statistics, whatever its forward"


@pytest.mark.parametrize("mode", ["fx", "hooks"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cosine_linear_gets_its_own_per_sample_gradients(mode, reduction):
    torch.manual_seed(0)
    model = Head(CosineLinear(5, 3))
    x = torch.randn(N, 5)
    compiled = assert_grad_samples_match(model, x, loss_reduction=reduction, mode=mode, atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == mode


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_conv_subclass_that_overrides_forward(mode):
    torch.manual_seed(1)
    model = nn.Sequential(ScaledConv(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 5 * 5, 2))
    compiled = assert_grad_samples_match(model, torch.randn(N, 2, 5, 5), mode=mode, atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == mode


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_embedding_fed_the_attention_mask(mode):
    torch.manual_seed(2)
    model = MaskModel()
    compiled = assert_grad_samples_match(model, padded_mask(), mode=mode, atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == mode


def test_a_plain_subclass_keeps_the_parent_rule_in_the_graph():
    torch.manual_seed(3)
    compiled = assert_grad_samples_match(Head(PlainLinear(5, 3)), torch.randn(N, 5), atol=1e-9, rtol=1e-7)
    text = str(fxdp.report(compiled))
    assert engine_of(compiled) == "fx" and "Linear rule" in text


def test_the_report_says_the_cosine_linear_was_traced_into():
    compiled = fxdp.compile_for_dp(Head(CosineLinear(5, 3)), example_inputs=torch.randn(N, 5))
    report = fxdp.report(compiled)
    assert report.engine == "fx"
    rewrites = [f for f in report.changes if f.pass_name == "per_sample" and f.node == "linear"]
    assert rewrites and "layer.weight" in rewrites[0].message and "generic rule" in rewrites[0].message


# --------------------------------------------------------------------------------------------
# Parametrized layers
# --------------------------------------------------------------------------------------------


class Unit(nn.Module):
    """A user parametrization: rows of unit norm."""

    def forward(self, w):
        return w / w.norm(dim=1, keepdim=True)


def weight_normed():
    return parametrizations.weight_norm(nn.Linear(5, 3))


def user_parametrized():
    layer = nn.Linear(5, 3)
    parametrize.register_parametrization(layer, "weight", Unit())
    return layer


def weight_normed_conv():
    return parametrizations.weight_norm(nn.Conv1d(5, 3, 1))


class Squeeze(nn.Module):
    def forward(self, x):
        return x.squeeze(-1)


@pytest.mark.parametrize("mode", ["fx", "hooks"])
@pytest.mark.parametrize("make", [weight_normed, user_parametrized])
def test_parametrized_linear_real_parameters_get_per_sample_gradients(mode, make):
    torch.manual_seed(4)
    model = Head(make())
    compiled = assert_grad_samples_match(model, torch.randn(N, 5), mode=mode, atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == mode


def test_parametrized_conv():
    torch.manual_seed(5)
    model = nn.Sequential(weight_normed_conv(), Squeeze(), nn.Linear(3, 2))
    compiled = assert_grad_samples_match(model, torch.randn(N, 5, 1), atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == "fx"


def test_the_report_does_not_call_a_weight_normed_layer_linear():
    compiled = fxdp.compile_for_dp(Head(weight_normed()), example_inputs=torch.randn(N, 5))
    rewrites = [f for f in fxdp.report(compiled).changes if f.pass_name == "per_sample" and f.node == "layer"]
    assert rewrites and PARAMETRIZED in rewrites[0].message and "Linear rule" not in rewrites[0].message


def test_the_report_notes_the_real_parameters_of_a_parametrized_layer():
    report = fxdp.inspect(Head(weight_normed()), torch.randn(N, 5))
    notes = [f for f in report.findings if f.pass_name == "validate" and f.node == "layer"]
    assert notes and "`parametrizations.weight.original0`" in notes[0].message and "not the rule of Linear" in notes[0].message


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = parametrizations.spectral_norm(nn.Linear(3, 3))

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))


def test_spectral_norm_called_twice_in_training_is_an_error_and_fine_in_eval():
    report = fxdp.inspect(Twice(), torch.randn(N, 3))
    errors = [f for f in report.errors if f.pass_name == "validate"]
    assert errors and "called 2 times" in errors[0].message and "parametrizations.eval()" in errors[0].fix
    model = Twice()
    model.layer.parametrizations.eval()
    assert not [f for f in fxdp.inspect(model, torch.randn(N, 3)).errors if f.pass_name == "validate"]
    compiled = assert_grad_samples_match(model, torch.randn(N, 3), atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == "fx"


def test_spectral_norm_called_twice_in_training_is_refused_by_the_hooks_engine_too():
    model = Twice()
    compiled = fxdp.GradSampleModule(model)  # the compiler refuses it before it runs (test above)
    with pytest.raises(RuntimeError, match="called more than once"):
        compiled(torch.randn(N, 3)).sum().backward()
    model.layer.parametrizations.eval()
    model.zero_grad()
    compiled(torch.randn(N, 3)).sum().backward()  # in eval mode the buffers stay put: fine
    assert model.layer.parametrizations.weight.original.grad_sample.shape == (N, 3, 3)


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_spectral_norm_in_training_uses_this_forwards_power_iteration(mode):
    """The per-sample gradient of the forward that ran: u and v updated once by it, then constants."""
    torch.manual_seed(6)
    model = Head(parametrizations.spectral_norm(nn.Linear(5, 3)))
    plain = copy.deepcopy(model)
    x = torch.randn(N, 5)
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,), grad_sample_mode=mode)
    out = compiled(x)
    plain(x)  # the same forward without fxdp: one step of power iteration
    buffers = dict(model.named_buffers())
    for name, b in plain.named_buffers():
        torch.testing.assert_close(buffers[name], b, atol=0, rtol=0)  # no extra update by fxdp
    # reference: that forward's u, v as constants (eval mode uses the buffers as they are), batches of one
    reference = copy.deepcopy(model)
    reference.layer.parametrizations.eval()
    expected, R = expected_grad_samples(reference, (x,))
    batch_loss(out, R, "mean").backward()
    for name, b in plain.named_buffers():
        torch.testing.assert_close(buffers[name], b, atol=0, rtol=0)  # the backward changed nothing
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-9, rtol=1e-7, msg=lambda m: f"{name}: {m}")
    assert engine_of(compiled) == mode
    assert {"layer.parametrizations.weight.original", "layer.bias"} <= {n for n, _ in model.named_parameters()}


# --------------------------------------------------------------------------------------------
# torchvision's blocks
# --------------------------------------------------------------------------------------------
# Small re-implementations (tests/support/torchvision_like.py) stand in for torchvision, which cannot be
# installed here; the real models are tested further down when torchvision is importable.


@pytest.mark.parametrize("name", list(TINY))
def test_torchvision_blocks_stay_in_the_graph_engine(name):
    torch.manual_seed(7)
    compiled = assert_grad_samples_match(TINY[name](), torch.randn(N, 3, 12, 12), atol=1e-9, rtol=1e-7)
    report = fxdp.report(compiled)
    assert report.engine == "fx", str(report)
    assert not [f for f in report.findings if f.severity.name in ("ERROR", "WARNING")], str(report)


@pytest.mark.parametrize("name", list(TINY))
def test_stochastic_depth_in_eval_is_the_identity_in_the_graph(name):
    torch.manual_seed(8)
    model = TINY[name](p=0.5)
    for m in model.modules():
        if isinstance(m, StochasticDepth):
            m.eval()
    compiled = assert_grad_samples_match(model, torch.randn(N, 3, 12, 12), atol=1e-9, rtol=1e-7)
    assert engine_of(compiled) == "fx"


@pytest.mark.parametrize("name", list(TINY))
def test_stochastic_depth_in_training_keeps_samples_apart(name):
    """A random mask per sample: no batch of one can reproduce it, so check what defines the rows:
    they add up to the batch gradient, and a sample whose every branch was dropped still gets the
    gradient of its skip connections only (checked by comparing against a model with the masks fixed)."""
    torch.manual_seed(9)
    model = TINY[name](p=0.5)
    x = torch.randn(N, 3, 12, 12)
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,))
    assert engine_of(compiled) == "fx"
    out = compiled(x)
    out.sum().backward()
    for name_, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample.sum(0), p.grad * N, msg=lambda m: f"{name_}: {m}")


def test_stochastic_depth_rows_are_the_per_sample_gradients_of_the_masks_drawn():
    """Draw the same masks again (same seed) in the reference, sample by sample."""
    torch.manual_seed(10)
    model = tiny_convnext(p=0.5)
    x = torch.randn(N, 3, 12, 12)
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,), loss_reduction="sum")
    torch.manual_seed(11)
    compiled(x).sum().backward()
    torch.manual_seed(11)
    masks = [torch.empty(N, 1, 1, 1).bernoulli_(0.5) for _ in range(2)]  # the two blocks, in order
    reference = copy.deepcopy(model)
    for block, mask in zip([reference[2], reference[5]], masks):
        block.stochastic_depth = _FixedMask(mask * 2.0)
    for i in range(N):
        reference.zero_grad()
        for block, mask in zip([reference[2], reference[5]], masks):
            block.stochastic_depth.row = i
        reference(x[i:i + 1]).sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad_sample[i], q.grad, atol=1e-9, rtol=1e-7, msg=lambda m: f"{name}: {m}")


class _FixedMask(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask, self.row = mask, 0

    def forward(self, x):
        return x * self.mask[self.row]


def test_torchvision_functions_are_named_as_torchvision_names_them():
    from fxdp.diagnostics import op_name

    assert op_name(tv_ops.stochastic_depth) == "torchvision.ops.stochastic_depth"
    assert op_name(tv_swin.shifted_window_attention) == "torchvision.models.swin_transformer.shifted_window_attention"
    assert find_batch_rule(tv_ops.stochastic_depth) is not None


def test_a_window_attention_fed_the_batch_elsewhere_is_a_finding():
    class TimeMajor(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = ShiftedWindowAttention(4, [3, 3], [0, 0], 2)

        def forward(self, x):  # (N, H, W, C) -> (H, N, W, C): the attention now treats H as the batch
            return self.attn(x.transpose(0, 1)).transpose(0, 1)

    findings = fxdp.find_batch_dim_violations(TimeMajor(), torch.randn(N, 3, 3, 4))
    assert any("window attention" in f.message and "samples are combined" in f.message for f in findings)


def test_library_files_are_torch_and_fxdp_not_their_siblings():
    import os

    from fxdp.diagnostics.source import is_library_file

    torch_dir = os.path.dirname(torch.__file__)
    site = os.path.dirname(torch_dir)
    assert is_library_file(os.path.join(torch_dir, "nn", "modules", "linear.py"))
    assert is_library_file(fxdp.__file__)
    assert not is_library_file(os.path.join(site, "torchvision", "ops", "stochastic_depth.py"))
    assert not is_library_file(os.path.join(site, "torchaudio", "models", "wav2vec2.py"))
    assert not is_library_file(os.path.join(os.path.dirname(os.path.dirname(fxdp.__file__)) + "_other", "x.py"))


# the real torchvision models, when torchvision can be imported (tiny inputs, stochastic depth 0)


def _torchvision_model(name):
    tv = pytest.importorskip("torchvision")
    import functools

    if name == "efficientnet_b0":  # BatchNorm cannot be private: GroupNorm, as ModuleValidator.fix would
        return tv.models.efficientnet_b0(num_classes=3, stochastic_depth_prob=0.0, dropout=0.0,
                                         norm_layer=functools.partial(nn.GroupNorm, 1))
    if name == "convnext_tiny":
        return tv.models.convnext_tiny(num_classes=3, stochastic_depth_prob=0.0)
    # swin_t fixes its stochastic depth at 0.2: the same architecture, built with swin_t's settings and depth 0
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                           window_size=[7, 7], stochastic_depth_prob=0.0, num_classes=3)


@pytest.mark.parametrize("name", ["efficientnet_b0", "convnext_tiny", "swin_t"])
def test_torchvision_models_stay_in_the_graph_engine(name):
    torch.manual_seed(12)
    model = _torchvision_model(name)
    size = 64 if name == "swin_t" else 32
    compiled = assert_grad_samples_match(model, torch.randn(2, 3, size, size), atol=1e-7, rtol=1e-5)
    assert engine_of(compiled) == "fx", str(fxdp.report(compiled))


# --------------------------------------------------------------------------------------------
# Recurrent layers over packed sequences
# --------------------------------------------------------------------------------------------


class PackedRNN(nn.Module):
    def __init__(self, cls=nn.LSTM, enforce_sorted=False, with_state=False, **rnn_kwargs):
        super().__init__()
        self.emb, self.out = nn.Linear(3, 4), nn.Linear(5 * (2 if rnn_kwargs.get("bidirectional") else 1), 2)
        self.rnn = cls(4, 5, batch_first=True, **rnn_kwargs)
        self.enforce_sorted, self.with_state, self.cls = enforce_sorted, with_state, cls
        layers = rnn_kwargs.get("num_layers", 1) * (2 if rnn_kwargs.get("bidirectional") else 1)
        self.h0 = nn.Parameter(torch.randn(layers, 1, 5))  # a learned initial state, expanded per sample

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=self.enforce_sorted)
        if self.with_state:
            h0 = self.h0.expand(-1, x.shape[0], -1).contiguous() * 1.0
            state = (h0, torch.zeros_like(h0)) if self.cls is nn.LSTM else h0
            out, _ = self.rnn(packed, state)
        else:
            out, _ = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.out(out).sum(1)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_packed_sequences_get_correct_per_sample_gradients(cls, enforce_sorted):
    torch.manual_seed(13)
    lengths = torch.tensor([6, 5, 3, 2]) if enforce_sorted else torch.tensor([3, 6, 2, 5])
    model = PackedRNN(cls, enforce_sorted)
    model.h0.requires_grad_(False)  # not used without a state
    compiled = assert_grad_samples_match(model, (torch.randn(N, 6, 3), lengths), atol=1e-9, rtol=1e-7)
    report = fxdp.report(compiled)
    assert report.engine == "hooks" and "cannot be traced" in report.fallback_reason


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_packed_bidirectional_two_layer_lstm_with_an_initial_state(reduction):
    torch.manual_seed(14)
    model = PackedRNN(nn.LSTM, with_state=True, num_layers=2, bidirectional=True)
    model.h0.requires_grad_(False)  # a parameter outside the RNN that only the hooks' parent sees
    assert_grad_samples_match(model, (torch.randn(N, 6, 3), torch.tensor([3, 6, 1, 5])), loss_reduction=reduction,
                              atol=1e-9, rtol=1e-7)


class PackedLastState(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.out = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x, lengths):
        _, h = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        return self.out(h[-1])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_loss_on_the_last_state_of_a_packed_rnn_gets_correct_per_sample_gradients(reduction):
    # the hooks engine runs stock recurrent layers step by step (fxdp.runtime.recurrent): every output,
    # the last state too, reaches the per-sample gradients (before, a loss on it was refused)
    torch.manual_seed(15)
    compiled = assert_grad_samples_match(PackedLastState(), (torch.randn(N, 5, 3), torch.tensor([2, 5, 3, 4])),
                                         loss_reduction=reduction, atol=1e-9, rtol=1e-7)
    assert compiled.grad_sample_layers["rnn"] == "recurrent rule"


class TakesPacked(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.rnn, self.out = cls(3, 5), nn.Linear(5, 2)

    def forward(self, packed):
        _, state = self.rnn(packed)
        h = state[0] if isinstance(state, tuple) else state
        return self.out(h[-1])


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_a_packed_sequence_given_to_the_model_runs_on_the_hooks_engine_with_correct_gradients(cls):
    torch.manual_seed(15)
    model = TakesPacked(cls).double()
    reference = copy.deepcopy(model)  # before fxdp hooks into the model
    x, lengths = torch.randn(6, 3, 3, dtype=torch.float64), torch.tensor([4, 6, 2])
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    compiled = fxdp.compile_for_dp(model, (packed,), loss_reduction="sum")
    report = fxdp.report(compiled)
    assert report.engine == "hooks" and "example input 0 is a PackedSequence" in report.fallback_reason
    compiled(packed).pow(2).sum().backward()  # its self-check splits and perturbs the packed sequences
    assert compiled.verification == ("verified on a batch of 3: outputs independent across samples, per-sample "
                                     "gradients equal to batches of one")
    for i, length in enumerate(lengths.tolist()):
        alone = copy.deepcopy(reference)
        alone(pack_padded_sequence(x[:length, i:i + 1], [length])).pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), alone.parameters()):
            torch.testing.assert_close(p.grad_sample[i], q.grad, atol=1e-10, rtol=1e-8, msg=name)
