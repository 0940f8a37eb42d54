"""transformers' ``Conv1D`` (GPT-2's projections: ``addmm(bias, x, weight)`` with the weight ``(in, out)``) gets a
hand-written per-sample rule, is folded back into a layer call in a torch.export capture, and is book-kept like
``nn.Linear``. Everything is checked against each sample run alone (a batch of one), in float64.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdp
from fxdp.grad_sample.registry import GRAD_SAMPLERS, find_grad_sampler, register_grad_sampler_by_path, rule_name
from fxdp.layout import BatchLayout
from fxdp.optim import DPOptimizer
from fxdp.sinks.bookkeeping import BookkeepingSink, plan_layer
from fxdp.sinks.contract import GradSampleSink

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from tests.end_to_end.test_hugging_face_models import (  # noqa: E402  (the tiny GPT-2 and its loss, shared)
    _assert_per_sample_gradients, _build, _causal_lm_loss, _gpt2, _padded_mask, _token_ids,
)

PROJECTIONS = ("c_attn", "c_proj", "c_fc")
MASKS = [pytest.param(True, id="padded-mask"), pytest.param(False, id="no-mask")]


def _inputs(mask: bool, n: int = 3):
    inputs = {"input_ids": _token_ids(n)}
    if mask:
        inputs["attention_mask"] = _padded_mask(n)
    return inputs


def _conv1d_names(model):
    return [name for name, m in model.named_modules() if isinstance(m, Conv1D)]


def _expected_grad_samples(model, inputs):
    """{name: (N, *p.shape)}: each sample's gradient of the causal LM loss, run alone."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    n = inputs["input_ids"].shape[0]
    rows = []
    for i in range(n):
        one = {k: v[i:i + 1] for k, v in inputs.items()}
        grads = torch.autograd.grad(_causal_lm_loss(model(**one), one), list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())])
    return {k: torch.stack([row[j] for row in rows]) for j, k in enumerate(params)}


# -- the rule and its registration ------------------------------------------------------------------------


def test_conv1d_has_the_hand_written_rule_but_not_a_subclass_that_overrides_forward():
    class Scaled(Conv1D):
        def forward(self, x):
            return 2 * super().forward(x)

    class Plain(Conv1D):
        pass

    assert rule_name(Conv1D(6, 4)) == "Conv1D" and rule_name(Plain(6, 4)) == "Conv1D"
    assert find_grad_sampler(Scaled(6, 4)) is None


@pytest.mark.parametrize("shape", [(5, 4), (5, 3, 4), (5, 2, 3, 4)])
def test_the_conv1d_rule_against_batches_of_one(shape):
    torch.manual_seed(0)
    layer = Conv1D(6, 4).double()
    x = torch.randn(*shape, dtype=torch.float64)
    compiled = fxdp.compile_for_dp(nn.Sequential(layer), example_inputs=x, loss_reduction="sum")  # torch.fx
    assert [(site.target, site.rule) for site in compiled.fxdp_batch_guard.sites] == [("0", "Conv1D")]
    (compiled(x) ** 2).sum().backward()
    for i in range(shape[0]):
        w, b = torch.autograd.grad((layer(x[i:i + 1]) ** 2).sum(), [layer.weight, layer.bias])
        torch.testing.assert_close(layer.weight.grad_sample[i], w, atol=1e-10, rtol=1e-8)
        torch.testing.assert_close(layer.bias.grad_sample[i], b, atol=1e-10, rtol=1e-8)


def test_a_rule_registered_by_class_path_waits_for_its_module():
    name = "fxdp_test_optional_library"
    register_grad_sampler_by_path(f"{name}.Layer")(lambda module, activations, backprops: {})
    layer_type = type("Layer", (nn.Linear,), {"forward": lambda self, x: x})  # another rule could not serve it
    assert find_grad_sampler(layer_type) is None
    sys.modules[name] = type(sys)(name)
    try:
        sys.modules[name].Layer = layer_type
        assert rule_name(layer_type) == "Layer"
    finally:
        del sys.modules[name]
        GRAD_SAMPLERS.by_path.pop(f"{name}.Layer")


