"""The gradient sink seam: each compiled or wrapped model delivers to its own sink (``fxdp_sink``), so
two models running backward at the same time, in two threads, each get exactly their own
``p.grad_sample`` (compared with batches of one)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import fxdp
from fxdp.sinks.contract import GradSampleSink, LayerCapture, SINK_ATTR, sink_of
from tests.support.per_sample_reference import batch_loss, expected_grad_samples

TIMEOUT = 60  # seconds a thread waits for the other at the barrier before the test fails


class TwoLayers(nn.Module):
    """A Linear with a hand-written rule, and a parameter used functionally (the generic rule)."""

    def __init__(self, d_in=5, d_hidden=4, d_out=3):
        super().__init__()
        self.fc = nn.Linear(d_in, d_hidden)
        self.scale = nn.Parameter(torch.randn(d_hidden))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) * self.scale)


class Stack(nn.Module):
    def __init__(self, d_in=5, d_hidden=4, d_out=3):
        super().__init__()
        self.fc = nn.Linear(d_in, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


def _with_barrier(model: Stack, barrier: threading.Barrier) -> Stack:
    """Wait at ``barrier`` in backward between the two layers' backward steps: both models' backward
    passes are then in flight at once, each with one capture delivered and one to come."""

    def wait(g):
        if g.shape[0] > 1:  # the batch's backward, not an engine re-running one sample with the hook
            barrier.wait(TIMEOUT)
        return g

    def hook_output(module, inputs, output):
        if output.requires_grad:
            output.register_hook(wait)

    model.fc.register_forward_hook(hook_output)
    return model


def _wrap(model, engine, x, reduction):
    if engine == "fx":
        return fxdp.compile_for_dp(model, example_inputs=x, loss_reduction=reduction)
    # verify=False: the self-check's extra backward would wait at the barrier too
    return fxdp.GradSampleModule(model, loss_reduction=reduction, verify=False)


@pytest.mark.parametrize("engines", [("fx", "fx"), ("fx", "hooks")])
def test_two_models_in_two_threads_each_get_their_own_grad_samples(engines):
    torch.manual_seed(0)
    models = [Stack().double(), Stack().double()]
    inputs = [torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)]
    reductions = ["mean", "sum"]
    expected = [expected_grad_samples(copy.deepcopy(m), x, seed=k) for k, (m, x) in enumerate(zip(models, inputs))]

    barrier = threading.Barrier(2)
    wrapped = [_wrap(_with_barrier(m, barrier), e, x, r) for m, e, x, r in zip(models, engines, inputs, reductions)]
    assert sink_of(wrapped[0]) is not sink_of(wrapped[1])
    errors = []

    def train(k):
        try:
            out = wrapped[k](inputs[k])
            batch_loss(out, expected[k][1], reductions[k]).backward()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=train, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    for k, model in enumerate(models):
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad_sample, expected[k][0][name], atol=1e-10, rtol=1e-8,
                                       msg=lambda m: f"model {k}, {name}: {m}")


@pytest.mark.parametrize("mode", ["fx", "hooks", "ew", "functorch", "no_op"])
def test_every_engine_has_its_own_sink(mode):
    model = nn.Sequential(nn.Linear(3, 2))
    first = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 3), grad_sample_mode=mode)
    if mode == "hooks":  # a second hooks engine on the same model is refused (gradients would double)
        model = nn.Sequential(nn.Linear(3, 2))
    second = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 3), grad_sample_mode=mode)
    assert isinstance(sink_of(first), GradSampleSink) and getattr(first, SINK_ATTR) is sink_of(first)
    assert sink_of(first) is not sink_of(second)
    assert sink_of(model) is None


def test_the_whole_model_engine_has_a_sink_its_op_delivers_to():
    class TransposedWeight(nn.Module):  # the weight passes through a layer first: whole-model engine
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 3))
            self.keep = nn.Identity()

        def forward(self, x):
            return x @ self.keep(self.w).t()

    compiled = fxdp.compile_for_dp(TransposedWeight(), example_inputs=torch.randn(4, 3))
    assert fxdp.report(compiled).engine == "fx+whole-model"
    assert sink_of(compiled) is compiled.fxdp_site.sink


class RecordingSink(GradSampleSink):
    def __init__(self):
        super().__init__()
        self.captures = []

    def add(self, capture: LayerCapture) -> None:
        self.captures.append(capture)
        super().add(capture)


def _record(wrapped, engine):
    sink = RecordingSink()
    if engine == "fx":
        for site in vars(wrapped).values():
            if isinstance(site, fxdp.runtime.PerSampleSite):
                site.sink = sink
    else:
        wrapped.fxdp_sink = sink
    return sink


@pytest.mark.parametrize("engine", ["fx", "hooks"])
def test_captures_carry_the_layer_its_input_and_the_summed_loss_output_gradient(engine):
    torch.manual_seed(1)
    model = Stack()
    x = torch.randn(6, 5)
    wrapped = _wrap(model, engine, x, "mean")
    sink = _record(wrapped, engine)
    wrapped(x).mean().backward()
    (head,) = [c for c in sink.captures if c.module is model.head]
    torch.testing.assert_close(head.activations[0], torch.tanh(model.fc(x)).detach())
    torch.testing.assert_close(head.backprops, torch.full((6, 3), 1 / 3))  # d mean / d out, times N
    assert set(head.params) == {model.head.weight, model.head.bias} and head.batch_size == 6
    assert model.head.weight.grad_sample.shape == (6, 3, 4)


def test_a_generic_rule_capture_carries_its_thunk_only():
    torch.manual_seed(2)
    model = TwoLayers()
    x = torch.randn(6, 5)
    compiled = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction="sum")
    sink = _record(compiled, "fx")
    compiled(x).sum().backward()
    (scale,) = [c for c in sink.captures if any(p is model.scale for p in c.params)]
    assert scale.module is None and scale.backprops is None and len(scale.params) == 1
    assert scale.grad_samples()[model.scale].shape == (6, 4)
