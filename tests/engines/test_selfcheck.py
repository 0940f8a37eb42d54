"""The wrapper and fallback half of the run-time checks (the compiled graph's half:
tests/runtime/test_guards.py): each user pattern gives correct per-sample gradients
(against batches of one) or an fxdp error before any gradient can be used.

Situations 4 (stale hooks of an old wrapper), 5 (an untraceable model that mixes samples or moves the
batch), 6 (an explicit grad_sample_mode), 7 (the user's own hooks), empty batches in every engine, and
the checker on the engine compile_for_dp returns.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import fxdp
from fxdp.checker import per_sample_gradient_diagnostics
from fxdp.engines import GradSampleModule
from fxdp.engines.base import engine_hooks
from fxdp.errors import AlreadyCompiledError, LayerBatchError, SampleMixingError, UnverifiedModelError
from tests.support.per_sample_reference import assert_grad_samples_match, batch_loss, expected_grad_samples


def x_of(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


def net():
    torch.manual_seed(0)
    return Net().double()


def assert_matches(model, compiled, x, reduction="mean", R_model=None):
    """compiled's per-sample gradients (on model's parameters) against batches of one of R_model."""
    expected, R = expected_grad_samples(R_model or model, x)
    for p in model.parameters():
        p.grad_sample = None
    batch_loss(compiled(x), R, reduction).backward()
    for name, p in model.named_parameters():
        assert p.grad_sample is not None, name
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-10, rtol=1e-8, msg=lambda m: f"{name}: {m}")


# -- situation 4: an engine's hooks live and die with its wrapper -------------------------------------


def test_compiling_after_deleting_a_hooks_wrapper_does_not_double_the_gradients():
    model = net()
    wrapper = fxdp.compile_for_dp(model, grad_sample_mode="hooks")
    del wrapper
    gc.collect()
    assert_matches(model, fxdp.compile_for_dp(model), x_of(5, 4))


def test_a_deleted_hooks_wrapper_leaves_no_hook_behind():
    model = net()
    wrapper = fxdp.GradSampleModule(model)
    assert engine_hooks(model)
    del wrapper
    gc.collect()
    assert engine_hooks(model) == []
    model(x_of(5, 4)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_a_hooks_wrapper_in_a_reference_cycle_is_collected_by_the_next_compile():
    model = net()
    wrapper = fxdp.GradSampleModule(model)
    wrapper.cycle = [wrapper]  # only the garbage collector can free it
    del wrapper
    assert_matches(model, fxdp.compile_for_dp(model, grad_sample_mode="hooks"), x_of(5, 4))


def test_compiling_a_model_a_live_wrapper_hooks_is_refused():
    model = net()
    wrapper = fxdp.compile_for_dp(model, grad_sample_mode="hooks")
    for mode in ("fx", "hooks", "functorch"):
        with pytest.raises(AlreadyCompiledError, match=r"Net is still wrapped by a GradSampleModule \(hooks on 'fc'\)"):
            fxdp.compile_for_dp(model, grad_sample_mode=mode)
    assert wrapper is not None


def test_compiling_a_hooks_wrapper_unwraps_it():
    model = net()
    wrapper = fxdp.compile_for_dp(model, grad_sample_mode="hooks")
    compiled = fxdp.compile_for_dp(wrapper)
    assert fxdp.report(compiled).engine == "fx"
    assert_matches(model, compiled, x_of(5, 4))
    wrapper(x_of(5, 4)).sum().backward()  # the unwrapped wrapper's hooks are gone: nothing is added
    assert model.fc.weight.grad_sample.shape[0] == 5


def test_compiling_a_compiled_model_is_refused():
    compiled = fxdp.compile_for_dp(net())
    with pytest.raises(AlreadyCompiledError, match="already compiled by fxdp.compile_for_dp; compile the original"):
        fxdp.compile_for_dp(compiled)


def test_compiling_twice_gives_two_independent_correct_engines():
    model = net()
    first, second = fxdp.compile_for_dp(model), fxdp.compile_for_dp(model)
    assert_matches(model, second, x_of(5, 4))
    assert_matches(model, first, x_of(5, 4))


# -- situation 5: the hooks fallback checks itself ------------------------------------------------------


class CentersUntraceably(nn.Module):
    """Untraceable (data-dependent branch) and mixes samples (subtracts the batch mean)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > -1e9:
            x = x - x.mean(0)
        return self.fc(x)


