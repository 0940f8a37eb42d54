"""``make_private(..., compile=True)`` (fxdp/compile_option.py): the private model torch.compile'd in place takes the
steps of the eager one (float64 with ``aot_eager``; inductor in float32), its forward one graph at the deep-narrow
size, what a user does with the returned model unchanged (state_dict names, report, sink, eval, checkpoints), and
what ``compile`` is not for refused with the argument's name.

Compiles are slow on a small CPU machine: tiny models, few compiles per test (``aot_eager`` but for one test)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fxdp
from fxdp.compile_option import compile_in_place
from fxdp.privacy_engine import PrivacyEngine
from fxdp.sinks.contract import sink_of
from tests.support.counting_backend import CountingBackend
from tests.support.private_steps import parameters_after_steps

torch._dynamo = pytest.importorskip("torch._dynamo")

_BENCH_MODELS = Path(__file__).parents[1] / "benchmarks" / "models.py"
_spec = importlib.util.spec_from_file_location("fxdp_bench_models", _BENCH_MODELS)
bench_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_models)


def _mlp(dropout: float = 0.0):
    """(No dropout where steps are compared: inductor draws its random numbers its own way.)"""
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(16, 3))


MODELS = {
    "mlp": (_mlp, lambda n: torch.randn(n, 10)),
    "attention": (bench_models.OneHeadAttention, lambda n: torch.randint(0, 20, (n, 6))),  # LayerNorm, embeddings
}


def _private(engine, model, make_x, noise=1.0, **kwargs):
    data = TensorDataset(make_x(48), torch.randint(0, 3, (48,)))
    return engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=noise, max_grad_norm=0.5, example_inputs=(make_x(8),),
        noise_generator=torch.Generator().manual_seed(1), **kwargs)


def _train(make, make_x, noise, compile, steps=3):  # noqa: A002 (make_private's argument)
    """Parameters after each of ``steps`` private steps (Poisson batches and noise seeded alike)."""
    torch.manual_seed(0)
    model = make()
    engine = PrivacyEngine()
    private, optimizer, loader = _private(engine, model, make_x, noise, compile=compile)
    return parameters_after_steps(private, optimizer, loader, model, steps), engine.accountant.history


def _assert_same_steps(eager, compiled, **tolerance):
    assert len(eager) == len(compiled) == 3
    for step, (want, got) in enumerate(zip(eager, compiled)):
        for p_want, p_got in zip(want, got):
            torch.testing.assert_close(p_got, p_want, **tolerance, msg=lambda m: f"step {step}: {m}")
    assert max(float((a - b).abs().max()) for a, b in zip(eager[0], eager[-1])) > 1e-3  # the steps did something


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("name, noise", [("mlp", 0.0), ("mlp", 1.0), ("attention", 1.0)])
def test_compile_true_takes_the_steps_of_eager_make_private(name, noise):
    make, make_x = MODELS[name]
    eager, eager_history = _train(make, make_x, noise, compile=False)
    backend = CountingBackend(then="aot_eager")
    compiled, compiled_history = _train(make, make_x, noise, compile={"backend": backend})
    assert backend.graphs >= 1  # compiled, not fallen back to eager
    _assert_same_steps(eager, compiled, atol=1e-12, rtol=1e-10)
    assert compiled_history == eager_history


@pytest.mark.usefixtures("float64")
def test_poisson_batches_of_0_1_and_2_samples_take_the_steps_of_eager():
    """Batch sizes dynamo specialises (0 and 1) and a dynamic one, an empty batch's step noise only: unpadded
    (``padded_batches=False``), and padded to one bucket size, compile's default, which one graph serves."""

    def steps(compile, padded=None):  # noqa: A002
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
        data = TensorDataset(torch.randn(4, 10), torch.randint(0, 3, (4,)))
        private, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=1.0,
            data_loader=DataLoader(data, batch_size=1), max_grad_norm=1.0, example_inputs=(torch.randn(3, 10),),
            noise_generator=torch.Generator().manual_seed(1), compile=compile, padded_batches=padded)
        torch.manual_seed(5)  # batches of 1, 2, 1, 0, 1, 1, 1, 1, 0, 1, 0, 0 samples
        sizes, rows = [], set()
        for _ in range(3):
            for x, y in loader:
                sizes.append(loader.real_rows if loader.padding_base else len(x))
                rows.add(len(x))
                optimizer.zero_grad()
                F.cross_entropy(private(x), y).backward()
                optimizer.step()
        return sizes, rows, [p.detach() for p in model.parameters()]

    sizes, _, eager = steps(False)
    assert {0, 1, 2} <= set(sizes)
    for padded in (False, None):
        backend = CountingBackend(then="aot_eager")
        compiled_sizes, rows, compiled = steps({"backend": backend}, padded)
        assert compiled_sizes == sizes
        if padded is False:
            assert backend.graphs >= 3  # sizes 0 and 1 specialised, then a dynamic size
        else:
            assert rows == {8} and backend.graphs == 1  # every batch padded to the base bucket: one graph
        for want, got in zip(eager, compiled):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.usefixtures("float64")
