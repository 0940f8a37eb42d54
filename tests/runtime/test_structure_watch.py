"""The structure watch (fxdp/runtime/structure.py): a model changed after ``make_private`` / ``compile_for_dp`` (a layer replaced,
a parameter unfrozen or frozen) trains privately, or an fxdp error comes before any parameter moves and
before the accountant records a step. Every case runs on the fx engine (book-keeping sink, and
``materialise_grad_sample=True``) and on the hooks engine; the engines that run the model as it is at each
forward (ew, functorch, fx+whole-model) are checked at the end."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fxdp
from fxdp.sinks.bookkeeping import BookkeepingSink

C = 0.5  # small enough that most samples are clipped
LR = 1.0

MODES = [pytest.param(("fx", False), id="fx-bookkeeping"), pytest.param(("fx", True), id="fx-materialised"),
         pytest.param(("hooks", False), id="hooks")]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.w = nn.Parameter(torch.randn(2, 4) * 0.5)
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) @ self.w.t())  # frozen, `w.t()` is no DP-aware op


def loss_of(out, y):
    return ((out - y) ** 2).sum()


def batch(seed=1, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)


def per_sample_grads(model, x, y, params, copied=True):
    """Each sample's gradient alone (batches of one), on a copy of the plain model (the hooks engine's hooks
    on the model itself are dead in a copy); ``copied=False``: ``model`` is a function of the model."""
    if copied:
        names = {id(p): name for name, p in model.named_parameters()}
        model = copy.deepcopy(model)
        params = [model.get_parameter(names[id(p)]) for p in params]
    rows = [torch.autograd.grad(loss_of(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(len(x))]
    return [torch.stack(r) for r in zip(*rows)]


def clipped_sums(grads):
    norms = sum(g.reshape(len(g), -1).pow(2).sum(1) for g in grads).sqrt()
    factors = (C / (norms + 1e-6)).clamp(max=1.0)
    return [torch.einsum("n,n...->...", factors, g) for g in grads]


def make_private(model, mode, clipping="flat", max_grad_norm=C):
    grad_sample_mode, materialise = mode
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine = fxdp.PrivacyEngine()
    loader = DataLoader(TensorDataset(*batch(0, 12)), batch_size=6)
    private, dp_optimizer, _ = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        grad_sample_mode=grad_sample_mode, materialise_grad_sample=materialise, poisson_sampling=False,
        loss_reduction="sum", clipping=clipping)
    return private, dp_optimizer, engine


def step(private, optimizer, x, y):
    optimizer.zero_grad()
    loss_of(private(x), y).backward()
    optimizer.step()


def snapshot(*modules):
    return {id(p): (p, p.detach().clone()) for m in modules for p in m.parameters()}


def assert_nothing_moved(before, engine):
    for p, value in before.values():
        assert torch.equal(p.detach(), value)
    assert len(engine.accountant.history) == 0


def assert_private_step(model, private, optimizer, x, y, trained, materialised):
    """One step with noise 0 moves each of ``trained`` by -LR * its clipped sum (independently computed from
    batches of one over ``trained``, the model's trainable parameters) and nothing else."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    expected = per_sample_grads(model, x, y, trained)
    sums = clipped_sums(expected)
    before = [p.detach().clone() for p in trained] + [p.detach().clone() for p in frozen]
    optimizer.zero_grad()
    loss_of(private(x), y).backward()
    if materialised:  # p.grad_sample as batches of one give it
        for p, g in zip(trained, expected):
            torch.testing.assert_close(p.grad_sample, g, atol=1e-5, rtol=1e-4)
    optimizer.step()
    for p, b, s in zip(trained, before, sums):
        torch.testing.assert_close(p.detach(), b - LR * s, atol=1e-5, rtol=1e-4)
    for p, b in zip(frozen, before[len(trained):]):
        assert torch.equal(p.detach(), b)


# -- item 13: a parameter unfrozen after make_private trains; one frozen after it stays put -----------


@pytest.mark.parametrize("mode", MODES)
def test_layers_and_parameters_unfrozen_after_make_private_are_trained_privately(mode):
    torch.manual_seed(0)
    model = Net()
    model.fc.requires_grad_(False)  # a layer: its DP-aware op skips it while frozen
    model.w.requires_grad_(False)  # used by `w.t()`: the compiled graph has no DP-aware op for it
    private, optimizer, engine = make_private(model, mode)
    x, y = batch(1)
    assert_private_step(model, private, optimizer, x, y, [model.head.weight, model.head.bias], mode[1])
    model.fc.requires_grad_(True)
    model.w.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"parameter 'w'.*frozen when fxdp compiled \(or wrapped\) the model, "
                                         "was unfrozen"):
        assert_private_step(model, private, optimizer, *batch(2), list(model.parameters()), mode[1])
    assert sum(n for *_, n in engine.accountant.history) == 2
    assert fxdp.report(private).engine == mode[0]
    again = "compiled again" if mode[0] == "fx" else "hooked again"
    assert any(f"{again} before a forward: parameter 'w'" in n for n in fxdp.report(private).notes)


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_frozen_after_make_private_stays_put_and_the_rest_is_clipped_without_it(mode):
    torch.manual_seed(0)
    model = Net()
    private, optimizer, engine = make_private(model, mode)
    step(private, optimizer, *batch(1))
    model.fc.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to compile again: a DP-aware op skips a frozen parameter
        assert_private_step(model, private, optimizer, *batch(2), [model.w, model.head.weight, model.head.bias],
                            mode[1])
    assert model.fc.weight.grad is None