def test_fxdp_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; import fxdp, torch; "
            "from fxdp.sinks.bookkeeping import BookkeepingSink; "
            "m = fxdp.compile_for_dp(torch.nn.Sequential(torch.nn.Linear(2, 2)), example_inputs=torch.randn(3, 2), "
            "sink=BookkeepingSink()); m(torch.randn(3, 2)).sum().backward(); "
            "assert not [m for m in sys.modules if m.startswith('transformers.')]; print('ok')")
    root = str(Path(fxdp.__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# -- GPT-2 in the graph engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", MASKS)
def test_gpt2_projections_are_folded_into_conv1d_calls_with_their_rule(mask):
    model = _build(_gpt2, "sdpa")
    inputs = _inputs(mask)
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs)
    rules = {site.target: site.rule for site in compiled.fxdp_batch_guard.sites}
    names = _conv1d_names(model)
    assert len(names) == 4 and all(rules[name] == "Conv1D" for name in names), rules
    generic = [f"{site.target}: {site.description}" for site in compiled.fxdp_batch_guard.sites
               if site.rule == "generic"]
    assert generic and not [t for t in generic if any(p in t for p in PROJECTIONS)], generic  # (wpe stays generic)
    assert ("fxdp_runtime_ops_dp_aware_layer(transformer_h_0_attn_c_attn_1, fxdp_site_transformer_h_0_attn_c_attn,"
            in compiled.code)
    assert 'transformer_h_0_attn_c_attn_1 = getattr(self.transformer.h, "0").attn.c_attn' in compiled.code
    assert not [n for n in compiled.graph.nodes if n.target is torch.ops.aten.addmm.default]
    _assert_per_sample_gradients(model, compiled, inputs, _causal_lm_loss)


@pytest.mark.parametrize("method", [None, "ghost", "per_sample"])
@pytest.mark.parametrize("mask", MASKS)
def test_gpt2_bookkeeping_norms_and_clipped_sums_against_batches_of_one(mask, method):
    model = _build(_gpt2, "sdpa")
    inputs = _inputs(mask)
    expected = _expected_grad_samples(model, inputs)
    sink = BookkeepingSink(method)
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, sink=sink)
    model.zero_grad(set_to_none=True)
    _causal_lm_loss(compiled(**inputs), inputs).backward()
    params = dict(model.named_parameters())
    for name in _conv1d_names(model):  # the first backward leaves the weight gradient to the sink
        assert params[f"{name}.weight"].grad is None, name
    norms = sink.squared_norms(params.values())
    factors = {p: torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
               for k, p in enumerate(params.values())}
    sums = sink.clipped_sums(params.values(), factors)
    for name, p in params.items():
        want = expected[name]
        torch.testing.assert_close(norms[p], want.flatten(1).pow(2).sum(1), atol=1e-10, rtol=1e-8, msg=name)
        torch.testing.assert_close(sums[p], torch.tensordot(factors[p], want, dims=1), atol=1e-10, rtol=1e-8,
                                   msg=name)
    methods = {sink.plans[m].method for m in model.modules() if isinstance(m, Conv1D)}
    assert methods == {method or "ghost"}, methods  # T = 7: ghost norms cost less than (in, out) per sample
    assert all(sink.plans[m].layer == "Conv1D" for m in model.modules() if isinstance(m, Conv1D))


def test_the_report_names_each_conv1d_book_keeping_method():
    model = _build(_gpt2, "sdpa")
    inputs = _inputs(True)
    notes = fxdp.report(fxdp.compile_for_dp(model, example_inputs=inputs, sink=BookkeepingSink())).notes
    lines = {name: [n for n in notes if f"'{name}' (Conv1D): " in n] for name in _conv1d_names(model)}
    assert all(len(found) == 1 for found in lines.values()), notes
    for name, (line,) in lines.items():
        method = line.split("(Conv1D): ")[1].split(" ")[0]
        assert method in ("ghost", "per_sample"), line
    assert not [n for n in notes if "Conv1D" in n and "materialise" in n]


def test_conv1d_on_vectors_is_book_kept_as_an_outer_product():
    plan = plan_layer(Conv1D(6, 4), [(5, 4)], (5, 6))
    assert (plan.layer, plan.method) == ("Conv1D", "outer")
    assert plan_layer(Conv1D(6, 4), [(5, 3)], (5, 6)).method == "materialise"  # not the layer's widths


class _Vectors(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = Conv1D(6, 4)

    def forward(self, x):
        return self.proj(torch.tanh(self.proj(x) @ torch.ones(6, 4, dtype=x.dtype) / 6))  # used twice


@pytest.mark.parametrize("mask", MASKS)
def test_a_dp_step_with_bookkeeping_equals_the_materialising_step(mask):
    """One DPOptimizer step (no noise) on GPT-2: the book-keeping sink and the materialising one write the
    same gradients."""
    inputs = _inputs(mask)
    grads = []
    for sink in (BookkeepingSink(), GradSampleSink()):
        model = _build(_gpt2, "sdpa")
        compiled = fxdp.compile_for_dp(model, example_inputs=inputs, sink=sink)
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=0.05,
                          expected_batch_size=3, sink=sink)
        opt.zero_grad()
        _causal_lm_loss(compiled(**inputs), inputs).backward()
        opt.step()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-12, rtol=1e-9, msg=name)


def test_a_conv1d_used_twice_on_vectors_against_batches_of_one():
    torch.manual_seed(0)
    model = _Vectors().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    sink = BookkeepingSink()
    compiled = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction="sum", sink=sink)
    (compiled(x) ** 2).sum().backward()
    assert sink.plans[model.proj].method == "outer" and sink.tied[model.proj.weight] == 2
    params = list(model.parameters())
    norms = sink.squared_norms(params)
    for k, p in enumerate(params):
        want = torch.stack([torch.autograd.grad((model(x[i:i + 1]) ** 2).sum(), p)[0] for i in range(4)])
        torch.testing.assert_close(norms[p], want.flatten(1).pow(2).sum(1), atol=1e-10, rtol=1e-8)