def test_the_ghost_clipping_surface_takes_the_steps_of_eager():
    """make_private(criterion=...) returns the criterion wrapped (DPLossFastGradientClipping) around the compiled
    model."""

    def steps(compile):  # noqa: A002
        torch.manual_seed(0)
        model = _mlp()
        data = TensorDataset(torch.randn(16, 10), torch.randint(0, 3, (16,)))
        private, optimizer, criterion, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=1.0,
            data_loader=DataLoader(data, batch_size=4), max_grad_norm=1.0, criterion=nn.CrossEntropyLoss(),
            example_inputs=(torch.randn(4, 10),), noise_generator=torch.Generator().manual_seed(1), compile=compile)
        torch.manual_seed(5)
        for step, (x, y) in enumerate(loader):
            if step == 3:
                break
            optimizer.zero_grad()
            criterion(private(x), y).backward()
            optimizer.step()
        return [p.detach() for p in model.parameters()]

    backend = CountingBackend(then="aot_eager")
    for want, got in zip(steps(False), steps({"backend": backend})):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert backend.graphs >= 1


def test_compile_true_with_inductor_takes_the_steps_of_eager_to_float32_rounding():
    make, make_x = MODELS["mlp"]
    eager, _ = _train(make, make_x, 1.0, compile=False)
    torch._dynamo.utils.counters.clear()
    compiled, _ = _train(make, make_x, 1.0, compile=True)  # torch.compile's default: inductor
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not fallen back to eager
    _assert_same_steps(eager, compiled, atol=1e-5, rtol=1e-4)  # inductor may fuse and reorder float32 arithmetic


def test_the_deep_narrow_forward_is_one_graph():
    torch.manual_seed(0)
    model, make_x = bench_models.deep_narrow(), (lambda n: torch.randn(n, 32))
    torch._dynamo.reset()
    backend = CountingBackend()
    private, optimizer, _ = _private(PrivacyEngine(), model, make_x, compile={"backend": backend},
                                     poisson_sampling=False)  # (a batch of its own: not the loader's)
    x, y = make_x(4), torch.randint(0, 10, (4,))
    optimizer.zero_grad()
    F.cross_entropy(private(x), y).backward()
    assert backend.graphs == 1  # (eager hooks under torch.compile: one more per DP-aware layer, 33 more here)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # noise reached every parameter
    torch._dynamo.reset()


def test_the_returned_model_is_the_private_model_compiled_in_place(tmp_path):
    torch.manual_seed(0)
    model = _mlp(dropout=0.5)
    names = list(model.state_dict())
    engine = PrivacyEngine()
    private, optimizer, _ = _private(engine, model, MODELS["mlp"][1], compile={"backend": "aot_eager"})
    assert private._compiled_call_impl is not None  # compiled (nn.Module.compile), not wrapped in an OptimizedModule
    assert list(private.state_dict()) == names
    assert fxdp.report(private).engine == "fx"
    assert optimizer.sink is sink_of(private)
    x = torch.randn(5, 10)
    private.eval()
    torch.testing.assert_close(private(x), model.eval()(x))  # eval: dropout off in the compiled forward too
    private.train()
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=private, optimizer=optimizer)
    plain = _mlp(dropout=0.5)
    plain.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["module_state_dict"])
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    engine.load_checkpoint(path=tmp_path / "ckpt.pt", module=private, optimizer=optimizer)


def test_a_copy_of_the_compiled_model_is_compiled_for_itself_and_runs_its_own_parameters(tmp_path):
    """nn.Module.compile's compiled call is bound to its model: a copy holding it would run the original."""
    torch.manual_seed(0)
    model = _mlp()
    private, _, _ = _private(PrivacyEngine(), model, MODELS["mlp"][1], compile={"backend": "aot_eager"})
    x = torch.randn(5, 10)
    want = model(x).detach()
    torch.save(private, tmp_path / "model.pt")
    for copied in (copy.deepcopy(private), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert copied._compiled_call_impl is not None and copied._compiled_call_impl is not private._compiled_call_impl
        torch.testing.assert_close(copied(x), want)
        with torch.no_grad():
            for p in copied.parameters():
                p.zero_()
        torch.testing.assert_close(copied(x), torch.zeros(5, 3))  # its own (zeroed) parameters, not the original's
        torch.testing.assert_close(private(x), want)


def test_compile_false_leaves_the_model_uncompiled():
    private, _, _ = _private(PrivacyEngine(), _mlp(), MODELS["mlp"][1], compile=False)
    assert private._compiled_call_impl is None


@pytest.mark.parametrize("value, match", [
    ("yes", "compile=.*True, False or a dict.*'yes'"),
    (1, "compile=.*got 1 of type int"),
    ({"backend": "aot_eager", "fullgrap": True}, "compile=.*'fullgrap'.*torch.compile does not take"),
])
def test_a_bad_compile_value_is_refused_naming_the_argument(value, match):
    model = _mlp()
    with pytest.raises(TypeError, match=match):
        _private(PrivacyEngine(), model, MODELS["mlp"][1], compile=value)
    PrivacyEngine().make_private(  # nothing was claimed: another engine may still make it private
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(8, 10), torch.zeros(8, dtype=torch.long)), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0)


@pytest.mark.parametrize("options", [{"grad_sample_mode": "hooks"}, {"grad_sample_mode": "ew"},
                                     {"grad_sample_mode": "functorch"}, {"wrap_model": False}])
def test_compile_with_another_engine_is_refused_saying_what_to_do(options):
    with pytest.raises(ValueError, match=r"compile=.*graph engine.*(grad_sample_mode|wrap_model).*compile=False"):
        _private(PrivacyEngine(), _mlp(), MODELS["mlp"][1], compile=True, **options)


def test_a_model_the_hooks_engine_took_is_refused():
    x = torch.randn(4, 10)
    hooked = fxdp.compile_for_dp(_mlp(), (x,), grad_sample_mode="hooks")
    with pytest.raises(ValueError, match="needs the graph engine.*'hooks' engine.*compile=False"):
        compile_in_place(hooked, {"backend": "aot_eager"})