@pytest.mark.parametrize("mode", MODES)
def test_per_layer_clipping_refuses_a_parameter_unfrozen_after_make_private_before_anything_moves(mode):
    torch.manual_seed(0)
    model = Net()
    model.w.requires_grad_(False)  # in the optimizer, but no bound: it was frozen at make_private
    private, optimizer, engine = make_private(model, mode, clipping="per_layer", max_grad_norm=[C] * 4)
    model.w.requires_grad_(True)
    before = snapshot(model)
    optimizer.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compiled (hooked) again: said elsewhere
        loss_of(private(batch(1)[0]), batch(1)[1]).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="parameter 'w' has no per_layer bound: it was frozen when the "
                                                   "DPOptimizer was built and is trainable now"):
        optimizer.step()
    assert_nothing_moved(before, engine)


# -- item 8c: a layer replaced after make_private ------------------------------------------------------


def _replace_head(model, private, on):
    new = nn.Linear(2, 2)
    if on == "model":
        model.head = new
    elif private is not model and hasattr(private, "_module"):  # the hooks engine wraps the model itself
        private._module.head = new
    else:
        private.head = new
    return new


@pytest.mark.parametrize("on", ["model", "returned model"])
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_replaced_after_make_private_refuses_the_step_while_the_optimizer_holds_the_old_one(mode, on):
    torch.manual_seed(0)
    model = Net()
    private, optimizer, engine = make_private(model, mode)
    old = model.head
    new = _replace_head(model, private, on)
    before = snapshot(model, old, new)
    optimizer.zero_grad()
    with pytest.warns(UserWarning, match="layer 'head' of the .* was replaced"):
        loss_of(private(batch(1)[0]), batch(1)[1]).backward()
    assert model.head is new  # the model you passed and the one make_private returned are one model
    with pytest.raises(fxdp.errors.PerSampleError, match="parameter 'head.weight' is in the optimizer, but the model no "
                                                   "longer uses it .*layer 'head' of .* was replaced.*noise alone"):
        optimizer.step()
    assert_nothing_moved(before, engine)


@pytest.mark.parametrize("on", ["model", "returned model"])
@pytest.mark.parametrize("mode", MODES)
def test_a_replaced_layer_is_trained_privately_once_the_optimizer_holds_it_instead(mode, on):
    torch.manual_seed(0)
    model = Net()
    private, optimizer, engine = make_private(model, mode)
    step(private, optimizer, *batch(1))
    old = model.head
    new = _replace_head(model, private, on)
    old.requires_grad_(False)  # what the error says to do: the old layer out, the new one in
    optimizer.add_param_group({"params": list(new.parameters())})
    with pytest.warns(UserWarning, match="layer 'head' of the .* was replaced"):
        private(batch(2)[0])
    assert model.head is new
    old_values = snapshot(old)
    assert_private_step(model, private, optimizer, *batch(2), [p for p in model.parameters()], mode[1])
    assert all(torch.equal(p.detach(), value) for p, value in old_values.values())
    assert sum(n for *_, n in engine.accountant.history) == 2
    again = "compiled again" if mode[0] == "fx" else "hooked again"
    assert any(f"{again} before a forward: layer 'head'" in n for n in fxdp.report(private).notes)


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_replaced_inside_a_layer_after_make_private_is_refused_at_the_step(mode):
    torch.manual_seed(0)
    model = Net()
    private, optimizer, engine = make_private(model, mode)
    old = model.fc.weight
    model.fc.weight = nn.Parameter(torch.randn(4, 3))
    before = snapshot(model)
    before[id(old)] = (old, old.detach().clone())
    optimizer.zero_grad()
    with pytest.warns(UserWarning, match="parameter 'fc.weight' of the .* was replaced"):
        loss_of(private(batch(1)[0]), batch(1)[1]).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match="parameter 'fc.weight' is in the optimizer, but the model no "
                                                   "longer uses it"):
        optimizer.step()
    assert_nothing_moved(before, engine)