class TransposesUntraceably(nn.Module):
    """Untraceable and runs its Linear time-major on a batch-first input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # (N, T, 4)
        if x.sum() > -1e9:
            x = x.transpose(0, 1)
        return self.fc(x).transpose(0, 1)


class ScalesUntraceably(nn.Module):
    """Untraceable and private: the fallback verifies it and its gradients are right."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        if x.sum() > -1e9:
            x = x * 2
        return self.fc(x)


@pytest.mark.parametrize("strict", [False, True])
def test_an_untraceable_model_that_mixes_samples_is_refused(strict):
    torch.manual_seed(0)
    compiled = fxdp.compile_for_dp(CentersUntraceably().double(), strict=strict)
    assert fxdp.report(compiled).engine == "hooks"
    with pytest.raises(SampleMixingError) as info:
        compiled(x_of(5, 4))
    assert isinstance(info.value, fxdp.errors.NotPrivateError)
    assert "CentersUntraceably mixes samples" in str(info.value)
    assert info.value.findings[0].message.startswith("the output of sample(s) [1, 2, 3, 4] (output #0) changed")


def test_an_untraceable_model_that_moves_the_batch_is_refused_by_the_layer():
    torch.manual_seed(0)
    compiled = fxdp.compile_for_dp(TransposesUntraceably().double())
    with pytest.raises(LayerBatchError) as info:
        compiled(x_of(5, 2, 4))
    assert "layer 'fc' (Linear) does not see the batch" in str(info.value)
    assert info.value.findings[0].message == ("input #0 has shape (2, 5, 4), but the batch of 5 samples is assumed in "
                                              "dimension 0")


def test_a_moved_batch_that_fits_the_shape_checks_is_caught_against_batches_of_one():
    # T == N: every layer sees N rows at dim 0, but they are time steps; the comparison with batches of one sees it
    torch.manual_seed(0)
    compiled = fxdp.compile_for_dp(TransposesUntraceably().double())
    with pytest.raises(fxdp.errors.NotPrivateError):
        compiled(x_of(3, 3, 4))


def test_a_private_untraceable_model_is_verified_and_its_gradients_are_right():
    torch.manual_seed(0)
    model = ScalesUntraceably().double()
    compiled = fxdp.compile_for_dp(model, strict=True)
    assert_matches(model, compiled, x_of(5, 4))
    assert compiled.verification.startswith("verified on a batch of 5")


class Squeezes(nn.Module):
    """Untraceable, one output value per sample, returned as (N,): a binary classifier or a regressor."""

    def __init__(self, centers=False):
        super().__init__()
        self.fc, self.head, self.centers = nn.Linear(4, 3), nn.Linear(3, 1), centers

    def forward(self, x):
        if x.sum() > -1e9 and self.centers:
            x = x - x.mean(0)
        return self.head(torch.tanh(self.fc(x))).squeeze(-1)


def test_a_model_with_one_value_per_sample_is_verified_and_its_gradients_are_right():
    torch.manual_seed(0)
    model = Squeezes().double()
    compiled = fxdp.compile_for_dp(model, strict=True)
    assert fxdp.report(compiled).engine == "hooks"
    assert_matches(model, compiled, x_of(5, 4))
    assert compiled.verification.startswith("verified on a batch of 5")


def test_a_model_with_one_value_per_sample_that_mixes_samples_is_refused():
    torch.manual_seed(0)
    compiled = fxdp.compile_for_dp(Squeezes(centers=True).double())
    with pytest.raises(SampleMixingError) as info:
        compiled(x_of(5, 4))
    assert info.value.findings[0].message.startswith("the output of sample(s) [1, 2, 3, 4] (output #0) changed")