@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_the_hooks_engine_serves_conv1d_with_its_rule(loss_reduction):
    """The hooks engine looks rules up in the same registry: Conv1D layers get their rule there too."""
    from tests.support.per_sample_reference import batch_loss, expected_grad_samples

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(8, 6), nn.Tanh(), Conv1D(3, 8)).double()
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    want, R = expected_grad_samples(model, x)
    rule, served = find_grad_sampler(Conv1D), []
    GRAD_SAMPLERS.entries[Conv1D] = lambda m, a, g: served.append(m) or rule(m, a, g)  # conftest restores it
    hooked = fxdp.compile_for_dp(model, grad_sample_mode="hooks", loss_reduction=loss_reduction)
    assert fxdp.report(hooked).engine == "hooks"
    batch_loss(hooked(x), R, loss_reduction).backward()
    assert {id(m) for m in served} == {id(model[0]), id(model[2])}  # (also in the engine's self-check)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, want[name], atol=1e-10, rtol=1e-8, msg=name)


class _TimeFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = Conv1D(4, 6)

    def forward(self, x):  # x: (N, T, 6); the layer sees (T, N, 6)
        return self.proj(x.transpose(0, 1).contiguous()).transpose(0, 1)


@pytest.mark.parametrize("sink", [GradSampleSink, BookkeepingSink])
def test_conv1d_with_the_batch_in_dimension_1_against_batches_of_one(sink):
    """Conv1D has the batch rule of a Linear layer: the batch may sit in any dimension but the last."""
    from fxdp.passes.batch_rules.core import find_batch_rule

    class Scaled(Conv1D):
        def forward(self, x):
            return 2 * super().forward(x)

    assert find_batch_rule(Conv1D(4, 6)) is not find_batch_rule(Scaled(4, 6))
    torch.manual_seed(0)
    model = _TimeFirst().double()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    compiled = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction="sum", sink=sink())
    sites = compiled.fxdp_batch_guard.sites
    assert [(s.target, s.rule, s.layouts) for s in sites] == [("proj", "Conv1D", [BatchLayout.at(1)])]
    (compiled(x) ** 2).sum().backward()
    params = list(model.parameters())
    want = [torch.stack([torch.autograd.grad((model(x[i:i + 1]) ** 2).sum(), p)[0] for i in range(3)]) for p in params]
    if sink is GradSampleSink:
        for p, w in zip(params, want):
            torch.testing.assert_close(p.grad_sample, w, atol=1e-10, rtol=1e-8)
    else:
        norms = compiled.fxdp_sink.squared_norms(params)
        for p, w in zip(params, want):
            torch.testing.assert_close(norms[p], w.flatten(1).pow(2).sum(1), atol=1e-10, rtol=1e-8)


class _TwoReadOneInput(nn.Module):
    """Two Conv1D projections of one input on sequences (separate query and key projections): their uses read
    that input as the transposed ``g`` (A and G swapped), so the sink forms its Gram once for both ghost norms."""

    def __init__(self):
        super().__init__()
        self.q, self.k = Conv1D(5, 4), Conv1D(3, 4)

    def forward(self, x):
        return torch.tanh(self.q(x)).sum(-1) + (self.k(x) ** 2).sum(-1)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_two_conv1d_reading_one_input_share_its_gram_and_match_batches_of_one(loss_reduction):
    """Ghost norms through the shared Gram and clipped sums of two Conv1D layers on one input equal each
    sample's own gradient (float64, T = 40 so that the Gram is formed in blocks)."""
    torch.manual_seed(0)
    model = _TwoReadOneInput().double()
    x = torch.randn(3, 40, 4, dtype=torch.float64)
    sink = BookkeepingSink("ghost")
    compiled = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction=loss_reduction, sink=sink)
    out = compiled(x)
    (out.mean() if loss_reduction == "mean" else out.sum()).backward()
    assert sink.shared[model.q.weight] == 2 and sink.shared[model.k.weight] == 2
    params = list(model.parameters())
    norms = sink.squared_norms(params)
    factors = {p: torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
               for k, p in enumerate(params)}
    sums = sink.clipped_sums(params, factors)
    for p in params:
        want = torch.stack([torch.autograd.grad(model(x[i:i + 1]).sum(), p)[0] for i in range(3)])
        if loss_reduction == "mean":  # the gradient sample i alone gives: its mean over its 40 positions
            want = want / 40
        torch.testing.assert_close(norms[p], want.flatten(1).pow(2).sum(1), atol=1e-12, rtol=1e-8)
        torch.testing.assert_close(sums[p], torch.tensordot(factors[p], want, dims=1), atol=1e-12, rtol=1e-8)