# -- compile_for_dp / the hooks engine directly: per-sample gradients after a change -----------------


def _compile(model, mode):
    grad_sample_mode, materialise = mode
    sink = BookkeepingSink() if grad_sample_mode == "fx" and not materialise else None
    return fxdp.compile_for_dp(model, loss_reduction="sum", grad_sample_mode=grad_sample_mode, sink=sink)


def _sink_rows(dp, params, n):
    """Per-sample squared norms from the sink (the book-keeping sink materialises no p.grad_sample)."""
    norms = fxdp.sinks.contract.sink_of(dp).squared_norms(params)
    return [norms[p] for p in params]


def _assert_per_sample(model, dp, mode, x, y, params):
    expected = per_sample_grads(model, x, y, params)
    loss_of(dp(x), y).backward()
    if mode == ("fx", False):
        for got, g in zip(_sink_rows(dp, params, len(x)), expected):
            torch.testing.assert_close(got, g.reshape(len(x), -1).pow(2).sum(1), atol=1e-5, rtol=1e-4)
    else:
        for p, g in zip(params, expected):
            torch.testing.assert_close(p.grad_sample, g, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_compile_for_dp_a_parameter_unfrozen_after_compiling_gets_per_sample_gradients(mode):
    torch.manual_seed(0)
    model = Net()
    model.w.requires_grad_(False)
    model.fc.requires_grad_(False)
    dp = _compile(model, mode)
    loss_of(dp(batch(1)[0]), batch(1)[1]).backward()
    fxdp.sinks.contract.sink_of(dp).clear(list(model.parameters()))
    model.w.requires_grad_(True)
    model.fc.requires_grad_(True)
    with pytest.warns(UserWarning, match="parameter 'w'.* was unfrozen"):
        _assert_per_sample(model, dp, mode, *batch(2), list(model.parameters()))


@pytest.mark.parametrize("on", ["model", "compiled model"])
@pytest.mark.parametrize("mode", MODES)
def test_compile_for_dp_a_replaced_layer_gets_per_sample_gradients(mode, on):
    torch.manual_seed(0)
    model = Net()
    dp = _compile(model, mode)
    loss_of(dp(batch(1)[0]), batch(1)[1]).backward()
    old = list(model.head.parameters())
    fxdp.sinks.contract.sink_of(dp).clear(list(model.parameters()))
    new = _replace_head(model, dp, "model" if on == "model" else "returned model")
    with pytest.warns(UserWarning, match="layer 'head' of the .* was replaced"):
        dp(batch(2)[0])  # compiled (hooked) again, the model you passed holds the new layer too
    assert model.head is new
    _assert_per_sample(model, dp, mode, *batch(2), list(model.parameters()))
    sink = fxdp.sinks.contract.sink_of(dp)
    assert all("layer 'head'" in sink.retired_reason(p) for p in old)
    assert all(sink.retired_reason(p) is None for p in model.parameters())


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace it
            return self.fc(x)
        return -self.fc(x)


@pytest.mark.parametrize("materialise", [False, True])
def test_a_replacement_that_the_graph_cannot_take_is_refused_before_anything_moves(materialise):
    torch.manual_seed(0)
    model = Net()
    private, optimizer, engine = make_private(model, ("fx", materialise))
    model.head = Untraceable()
    before = snapshot(model)
    optimizer.zero_grad()
    for _ in range(2):  # and again at the next forward: the compiled model is the one it was
        with pytest.raises(fxdp.diagnostics.ModelChangedError, match="layer 'head' of the model it was compiled "
                                                                    "from was replaced since the model was compiled. "
                                                                    "Compiled again, it needs the hooks engine"):
            private(batch(1)[0])
    assert_nothing_moved(before, engine)
    assert fxdp.report(private).engine == "fx"


def test_a_copy_of_a_compiled_model_watches_its_own_layers():
    torch.manual_seed(0)
    model = Net()
    dp = fxdp.compile_for_dp(model, loss_reduction="sum")
    x, y = batch(1)
    loss_of(dp(x), y).backward()
    copied = copy.deepcopy(dp)
    copied.head = nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp(x)  # the original is unchanged
    with pytest.warns(UserWarning, match="layer 'head' of the compiled model was replaced"):
        copied(x)
    assert model.head is not copied.head


class Keyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x, gate=None):
        h = torch.tanh(self.fc(x))
        return self.head(h if gate is None else h * gate)