def test_a_random_untraceable_model_is_checked_for_mixing_without_a_false_alarm():
    class FunctionalDropout(ScalesUntraceably):
        def forward(self, x):
            return torch.nn.functional.dropout(super().forward(x), 0.5, training=True)

    torch.manual_seed(0)
    compiled = fxdp.compile_for_dp(FunctionalDropout().double(), strict=True)
    compiled(x_of(5, 4)).sum().backward()
    assert compiled.verification.endswith("per-sample gradients not compared (the model is random even with "
                                          "dropout layers off)")
    assert compiled.module.fc.weight.grad_sample.shape == (5, 3, 4)


@pytest.mark.parametrize("strict", [True, False])
def test_a_fallback_it_cannot_verify_is_refused_strict_or_not(strict):
    """It used to warn and train when not strict (issue 33): now refused either way, before any gradient."""
    class SumsTheBatch(ScalesUntraceably):
        def forward(self, x):  # no per-sample output to compare
            return super().forward(x).sum(0, keepdim=True)

    model = SumsTheBatch().double()
    compiled = fxdp.compile_for_dp(model, strict=strict)
    with pytest.raises(UnverifiedModelError, match="fxdp \\(hooks engine\\): could not verify SumsTheBatch on its "
                                                   "first batch of 5 samples \\(output #0 has shape \\(1, 3\\)"):
        compiled(x_of(5, 4))
    assert model.fc.weight.grad is None and getattr(model.fc.weight, "grad_sample", None) is None


def test_a_broadcast_input_to_a_hooked_layer_is_expanded():
    class Gate(nn.Module):  # no rule: the generic one, which runs each sample with its row of c
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x, c):
            return x * self.w * c

    class AddsAConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()

        def forward(self, x):
            if x.sum() > -1e9:
                return self.gate(x, torch.arange(4.0, dtype=x.dtype).unsqueeze(0))  # (1, 4): one row for all

    torch.manual_seed(0)
    model = AddsAConstant().double()
    assert_matches(model, fxdp.compile_for_dp(model), x_of(5, 4))


def _inspect(tmp_path, model_class, *flags):
    source = tmp_path / "models.py"
    source.write_text(textwrap.dedent('''
        import torch
        from torch import nn

        class CentersUntraceably(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x):
                if x.sum() > -1e9:
                    x = x - x.mean(0)
                return self.fc(x)

        class ScalesUntraceably(CentersUntraceably):
            def forward(self, x):
                if x.sum() > -1e9:
                    x = x * 2
                return self.fc(x)
    '''))
    return subprocess.run([sys.executable, "-m", "fxdp", "inspect", f"{source}:{model_class}", "--input", "6,4", *flags],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("flags", [(), ("--strict",)])
def test_inspect_reports_an_untraceable_model_that_mixes_samples(tmp_path, flags):
    result = _inspect(tmp_path, "CentersUntraceably", *flags)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "CentersUntraceably mixes samples" in result.stdout + result.stderr or "mixes samples" in result.stdout
    assert _inspect(tmp_path, "ScalesUntraceably", *flags).returncode == 0


def test_inspect_without_inputs_says_the_fallback_is_unverified():
    report = fxdp.inspect(CentersUntraceably())
    assert report.pass_report("self-check").findings[0].kind is fxdp.diagnostics.Kind.UNVERIFIED
    with pytest.raises(UnverifiedModelError):
        fxdp.inspect(CentersUntraceably(), strict=True)


# -- situation 6: an explicit grad_sample_mode is honoured -----------------------------------------------


@pytest.mark.parametrize("mode", ["functorch", "ew", "hooks"])
def test_an_explicit_mode_is_honoured_for_an_untraceable_model(mode):
    torch.manual_seed(0)
    model = ScalesUntraceably().double()
    compiled = fxdp.compile_for_dp(model, grad_sample_mode=mode)
    assert fxdp.report(compiled).engine == mode
    assert f"grad_sample_mode={mode!r} was asked for" in (fxdp.report(compiled).fallback_reason or "") or mode == "hooks"
    assert_matches(model, compiled, x_of(5, 4))


def test_an_explicit_mode_that_cannot_handle_the_model_says_why():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            if x.sum() > -1e9:
                return x * self.w

    # ExpandedWeights refuses the parameter in the first forward (a module of the user's own is let through when
    # built, as on Opacus), naming the module and the line
    compiled = fxdp.compile_for_dp(Scaled(), grad_sample_mode="ew")
    with pytest.raises(RuntimeError, match=r"grad_sample_mode='ew' \(PyTorch ExpandedWeights\) failed in module "
                                           r"'<model>' \(Scaled\) at .*return x \* self.w"):
        compiled(torch.ones(2, 4))


# -- situation 7: the user's own hooks --------------------------------------------------------------------


def _double(module, inputs, output):
    return output * 2


def _shift_input(module, inputs):
    return (inputs[0] + 1,)


@pytest.mark.parametrize("where", ["leaf", "root", "leaf-pre", "root-pre"])
@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_user_forward_hooks_are_kept_and_accounted_for(where, mode):
    model = net()
    target = model.fc if where.startswith("leaf") else model
    if where.endswith("pre"):
        target.register_forward_pre_hook(_shift_input)
    else:
        target.register_forward_hook(_double)
    x = x_of(5, 4)
    compiled = fxdp.compile_for_dp(model, grad_sample_mode=mode)
    torch.testing.assert_close(compiled(x), model(x))
    assert_matches(model, compiled, x)


def test_user_full_backward_hooks_are_accounted_for():
    model = net()
    model.head.register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))
    compiled = fxdp.compile_for_dp(model)
    assert "hooks of yours on 'head' (backward hook)" in fxdp.report(compiled).fallback_reason
    assert_matches(model, compiled, x_of(5, 4))


