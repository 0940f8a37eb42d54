"""compile_for_dp end to end: every trainable parameter's grad_sample equals the gradient of that
sample alone, for whole models, both loss reductions, with and without example inputs; models that mix
samples or hold batch norm are refused, naming the module and the line."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from tests.support.per_sample_reference import assert_grad_samples_match, batch_loss, expected_grad_samples
from tests.support.source_lines import line_of

REDUCTIONS = ["mean", "sum"]

_spec = importlib.util.spec_from_file_location("fxdp_bench_models", Path(__file__).parents[1] / "benchmarks" / "models.py")
bench_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_models)


def mnist_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 5, stride=2, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, 10),
    )


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetGN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.Sequential(Block(4), Block(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class BareParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))
        self.scale = nn.Parameter(torch.randn(5))
        self.pos = nn.Parameter(torch.randn(3, 5))
        self.proj = nn.Parameter(torch.randn(5, 2))

    def forward(self, x):  # x: (N, 3, 4)
        h = F.linear(x, self.w) * self.scale
        h = torch.tanh(h + self.pos)
        return h @ self.proj


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mid(self.mid(self.emb(ids)))))  # mid is called twice


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)
        for p in self.a.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace this
            return self.fc(x)
        return self.fc(-x)


class TimeMajor(nn.Module):
    """Batch-first input, made time-major before the layers: hook engines with one global batch_first get
    this wrong."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.ln = nn.LayerNorm(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x):  # (N, T, 4)
        h = self.ln(torch.tanh(self.fc(x.transpose(0, 1))))  # (T, N, 6)
        return self.out(h).transpose(0, 1)


class Merged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x):  # (N, T, 4)
        n, t, d = x.shape
        h = torch.relu(self.fc(x.reshape(n * t, d)))  # (N*T, 6): batch merged with time
        return self.out(h).view(n, t, 2)


class PositionIds(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 6)
        self.pos = nn.Embedding(5, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, ids, pos_ids):  # ids (N, T), pos_ids (1, T)
        return self.head(self.tok(ids) + self.pos(pos_ids))


