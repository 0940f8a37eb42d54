"""The non-compiled engines (hooks, ew, functorch, no_op) against per-sample loops over batches of one.

Sample i's loss is ``(out_i * R).sum()`` with a fixed random R; the batch loss is the sum or the mean of
the samples' losses, and ``p.grad_sample[i]`` must equal the gradient sample i gives when it is run
alone. Models run in float64 so that the comparison can be tight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

import fxdp.grad_sample  # noqa: F401  (registers the built-in rules)
from fxdp.compiler import wrap_model
from fxdp.engines import (
    ExpandedWeightsGradSampleModule,
    FunctorchGradSampleModule,
    GradSampleModule,
    NoOpGradSampleModule,
)
from fxdp.grad_sample.registry import _GRAD_SAMPLERS, register_grad_sampler

REDUCTIONS = ("mean", "sum")
TOL = dict(atol=1e-10, rtol=1e-8)


# -- reference -------------------------------------------------------------------------------------


def _sample(x, i, batch_dim):
    return x.narrow(batch_dim, i, 1)


def loop_grad_samples(model, inputs, batch_dim=0, seed=0):
    """{name: (N, *shape)}: each sample run alone, and the projection R (one sample's output shape)."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    n = inputs[0].shape[batch_dim]
    with torch.no_grad():
        one = model(*(_sample(x, 0, batch_dim) for x in inputs))
    R = torch.randn(one.shape, generator=torch.Generator().manual_seed(seed), dtype=one.dtype)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(n):
        loss = (model(*(_sample(x, i, batch_dim) for x in inputs)) * R).sum()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())])
    return {name: torch.stack([row[k] for row in rows]) for k, name in enumerate(params)}, R


def batch_loss(out, R, reduction, batch_dim=0):
    loss = (out * R).sum()
    return loss / out.shape[batch_dim] if reduction == "mean" else loss


def assert_engine_matches_loop(model, inputs, mode, reduction, *, batch_first=True):
    """Wrap a copy of ``model`` with ``mode``, one backward, compare every grad_sample with the loop."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    batch_dim = 0 if batch_first else 1
    model = copy.deepcopy(model)
    expected, R = loop_grad_samples(model, inputs, batch_dim)
    wrapped = wrap_model(model, mode, batch_first=batch_first, loss_reduction=reduction)
    batch_loss(wrapped(*inputs), R, reduction, batch_dim).backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert getattr(p, "grad_sample", None) is None, f"frozen {name} got a grad_sample"
            continue
        assert getattr(p, "grad_sample", None) is not None, f"{name} has no grad_sample"
        torch.testing.assert_close(p.grad_sample, expected[name], **TOL, msg=lambda m: f"{mode}/{name}: {m}")
    return wrapped, model


# -- models ----------------------------------------------------------------------------------------


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).double()


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.norm = nn.GroupNorm(1, 3)
        self.fc = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
        return self.fc(x.flatten(1))


def cnn():
    torch.manual_seed(0)
    return SmallCNN().double()


class Scaled(nn.Module):
    """A container with a bare parameter used functionally, and a child layer."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5))
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x * self.scale)


class SharedWithChild(nn.Module):
    """The container's own parameter IS its child's weight, used both by the child and functionally."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = self.fc.weight

    def forward(self, x):
        return self.fc(x) + x @ self.w.t()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.fc2.weight = self.fc1.weight

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.fc(torch.tanh(self.fc(x))))


class InplaceAfterLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(6, 6)
        self.fc3 = nn.Linear(6, 2)

    def forward(self, x):
        h = self.act(self.fc1(x))
        y = self.fc2(h)
        y += h  # in place on a layer's output
        return self.fc3(torch.relu_(y))


class TimeMajor(nn.Module):
    """(T, N, d) in, (T, N, k) out; a bare parameter in the container too."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(4))
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x * self.gain)))


