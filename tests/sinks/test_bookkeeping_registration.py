"""docs/bookkeeping_a_new_layer.md as it stands: its layer file (the blocks headed ``# scaled_linear.py``) adds a
layer type to the book-keeping fast path with one registration, and its check (``# check.py``) passes; the
per-sample norms and the private step equal batches of one (float64) whatever the method; a layer without a
registration, or one the registration stands aside for, still goes the materialising way."""

from __future__ import annotations

import copy
import pathlib
import re

import pytest
import torch
from torch import nn

import fxdp
from fxdp.sinks.bookkeeping import BookkeepingSink, find_bookkeeping
from fxdp.sinks.bookkeeping.registry import BOOKKEEPING, NO_FORM
from fxdp.sinks.contract import GradSampleSink
from tests.support.per_sample_reference import expected_grad_samples
from tests.support.private_steps import clipped_reference, noise_free_private_step

CLIP = 0.1  # below every sample's norm: each one is clipped

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "bookkeeping_a_new_layer.md"


def _blocks(heading: str) -> str:
    """The doc's python blocks whose first line is ``heading``, in order, as one source."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    return "\n".join(b for b in blocks if b.startswith(heading))


@pytest.fixture
def doc():
    """The doc's layer file run as a module of its own; its registration is undone afterwards (conftest
    undoes the per-sample rule's)."""
    saved = BOOKKEEPING.snapshot()
    namespace = {"__name__": "scaled_linear"}
    exec(compile(_blocks("# scaled_linear.py"), f"{DOC.name} (scaled_linear.py)", "exec"), namespace)
    yield namespace
    BOOKKEEPING.restore(saved)


def _model(doc):
    ScaledLinear = doc["ScaledLinear"]
    return nn.Sequential(ScaledLinear(6, 5, alpha=0.5), nn.Tanh(), ScaledLinear(5, 3, alpha=2.0)).double()


def test_the_docs_check_passes(doc):
    exec(compile(_blocks("# check.py"), f"{DOC.name} (check.py)", "exec"), dict(doc))


def test_one_registration_puts_the_layer_on_the_fast_path(doc):
    model = _model(doc)
    registration = find_bookkeeping(model[0])
    assert isinstance(registration, doc["ScaledLinearBookkeeping"])
    sink = BookkeepingSink()
    dp = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 7, 6, dtype=torch.float64), sink=sink)
    notes = "\n".join(fxdp.report(dp).notes)
    assert "'0' (ScaledLinear): per_sample (T=7, d=6, p=5" in notes and "'2' (ScaledLinear): " in notes
    assert sink.functional_forward(model[0], torch.randn(2, 6)) is not None


CASES = [("vectors", (9, 6)), ("sequences", (9, 7, 6))]


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("method", [None, "ghost", "per_sample"])
@pytest.mark.parametrize("name,shape", CASES, ids=[c[0] for c in CASES])
def test_norms_and_the_private_step_equal_batches_of_one(doc, name, shape, method, loss_reduction):
    torch.manual_seed(0)
    model, x = _model(doc), torch.randn(*shape, dtype=torch.float64)
    expected, R = expected_grad_samples(model, x)
    sink = BookkeepingSink(method)
    got = noise_free_private_step(copy.deepcopy(model), x, R, sink, loss_reduction, CLIP)
    kinds = {plan.method for plan in sink.plans.values()}  # (T=1: ghost is cheaper; T=7: per_sample)
    assert kinds == ({method} if method else {"ghost"} if name == "vectors" else {"per_sample"}), kinds
    want = clipped_reference(expected, loss_reduction, len(x), CLIP)
    for k in want:
        torch.testing.assert_close(got["norms"][k], expected[k].flatten(1).pow(2).sum(1), msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(got["grads"][k], want[k], msg=lambda m: f"{k}: {m}")


def test_a_layer_without_a_registration_is_materialised(doc):
    """The same layer, with its per-sample rule but no book-keeping registration: exact, the materialising way."""
    class Unregistered(nn.Module):  # ScaledLinear's computation, a class of its own
        def __init__(self, d_in, d_out, alpha):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
            self.bias = nn.Parameter(torch.zeros(d_out))
            self.alpha = alpha

        forward = doc["ScaledLinear"].forward

    fxdp.register_grad_sampler(Unregistered)(doc["scaled_linear_grad_sample"])
    torch.manual_seed(0)
    model = nn.Sequential(Unregistered(6, 5, 0.5), nn.Tanh(), Unregistered(5, 3, 2.0)).double()
    _check_materialised(model, torch.randn(9, 7, 6, dtype=torch.float64), NO_FORM)


def test_another_rule_for_the_layer_turns_its_registration_off(doc):
    """A user's own rule for ScaledLinear (here the same computation, another function): the registration,
    which reproduces scaled_linear_grad_sample, stands aside, and that rule's gradients are materialised."""
    fxdp.register_grad_sampler(doc["ScaledLinear"])(lambda *args: doc["scaled_linear_grad_sample"](*args))
    torch.manual_seed(0)
    model = _model(doc)
    assert find_bookkeeping(model[0]) is None
    _check_materialised(model, torch.randn(9, 7, 6, dtype=torch.float64), NO_FORM)


def test_a_subclass_that_overrides_forward_is_not_served(doc):
    class Shifted(doc["ScaledLinear"]):
        def forward(self, x):
            return super().forward(x) + 1.0

    assert find_bookkeeping(Shifted(3, 2, 1.0)) is None
    torch.manual_seed(0)
    model = nn.Sequential(Shifted(6, 5, 0.5), nn.Tanh(), Shifted(5, 3, 2.0)).double()
    _check_materialised(model, torch.randn(9, 7, 6, dtype=torch.float64), "generic rule")


def _check_materialised(model, x, reason):
    expected, R = expected_grad_samples(model, x)
    sink = BookkeepingSink()
    got = noise_free_private_step(copy.deepcopy(model), x, R, sink, "mean", CLIP)
    assert {plan.method for plan in sink.plans.values()} <= {"materialise"}
    notes = [line for line in fxdp.report(got["dp"]).notes if "materialise" in line]
    assert notes and all(reason in line for line in notes), notes
    want = clipped_reference(expected, "mean", len(x), CLIP)
    materialised = noise_free_private_step(copy.deepcopy(model), x, R, GradSampleSink(), "mean", CLIP)
    for k in want:
        torch.testing.assert_close(got["norms"][k], expected[k].flatten(1).pow(2).sum(1), msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(got["grads"][k], want[k], msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(got["grads"][k], materialised["grads"][k], msg=lambda m: f"{k}: {m}")