class Attention(nn.Module):
    """A layer with a tuple output and no hand-written rule (the generic rule, on the graph)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        out, _ = self.attn(x, x, x)
        return self.head(out)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        out, h = self.rnn(x)
        return self.head(out) + self.head(h.transpose(0, 1))


def _ids(n=4, t=5, high=10):
    return torch.randint(0, high, (n, t))


CASES = {
    "mnist_cnn": (mnist_cnn, lambda: torch.randn(3, 1, 20, 20)),
    "resnet_groupnorm_inplace": (ResNetGN, lambda: torch.randn(3, 3, 8, 8)),
    "bare_parameter": (BareParameter, lambda: torch.randn(4, 3, 4)),
    "tied_weights": (Tied, lambda: torch.randint(0, 11, (4, 3))),
    "frozen": (Frozen, lambda: torch.randn(5, 4)),
    "time_major": (TimeMajor, lambda: torch.randn(3, 5, 4)),
    "merged_batch": (Merged, lambda: torch.randn(3, 5, 4)),
    "attention": (Attention, lambda: torch.randn(3, 4, 6)),
    "recurrent_generic_rule": (Recurrent, lambda: torch.randn(3, 4, 4)),
    "benchmark_transformer": (lambda: bench_models.Transformer(vocab=20, d=16, heads=2, max_len=8),
                              lambda: torch.randint(0, 20, (3, 8))),
    "benchmark_resnet": (lambda: bench_models.ResNetGN(width=8), lambda: torch.randn(2, 3, 8, 8)),
    "position_ids": (PositionIds, lambda: (_ids(), torch.arange(5).unsqueeze(0))),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_model_gives_per_sample_gradients(case, reduction):
    torch.manual_seed(0)
    factory, make_inputs = CASES[case]
    compiled = assert_grad_samples_match(factory(), make_inputs(), loss_reduction=reduction)
    assert isinstance(compiled, torch.fx.GraphModule)
    assert fxdp.report(compiled).mode == "fx"


@pytest.mark.parametrize("case", ["mnist_cnn", "bare_parameter", "time_major", "merged_batch"])
def test_without_example_inputs_the_first_batch_is_analysed(case):
    torch.manual_seed(0)
    factory, make_inputs = CASES[case]
    compiled = assert_grad_samples_match(factory(), make_inputs(), example_inputs=False)
    rep = fxdp.report(compiled)  # the first backward judged the loss too
    assert [p.name for p in rep.passes] == ["validate", "inplace", "batch_dim", "per_sample", "loss"]


def test_compiled_code_shows_the_dp_ops():
    compiled = fxdp.compile_for_dp(BareParameter(), example_inputs=torch.randn(2, 3, 4))
    code = compiled.code
    assert "dp_aware_function" in code and "batch_size" in code
    compiled = fxdp.compile_for_dp(mnist_cnn(), example_inputs=torch.randn(2, 1, 20, 20))
    assert compiled.code.count("dp_aware_layer(") == 4  # two convs, two linears


def test_untraceable_model_falls_back_to_hooks_and_stays_correct():
    torch.manual_seed(0)
    x = torch.randn(4, 4).abs()
    compiled = assert_grad_samples_match(Untraceable(), x)
    rep = fxdp.report(compiled)
    assert not rep.traced and rep.mode == "hooks"
    assert "cannot be traced" in rep.fallback_reason
    assert rep.fallback_location.file == __file__
    assert "if x.sum() > 0" in rep.fallback_location.code
    assert "not traceable" in str(rep) or "traced: no" in str(rep)


def test_a_failing_generic_rule_names_the_node_in_the_error(monkeypatch):
    def cannot_rerun(*args, **kwargs):
        raise RuntimeError("this op cannot run on one sample")

    monkeypatch.setattr(fxdp.grad_sample.generic, "functional_grad_samples", cannot_rerun)
    compiled = fxdp.compile_for_dp(BareParameter(), example_inputs=torch.randn(4, 3, 4))
    with pytest.raises(RuntimeError, match=r"generic per-sample rule, which re-runs each sample alone as a batch of one, "
                                           r"failed on '_operator.matmul' at node 'matmul': this op cannot run on one "
                                           r"sample\. Or register a per-sample rule"):
        compiled(torch.randn(4, 3, 4)).sum().backward()


def test_outputs_equal_the_original_model():
    torch.manual_seed(0)
    model = ResNetGN()
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    compiled = fxdp.compile_for_dp(model, example_inputs=x)
    torch.testing.assert_close(compiled(x), expected)


def test_two_backward_passes_append_and_zero_grad_sample_clears():
    torch.manual_seed(0)
    model = Frozen()
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(2, 4), loss_reduction="sum")
    x1, x2 = torch.randn(3, 4), torch.randn(2, 4)
    exp1, R = expected_grad_samples(model, x1)
    exp2, _ = expected_grad_samples(model, x2)
    batch_loss(compiled(x1), R, "sum").backward()
    batch_loss(compiled(x2), R, "sum").backward()
    w = model.b.weight
    assert w.grad_sample.shape == (5, 3, 5)
    torch.testing.assert_close(w.grad_sample, torch.cat([exp1["b.weight"], exp2["b.weight"]]))
    fxdp.zero_grad_sample(compiled)
    assert w.grad_sample is None


def test_parameters_are_shared_with_the_users_model():
    model = Frozen()
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(2, 4))
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in model.parameters()}


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        fxdp.compile_for_dp(Frozen(), loss_reduction="avg")
    with pytest.raises(ValueError, match="unknown grad_sample_mode 'magic'; valid modes are 'fx', 'hooks'"):
        fxdp.compile_for_dp(Frozen(), grad_sample_mode="magic")
    with pytest.raises(ValueError, match="batch_dim must be 0"):
        fxdp.compile_for_dp(Frozen(), batch_dim=2)


def test_report_of_a_plain_model_is_a_clear_error():
    with pytest.raises(ValueError, match="not produced by fxdp.compile_for_dp"):
        fxdp.report(nn.Linear(2, 2))


@pytest.mark.parametrize("case", ["merged_batch", "time_major", "position_ids", "mnist_cnn"])
@pytest.mark.parametrize("n", [1, 7])
def test_batches_of_another_size_than_the_example(case, n):
    """Layouts are positions, not sizes: a model compiled on a batch of 3 serves batches of 1 and 7."""
    torch.manual_seed(0)
    factory, make_inputs = CASES[case]
    model = factory()
    example = make_inputs()
    example = example if isinstance(example, tuple) else (example,)
    batch = tuple(torch.cat([x] * 3)[:n] if x.shape[0] == example[0].shape[0] else x for x in example)
    expected, R = expected_grad_samples(model, batch)
    compiled = fxdp.compile_for_dp(model, example_inputs=example, loss_reduction="sum")
    batch_loss(compiled(*batch), R, "sum").backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-5, rtol=1e-4)


def test_without_example_inputs_a_mixing_model_is_refused_on_the_first_batch():
    compiled = fxdp.compile_for_dp(Centre())
    for _ in range(2):  # and it stays refused
        with pytest.raises(fxdp.errors.BatchMixingError, match="mixes samples"):
            compiled(torch.randn(3, 4))


# -- refusals ------------------------------------------------------------------------------------------------


class Centre(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x - x.mean(0))


def test_compile_refuses_a_model_that_mixes_samples_with_the_findings_table():
    with pytest.raises(fxdp.errors.BatchMixingError, match="mixes samples across the batch dimension") as info:
        fxdp.compile_for_dp(Centre(), torch.randn(3, 4))
    assert any(f.line == line_of(Centre.forward, "x - x.mean(0)") for f in
               (finding.location for finding in info.value.findings))


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_compile_refuses_batch_norm_naming_the_module_and_line():
    with pytest.raises(fxdp.errors.NotPrivateError, match="ModuleValidator.fix") as info:
        fxdp.compile_for_dp(WithBatchNorm(), torch.randn(2, 3, 6, 6))
    bn = [f for f in info.value.findings if f.pass_name == "validate"]
    assert [(f.node, f.op) for f in bn] == [("bn", "nn.BatchNorm2d")]
    assert bn[0].location.line == line_of(WithBatchNorm.forward, "self.bn(self.conv(x))")


def test_strict_validation_raises_the_validators_error_not_a_pass_error():
    from fxdp.validators import UnsupportedModuleError

    with pytest.raises(UnsupportedModuleError, match="bn"):
        fxdp.compile_for_dp(WithBatchNorm(), torch.randn(2, 3, 6, 6), strict=True)


def test_fixed_model_compiles():
    fixed = fxdp.validators.ModuleValidator.fix(WithBatchNorm())
    compiled = fxdp.compile_for_dp(fixed, torch.randn(2, 3, 6, 6))
    assert fxdp.report(compiled).errors == ()