class TimeSmoothing(nn.Module):
    """No rule: mixes time steps (dim 0 of a time-major input), never samples."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):  # (T, N, 4)
        return torch.tanh(x * self.w + x.mean(0, keepdim=True))


class TimeMajorWithCustomLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.smooth = TimeSmoothing()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.smooth(x))


def build(cls):
    torch.manual_seed(0)
    return cls().double()


def x_of(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


# -- the engines on the same models ----------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
def test_mlp(mode, reduction):
    assert_engine_matches_loop(mlp(), x_of(6, 5), mode, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
def test_cnn(mode, reduction):
    assert_engine_matches_loop(cnn(), x_of(4, 2, 8, 8), mode, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
def test_tied_weights_sum_both_uses(mode, reduction):
    _, model = assert_engine_matches_loop(build(Tied), x_of(5, 4), mode, reduction)
    assert model.fc1.weight.grad_sample.shape == (5, 4, 4)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
def test_module_called_twice_sums_both_calls(mode, reduction):
    assert_engine_matches_loop(build(Twice), x_of(5, 4), mode, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_bare_parameter_used_functionally(mode, reduction):
    assert_engine_matches_loop(build(Scaled), x_of(5, 5), mode, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_container_parameter_tied_to_child_is_not_counted_twice(mode, reduction):
    _, model = assert_engine_matches_loop(build(SharedWithChild), x_of(5, 4), mode, reduction)
    assert model.w is model.fc.weight


def test_hooks_container_parameter_puts_its_whole_subtree_under_the_generic_rule():
    dp = GradSampleModule(build(Scaled))
    assert dp.grad_sample_layers == {"<model>": "generic (its whole subtree)"}
    assert dp.generic_fallbacks == ["<model>"]


class CalledAndFunctional(nn.Module):
    """A child layer called, and its weight also used functionally by the parent."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.fc(x) + F.linear(x, self.fc.weight) * self.w


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_hooks_counts_a_child_weight_called_and_used_functionally(reduction):
    assert_engine_matches_loop(build(CalledAndFunctional), x_of(5, 4), "hooks", reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
def test_frozen_layer_gets_no_grad_sample(mode, reduction):
    model = mlp()
    model[0].requires_grad_(False)
    _, copy_ = assert_engine_matches_loop(model, x_of(4, 5), mode, reduction)
    assert getattr(copy_[0].weight, "grad_sample", None) is None
    assert copy_[2].weight.grad_sample.shape == (4, 3, 7)


def test_hooks_layer_frozen_after_wrapping_gets_no_grad_sample():
    model = mlp()
    dp = GradSampleModule(model)
    model[2].requires_grad_(False)
    x = x_of(4, 5)
    expected, R = loop_grad_samples(copy.deepcopy(model), x)  # a copy: the model's hooks would record the loop
    batch_loss(dp(x), R, "mean").backward()
    assert getattr(model[2].weight, "grad_sample", None) is None
    torch.testing.assert_close(model[0].weight.grad_sample, expected["0.weight"], **TOL)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_inplace_ops_after_a_linear(mode, reduction):
    assert_engine_matches_loop(build(InplaceAfterLinear), x_of(5, 4), mode, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_batch_second_time_major_model(mode, reduction):
    _, model = assert_engine_matches_loop(build(TimeMajor), x_of(3, 5, 4), mode, reduction, batch_first=False)
    assert model.fc1.weight.grad_sample.shape == (5, 5, 4)  # N = 5 rows, although T = 3 comes first
    assert model.gain.grad_sample.shape == (5, 4)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_batch_second_layer_without_a_rule_runs_in_its_own_layout(mode, reduction):
    _, model = assert_engine_matches_loop(
        build(TimeMajorWithCustomLayer), x_of(3, 5, 4), mode, reduction, batch_first=False
    )
    assert model.smooth.w.grad_sample.shape == (5, 4)


@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
def test_two_backward_passes_append_and_zero_grad_clears(mode):
    model = mlp()
    dp = wrap_model(model, mode, loss_reduction="mean")
    x1, x2 = x_of(3, 5), x_of(2, 5) * 2
    expected1, R = loop_grad_samples(copy.deepcopy(model), x1)
    expected2, _ = loop_grad_samples(copy.deepcopy(model), x2)
    batch_loss(dp(x1), R, "mean").backward()
    batch_loss(dp(x2), R, "mean").backward()
    for name, p in model.named_parameters():
        assert p.grad_sample.shape == (5, *p.shape)
        torch.testing.assert_close(p.grad_sample, torch.cat([expected1[name], expected2[name]]), **TOL)
    dp.zero_grad()
    for p in model.parameters():
        assert getattr(p, "grad_sample", None) is None
        assert p.grad is None
    # after clearing, the next batch starts from its own rows
    batch_loss(dp(x2), R, "mean").backward()
    torch.testing.assert_close(model[0].weight.grad_sample, expected2["0.weight"], **TOL)


class Attention(nn.Module):
    """MultiheadAttention has parameters of its own, and uses its child out_proj's without calling it."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x, mask=None):
        if mask is None:
            y, _ = self.attn(x, x, x, need_weights=False)
        else:
            y, _ = self.attn(x, x, x, key_padding_mask=mask)
        return self.fc(y)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_attention_called_with_keywords_and_a_child_used_without_being_called(mode, reduction):
    wrapped, model = assert_engine_matches_loop(build(Attention), x_of(3, 5, 4), mode, reduction)
    assert model.attn.out_proj.weight.grad_sample.shape == (3, 4, 4)
    if mode == "hooks":
        assert wrapped.grad_sample_layers["attn"] == "generic (its whole subtree)"


def test_hooks_generic_rule_refuses_tensor_keyword_arguments():
    dp = GradSampleModule(build(Attention))
    x = x_of(3, 5, 4)
    with pytest.raises(TypeError) as info:
        dp(x, torch.zeros(3, 5, dtype=torch.bool))
    assert (
        "module 'attn' (MultiheadAttention) was called with tensor keyword argument(s) 'key_padding_mask'; "
        "the hooks engine's generic rule only knows where the batch is in positional inputs" in str(info.value)
    )


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 4),
    t=st.integers(1, 3),
    d_in=st.integers(1, 4),
    d_out=st.integers(1, 3),
    batch_first=st.booleans(),
    reduction=st.sampled_from(REDUCTIONS),
    mode=st.sampled_from(["hooks", "functorch"]),
)
def test_sequence_mlp_over_shapes(n, t, d_in, d_out, batch_first, reduction, mode):
    torch.manual_seed(n * 100 + t * 10 + d_in)
    model = nn.Sequential(nn.Linear(d_in, 3), nn.ReLU(), nn.LayerNorm(3), nn.Linear(3, d_out)).double()
    shape = (n, t, d_in) if batch_first else (t, n, d_in)
    assert_engine_matches_loop(model, x_of(*shape), mode, reduction, batch_first=batch_first)


# -- GradSampleModule ------------------------------------------------------------------------------


def test_hooks_wrapper_shares_parameters_and_leaves_user_modules_alone():
    model = mlp()
    attributes_before = {name: set(vars(m)) for name, m in model.named_modules()}
    dp = GradSampleModule(model)
    assert dp.module is model and dp._module is model
    assert [id(p) for p in dp.parameters()] == [id(p) for p in model.parameters()]
    assert {name: set(vars(m)) for name, m in model.named_modules()} == attributes_before
    x = x_of(3, 5)
    torch.testing.assert_close(dp(x), model(x))


def test_hooks_remove_hooks_stops_grad_samples():
    model = mlp()
    dp = GradSampleModule(model)
    dp.remove_hooks()
    dp(x_of(3, 5)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters())


def test_hooks_rejects_unknown_loss_reduction():
    with pytest.raises(ValueError, match=r"loss_reduction must be one of \('mean', 'sum'\), got 'avg'"):
        GradSampleModule(mlp(), loss_reduction="avg")


def test_hooks_strict_names_the_module_without_a_rule():
    with pytest.raises(ValueError) as info:
        GradSampleModule(build(Scaled), strict=True)
    assert "strict=True and no per-sample rule is registered for '<model>' (Scaled)" in str(info.value)
    assert "@fxdp.register_grad_sampler" in str(info.value)


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.w, x + self.w


def test_hooks_refuses_a_loss_that_uses_a_second_output():
    model = nn.Sequential(TwoOutputs()).double()
    dp = GradSampleModule(model, loss_reduction="sum")
    first, second = dp(x_of(3, 4))
    first.sum().backward()  # the first output alone is fine
    torch.testing.assert_close(model[0].w.grad_sample, x_of(3, 4), **TOL)
    first, second = dp(x_of(3, 4))
    with pytest.raises(RuntimeError, match=r"the loss depends on output #1 of module '0' \(TwoOutputs\)"):
        (first.sum() + second.sum()).backward()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)


@pytest.fixture
def block_rule():
    calls = []

    @register_grad_sampler(Block)
    def block_grad_sample(module, activations, backprops):
        calls.append(module)
        x = activations[0]
        return {
            module.inner.weight: torch.einsum("ni,nj->nij", backprops, x),
            module.inner.bias: backprops,
        }

    yield calls
    del _GRAD_SAMPLERS[Block]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_hooks_a_module_with_a_rule_owns_its_subtree(block_rule, reduction):
    model = nn.Sequential(Block(), nn.Tanh(), nn.Linear(4, 2)).double()
    wrapped, _ = assert_engine_matches_loop(model, x_of(5, 4), "hooks", reduction)
    assert wrapped.grad_sample_layers == {"0": "rule for Block", "2": "rule for Linear"}
    # the inner Linear is not hooked separately (it would double count); the rule runs once in the
    # engine's self-check on the first batch and once in the backward
    assert len(block_rule) == 2


# -- ExpandedWeights -------------------------------------------------------------------------------


def test_ew_refuses_batch_second():
    with pytest.raises(ValueError) as info:
        wrap_model(build(TimeMajor), "ew", batch_first=False)
    assert "grad_sample_mode='ew' (PyTorch ExpandedWeights) needs the batch in dimension 0" in str(info.value)
    assert "batch_first=False is not supported" in str(info.value)


def test_ew_refuses_torchs_own_layers_it_cannot_handle_when_built():
    # nn.MultiheadAttention runs its projections sequence first: ExpandedWeights would take the sequence for the batch
    with pytest.raises(ValueError) as info:
        ExpandedWeightsGradSampleModule(nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2)))
    message = str(info.value)
    assert "cannot compute per-sample gradients for the parameters of '1' (MultiheadAttention)" in message
    assert "Use grad_sample_mode='fx', 'hooks' or 'functorch'" in message
    with pytest.raises(ValueError, match=r"the parameters of '<model>' \(LSTM\)"):
        ExpandedWeightsGradSampleModule(nn.LSTM(4, 4))


class FunctionalLinear(nn.Module):
    """Parameters of its own, used by F.linear: ExpandedWeights computes them (as on Opacus)."""

    def __init__(self):
        super().__init__()
        self._weight = nn.Parameter(torch.randn(3, 5))
        self._bias = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return F.linear(torch.tanh(x), self._weight, self._bias)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ew_computes_a_users_module_whose_parameters_reach_f_linear(reduction):
    torch.manual_seed(0)
    assert_engine_matches_loop(build(FunctionalLinear), torch.randn(6, 4, 5, dtype=torch.float64), "ew", reduction)


def test_ew_refuses_a_users_module_with_a_parameter_it_cannot_handle_in_the_forward():
    # accepted when built, as on Opacus; the first forward names the module and the line, before any gradient
    dp = ExpandedWeightsGradSampleModule(nn.Sequential(build(Scaled)))
    with pytest.raises(RuntimeError) as info:
        dp(torch.randn(2, 5, dtype=torch.float64))
    message = str(info.value)
    assert "grad_sample_mode='ew' (PyTorch ExpandedWeights) failed in module '0' (Scaled)" in message
    assert "return self.fc(x * self.scale)" in message


class WeightUsedByParent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return x @ self.fc.weight.t()


def test_ew_failure_at_run_time_names_the_module_and_line():
    dp = wrap_model(build(WeightUsedByParent), "ew")
    with pytest.raises(RuntimeError) as info:
        dp(x_of(2, 4))
    message = str(info.value)
    assert "grad_sample_mode='ew' (PyTorch ExpandedWeights) failed in module '<model>' (WeightUsedByParent)" in message
    assert "test_engines_against_batches_of_one.py:" in message and "return x @ self.fc.weight.t()" in message
    assert "Expanded Weights encountered but cannot handle function" in message


# -- functorch and no_op ---------------------------------------------------------------------------


def test_functorch_refuses_several_outputs():
    dp = wrap_model(TwoOutputs().double(), "functorch")
    assert isinstance(dp, FunctorchGradSampleModule)
    with pytest.raises(TypeError) as info:
        dp(x_of(3, 4))
    assert (
        "grad_sample_mode='functorch' differentiates the model's output, which must be a single tensor, "
        "but TwoOutputs.forward returned a tuple of 2 values" in str(info.value)
    )


def test_no_op_computes_nothing():
    model = mlp()
    dp = wrap_model(model, "no_op")
    assert isinstance(dp, NoOpGradSampleModule)
    dp(x_of(3, 5)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters())
    model[0].weight.grad_sample = torch.zeros(3, 7, 5)  # the user's own per-sample gradients
    dp.zero_grad()
    assert model[0].weight.grad_sample is None


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        wrap_model(mlp(), "magic")
    assert str(info.value) == (
        "fxdp: unknown grad_sample_mode 'magic'; valid modes are 'fx', 'hooks', 'ew', 'functorch', 'no_op'"
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_wrap_model_fx_delegates_to_the_compiler(reduction):
    import torch.fx

    wrapped, _ = assert_engine_matches_loop(mlp(), x_of(4, 5), "fx", reduction)
    assert isinstance(wrapped, torch.fx.GraphModule)
    wrapped, _ = assert_engine_matches_loop(build(TimeMajor), x_of(3, 5, 4), "fx", reduction, batch_first=False)
    assert isinstance(wrapped, torch.fx.GraphModule)


def test_wrappers_forward_attribute_access_to_the_model():
    for mode in ("hooks", "functorch", "no_op"):
        model = build(Scaled)  # one engine per model: two would add per-sample gradients twice
        dp = wrap_model(model, mode)
        assert dp.fc is model.fc
        with pytest.raises(AttributeError, match="no_such_thing"):
            dp.no_such_thing


class BatchSecondInBatchFirstOut(nn.Module):
    """Tokens (T, N) in, one row per sample out (N, T): the batch moves from dim 1 to dim 0 (Opacus's
    privacy-engine text model does this)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(20, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(self.emb(x)).permute(1, 0, 2).reshape(x.shape[1], -1)


# (5, 5): two dims of the batch's size, told apart by a probe; (7, 1): one sample, the output's batch dim not 1
@pytest.mark.parametrize("length, n", [(7, 5), (5, 5), (7, 1)])
def test_functorch_finds_the_batch_where_the_output_has_it(length, n):
    torch.manual_seed(0)
    model, x = BatchSecondInBatchFirstOut().double(), torch.randint(0, 20, (length, n))
    weights = torch.randn(n, length, dtype=torch.float64)
    expected = []
    for i in range(n):
        model.zero_grad()
        (model(x[:, i:i + 1]) * weights[i:i + 1]).sum().backward()
        expected.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    private = FunctorchGradSampleModule(model, batch_first=False, loss_reduction="sum")
    (private(x) * weights).sum().backward()
    for k, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad_sample, torch.stack([e[k] for e in expected]))