# -- empty batches (Poisson sampling) -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fx", "hooks", "ew", "functorch", "fx-hooked"])
def test_an_empty_batch_gives_grad_samples_with_no_rows(mode):
    model = net()
    if mode == "fx-hooked":  # the whole-model engine
        model.register_forward_hook(_double)
    compiled = fxdp.compile_for_dp(model, grad_sample_mode=mode.split("-")[0])
    compiled(x_of(0, 4)).sum().backward()
    for p in model.parameters():
        assert p.grad_sample.shape == (0, *p.shape)
    compiled(x_of(3, 4)).sum().backward()  # the next batch appends its rows
    assert model.fc.weight.grad_sample.shape == (3, 3, 4)


# -- the checker checks the engine compile_for_dp returns -----------------------------------------------------


@pytest.mark.parametrize("mode", ["fx", "hooks", "functorch"])
def test_the_checker_checks_a_compiled_model_as_it_is(mode):
    model = net()
    compiled = fxdp.compile_for_dp(model, grad_sample_mode=mode, loss_reduction="sum")
    records = per_sample_gradient_diagnostics(x_of(4, 4), compiled)
    assert records.ok, str(records)
    assert {r.reduction for r in records} == {"sum"}  # the compiled model's own reduction
    assert [r.name for r in records] == ["fc.weight", "fc.bias", "head.weight", "head.bias"]
    assert getattr(model.fc.weight, "grad_sample", None) is None  # a copy was checked


def test_the_checker_catches_a_compiled_model_whose_rule_is_wrong():
    @fxdp.register_grad_sampler(nn.Linear)
    def halved(module, activations, backprops):
        gs = {module.weight: torch.einsum("ni,nj->nij", backprops, activations[0]) / 2}
        if module.bias is not None:
            gs[module.bias] = backprops
        return gs

    compiled = fxdp.compile_for_dp(net())
    records = per_sample_gradient_diagnostics(x_of(4, 4), compiled)
    assert not records.ok
    assert {r.name for r in records.failures} == {"fc.weight", "head.weight"}


def test_the_checker_reports_cross_sample_dependence():
    class Mixes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x - x.mean(0))

    records = per_sample_gradient_diagnostics(x_of(4, 4), Mixes().double(), grad_sample_mode="functorch")
    assert not records.ok
    assert records.cross_sample_dependence.startswith("the output of sample(s) [1, 2, 3] (output #0) changed")
    assert "cross-sample dependence: the output of sample(s)" in str(records)
    clean = per_sample_gradient_diagnostics(x_of(4, 4), net())
    assert clean.ok and clean.cross_sample_dependence is None and clean.cross_sample_untested is None