@pytest.mark.parametrize("materialise", [False, True])
def test_a_model_compiled_with_example_inputs_is_compiled_again_with_the_forwards_inputs(materialise):
    torch.manual_seed(0)
    model = Keyword()
    x, y = batch(1)
    gate = torch.rand(1, 4)
    dp = _compile_with(model, {"x": x, "gate": gate}, materialise)
    model.head = nn.Linear(4, 2)
    params = list(model.parameters())
    expected = per_sample_grads(lambda v: model(v, gate=gate), x, y, params, copied=False)
    with pytest.warns(UserWarning, match="layer 'head' of the model it was compiled from was replaced"):
        out = dp(x, gate=gate)
    loss_of(out, y).backward()
    rows = _sink_rows(dp, params, len(x)) if not materialise else [p.grad_sample for p in params]
    for got, g in zip(rows, expected):
        torch.testing.assert_close(got, g if materialise else g.reshape(len(x), -1).pow(2).sum(1),
                                   atol=1e-5, rtol=1e-4)


def _compile_with(model, example_inputs, materialise):
    return fxdp.compile_for_dp(model, example_inputs, loss_reduction="sum",
                               sink=None if materialise else BookkeepingSink())


def test_a_forward_before_the_change_and_one_after_then_one_backward_add_up_per_sample():
    """Two forward calls of one batch size before one backward are the same samples (one row per sample of
    the batch, docs/per_sample.md), across a recompile between them too."""
    torch.manual_seed(0)
    model = Net()
    dp = fxdp.compile_for_dp(model, loss_reduction="sum")
    (x1, y1), (x2, y2) = batch(1), batch(2)
    before = copy.deepcopy(model)
    loss = loss_of(dp(x1), y1)
    model.head = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="layer 'head' of the model it was compiled from was replaced"):
        loss = loss + loss_of(dp(x2), y2)
    loss.backward()
    first = per_sample_grads(before, x1, y1, [before.fc.weight, before.w])
    second = per_sample_grads(model, x2, y2, [model.fc.weight, model.w])
    for p, a, b in zip([model.fc.weight, model.w], first, second):
        torch.testing.assert_close(p.grad_sample, a + b, atol=1e-5, rtol=1e-4)


# -- the engines that run the model as it is at each forward (ew, functorch, fx+whole-model) ---------------


def _plain_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _private_plain(model, mode):
    if mode == "fx+whole-model":  # a hook on the model sends it to the whole-model op
        model.register_forward_hook(lambda module, args, out: None)
    engine = fxdp.PrivacyEngine()
    private, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(TensorDataset(*batch(0, 12)), batch_size=6), noise_multiplier=0.0,
        max_grad_norm=C, grad_sample_mode="fx" if mode == "fx+whole-model" else mode, poisson_sampling=False,
        loss_reduction="sum", example_inputs=batch(0)[0])
    assert fxdp.report(private).engine == mode
    return private, optimizer, engine


@pytest.mark.parametrize("mode", ["ew", "functorch", "fx+whole-model"])
def test_engines_that_run_the_model_as_it_is_refuse_to_move_a_replaced_layer_by_noise_alone(mode):
    """These engines call the replacing layer at once; the optimizer still holds the replaced one's parameters,
    which would get no gradient and move by noise alone: refused, until the old layer is out of the optimizer
    and the new one in, then the new one trains privately."""
    model = _plain_net()
    private, optimizer, engine = _private_plain(model, mode)
    step(private, optimizer, *batch(1))
    old, new = model[2], nn.Linear(4, 2)
    model[2] = new
    before = snapshot(model, old)
    optimizer.zero_grad()
    loss_of(private(batch(2)[0]), batch(2)[1]).backward()
    with pytest.raises(fxdp.errors.PerSampleError, match=r"parameter '2.weight' is in the optimizer, but the model no longer "
                                                   r"uses it \(2 parameter\(s\) of Sequential were replaced"):
        optimizer.step()
    for p, value in before.values():
        assert torch.equal(p.detach(), value)
    assert sum(n for *_, n in engine.accountant.history) == 1
    old.requires_grad_(False)  # what the error says to do
    optimizer.add_param_group({"params": list(new.parameters())})
    assert_private_step(model, private, optimizer, *batch(3), list(model.parameters()), materialised=False)
