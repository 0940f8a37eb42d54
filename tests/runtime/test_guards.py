"""The compiled graph's guards: what its analysis assumed is checked at run time. Every case runs the
user's pattern and asserts correct per-sample gradients (against batches of one) or an fxdp error
before any per-sample gradient can be used."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fxdp
from fxdp.diagnostics import BatchDimAnalysisError, FxdpError
from fxdp.layout import BatchLayout
from fxdp.runtime.guards import BatchGuard, Reanalysis
from fxdp.sinks.contract import sink_of
from tests.support.source_lines import line_of


def reference(model, inputs, batched, batch_dim=0, seed=0):
    """{name: (N, *shape)} from batches of one: ``batched`` are the positions of the inputs that carry
    the batch (the others are shared and passed whole); sample i's loss is (out_i * R).sum()."""
    n = inputs[batched[0]].shape[batch_dim]

    def sample(i):
        return tuple(x.narrow(batch_dim, i, 1) if k in batched else x for k, x in enumerate(inputs))

    with torch.no_grad():
        out = model(*sample(0))
    R = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(n):
        grads = torch.autograd.grad((model(*sample(i)) * R).sum(), list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())])
    return {k: torch.stack([row[j] for row in rows]) for j, k in enumerate(params)}, R


def clear(model):
    for p in model.parameters():
        p.grad, p.grad_sample = None, None


def assert_rows(model, expected):
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{name}: {m}")


# -- situation 1: a merged batch whose sequence length changes -------------------------------------


class MergedTime(nn.Module):
    def __init__(self, d=3):
        super().__init__()
        self.fc = nn.Linear(d, 4)

    def forward(self, x):  # (N, T, d)
        n, t, d = x.shape
        return self.fc(x.reshape(n * t, d)).reshape(n, t, 4)


def count_analyses(compiled):
    reanalysis = compiled.fxdp_batch_guard.reanalysis
    calls = []
    original = reanalysis.layouts_for

    def counting(guard, inputs):
        calls.append(tuple(x.shape for x in inputs))
        return original(guard, inputs)

    reanalysis.layouts_for = counting
    return calls


@pytest.mark.parametrize("with_example", [True, False])
def test_a_merged_batch_whose_sequence_length_changes_is_analysed_again(with_example):
    torch.manual_seed(0)
    model = MergedTime()
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 5, 3) if with_example else None,
                                   loss_reduction="sum")
    analyses = count_analyses(compiled)
    for n, t in [(4, 5), (4, 10), (2, 10), (4, 5), (4, 10)]:
        x = torch.randn(n, t, 3)
        expected, R = reference(model, (x,), [0])
        clear(model)
        (compiled(x) * R).sum().backward()
        assert_rows(model, expected)
    # once per new shape signature, cached after
    assert analyses == ([] if with_example else [((4, 5, 3),)]) + [((4, 10, 3),), ((2, 10, 3),)]


def test_the_batch_guard_holds_a_typed_reanalysis_and_sites_holding_layout_objects():
    """One object, ``compiled.fxdp_batch_guard``: its re-analysis implements the runtime's interface (the runtime
    imports no pass), and the sites it keeps right hold layouts as objects, the same in a copy."""
    compiled = fxdp.compile_for_dp(MergedTime(), loss_reduction="sum")
    guard = compiled.fxdp_batch_guard
    assert isinstance(guard, BatchGuard) and isinstance(guard.reanalysis, Reanalysis)
    compiled(torch.randn(4, 5, 3))
    (site,) = guard.sites
    assert site.guard is guard
    assert site.layouts == site.out_layouts == [BatchLayout.merged(0, 5)]
    copied = copy.deepcopy(compiled)
    assert copied.fxdp_batch_guard.sites[0].layouts == [BatchLayout.merged(0, 5)]
    assert copied.fxdp_batch_guard.reanalysis.compiled is copied


class HardCodedRows(nn.Module):
    """`x.reshape(4, -1)` is per-sample only while the batch has 4 samples."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):  # (N, 3)
        rows = x.reshape(4, -1)  # <- rows
        return self.fc(rows[:, :3])


def test_a_shape_for_which_the_analysis_no_longer_holds_is_refused_before_backward():
    torch.manual_seed(0)
    model = HardCodedRows()
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 3), loss_reduction="sum")
    compiled(torch.randn(4, 3)).sum().backward()  # (batches of one cannot run this model to compare with)
    clear(model)
    with pytest.raises(fxdp.errors.NotPrivateError) as err:
        compiled(torch.randn(8, 3))  # each row of reshape(4, -1) now holds two samples
    message = str(err.value)
    assert "reshape" in message and f"test_guards.py:{line_of(HardCodedRows, '# <- rows')}" in message
    assert "(8, 3)" in message and "re-ran" in message
    assert model.fc.weight.grad_sample is None
    with pytest.raises(fxdp.errors.NotPrivateError):  # and it stays refused for that shape
        compiled(torch.randn(8, 3))
    with torch.no_grad():  # evaluation records nothing: nothing to refuse
        torch.testing.assert_close(compiled(torch.randn(8, 3)).shape, torch.Size([4, 2]))


# -- situation 2: the batch is not in the first input ----------------------------------------------


class MaskFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, mask, x):  # mask (T, 3) shared by all samples, x (N, T, 3)
        return self.fc(x * mask)


class SquareMaskFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, mask, x):  # mask (T, T) mixes time steps within a sample, x (N, T, 3)
        return self.fc(mask @ x)


@pytest.mark.parametrize("model_cls,mask_shape", [(MaskFirst, lambda t: (t, 3)), (SquareMaskFirst, lambda t: (t, t))])
@pytest.mark.parametrize("n,t", [(4, 5), (4, 4)], ids=["T!=N", "T==N"])
@pytest.mark.parametrize("with_example", [True, False])
def test_a_shared_first_input_is_not_the_batch(model_cls, mask_shape, n, t, with_example):
    """A mask whose rows differ from the batch's is shared; one with the batch's number of rows (T == N) could
    be either, so fxdp refuses to guess (on the first batch without example inputs) until it is named."""
    torch.manual_seed(0)
    model = model_cls()
    mask, x = torch.randn(*mask_shape(t)), torch.randn(n, t, 3)
    named = {}
    if t == n:
        refusal = r"'mask' \(4, [34]\), 'x' \(4, 4, 3\) both have 4 rows.*batch_inputs=\('x',\) if 'mask' really is"
        with pytest.raises(BatchDimAnalysisError, match=refusal):
            fxdp.find_batch_dim_violations(model, (mask, x))
        refused = fxdp.compile_for_dp(model_cls(), example_inputs=None, loss_reduction="sum") if not with_example \
            else None
        with pytest.raises(BatchDimAnalysisError, match=refusal):
            refused(mask, x) if refused is not None else fxdp.compile_for_dp(model_cls(), example_inputs=(mask, x))
        named = {"batch_inputs": ("x",)}
    assert fxdp.find_batch_dim_violations(model, (mask, x), **named) == []
    expected, R = reference(model, (mask, x), [1])
    compiled = fxdp.compile_for_dp(model, example_inputs=(mask, x) if with_example else None, loss_reduction="sum",
                                   **named)
    (compiled(mask, x) * R).sum().backward()
    assert_rows(model, expected)
    # by keyword, and with other sizes later (the batched input stays x)
    clear(model)
    mask2, x2 = torch.randn(*mask_shape(6)), torch.randn(6, 6, 3)
    expected, R = reference(model, (mask2, x2), [1])
    (compiled(x=x2, mask=mask2) * R).sum().backward()
    assert_rows(model, expected)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fa = nn.Linear(3, 2)
        self.fb = nn.Linear(3, 2)

    def forward(self, a, b):
        return self.fa(a), self.fb(b)


def test_inputs_that_can_be_read_two_ways_ask_which_carry_the_batch():
    a, b = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(FxdpError, match=r"cannot tell which inputs carry the batch.*'a' as the batch \(N=4\).*"
                                        r"'b' as the batch \(N=5\).*batch_inputs="):
        fxdp.compile_for_dp(TwoHeads(), example_inputs=(a, b))
    model = TwoHeads()
    compiled = fxdp.compile_for_dp(model, example_inputs=(a, b), batch_inputs=("a",), loss_reduction="sum")
    expected, R = reference(FirstOutput(model), (a, b), [0])
    (compiled(a, b)[0] * R).sum().backward()
    for name in ("fa.weight", "fa.bias"):
        torch.testing.assert_close(model.get_parameter(name).grad_sample, expected["model." + name])


class FirstOutput(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return self.model(*inputs)[0]


def test_batch_inputs_names_the_batched_inputs():
    model = SquareMaskFirst()
    mask, x = torch.randn(4, 4), torch.randn(4, 4, 3)
    expected, R = reference(model, (mask, x), [1])
    compiled = fxdp.compile_for_dp(model, example_inputs=(mask, x), batch_inputs=("x",), loss_reduction="sum")
    (compiled(mask, x) * R).sum().backward()
    assert_rows(model, expected)
    with pytest.raises(FxdpError, match=r"batch_inputs names 'y', which is not an input of forward\(\); "
                                        r"its inputs are \['mask', 'x'\]"):
        fxdp.compile_for_dp(SquareMaskFirst(), example_inputs=(mask, x), batch_inputs=("y",))


# -- situation 3: two forward calls before one backward --------------------------------------------


@pytest.mark.parametrize("sizes", [[(4, 5), (1, 5)], [(3, 5), (3, 5)], [(3, 5), (3, 10)], [(2, 5), (3, 10)]])
def test_two_forward_calls_before_one_backward_add_up_per_sample(sizes):
    """Two calls of one batch size (two views of a batch, other shapes too): row i holds sample i's uses in
    both. Of two batch sizes: the rows in call order, which the optimizer refuses to step on."""
    torch.manual_seed(0)
    model = MergedTime()
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 5, 3), loss_reduction="sum")
    xs = [torch.randn(n, t, 3) for n, t in sizes]
    refs = [reference(model, (x,), [0], seed=k) for k, x in enumerate(xs)]
    clear(model)
    loss = sum((compiled(x) * R).sum() for x, (_, R) in zip(xs, refs))
    loss.backward()
    one_batch = len({n for n, _ in sizes}) == 1
    for name, p in model.named_parameters():
        want = sum(e[name] for e, _ in refs) if one_batch else torch.cat([e[name] for e, _ in refs])
        torch.testing.assert_close(p.grad_sample, want, atol=1e-5, rtol=1e-4)
    if not one_batch:
        with pytest.raises(fxdp.errors.PerSampleError, match=r"forward calls with batches of \[\d, \d\] samples"):
            sink_of(compiled).squared_norms(list(model.parameters()))


def test_a_layer_used_twice_in_one_forward_still_sums_its_uses():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(4, 3)
    expected, R = reference(model, (x,), [0])
    compiled = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction="sum")
    (compiled(x) * R).sum().backward()
    assert_rows(model, expected)


# -- situation 8: a parameter frozen at compile time and unfrozen later ----------------------------


class FunctionalWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 3))
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) @ self.w.t()  # <- w.t()


def test_a_frozen_parameter_unfrozen_later_is_compiled_again_at_the_next_forward():
    torch.manual_seed(0)
    model = FunctionalWeight()
    model.w.requires_grad_(False)
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 3), loss_reduction="sum")
    x = torch.randn(4, 3)
    expected, R = reference(model, (x,), [0])
    (compiled(x) * R).sum().backward()
    assert_rows(model, expected)
    clear(model)
    model.w.requires_grad_(True)
    expected, R = reference(model, (x,), [0])
    with pytest.warns(UserWarning, match="parameter 'w', frozen when fxdp compiled .* was unfrozen: the model was "
                                         "compiled again"):
        out = compiled(x)
    (out * R).sum().backward()
    assert_rows(model, expected)
    assert any("compiled again before a forward: parameter 'w'" in note for note in fxdp.report(compiled).notes)
    clear(model)
    model.w.requires_grad_(False)  # frozen again: its use stays a DP-aware op, which skips it while frozen
    expected, R = reference(model, (x,), [0])
    (compiled(x) * R).sum().backward()
    assert_rows(model, expected)
    assert model.w.grad is None and model.w.grad_sample is None


def test_the_trainability_guard_still_refuses_when_the_graph_runs_without_the_check():
    """``compiled.forward(x)`` bypasses the check before the forward: the guard inside the graph refuses."""
    torch.manual_seed(0)
    model = FunctionalWeight()
    model.w.requires_grad_(False)
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 3), loss_reduction="sum")
    model.w.requires_grad_(True)
    with pytest.raises(fxdp.errors.TrainabilityChangedError,
                       match=rf"parameter 'w' was frozen.*node 't'.*test_guards.py:"
                             rf"{line_of(FunctionalWeight, '# <- w.t()')}.*Compile the model again"):
        compiled.forward(torch.randn(4, 3))
    assert model.w.grad is None and getattr(model.w, "grad_sample", None) is None


def test_a_frozen_layer_unfrozen_later_gets_per_sample_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 3), loss_reduction="sum")
    model[0].requires_grad_(True)
    x = torch.randn(4, 3)
    expected, R = reference(model, (x,), [0])
    (compiled(x) * R).sum().backward()
    assert_rows(model, expected)


# -- property-based: random small models, shapes changing between calls ----------------------------

T_MAX = 6


class RandomModel(nn.Module):
    """x (N, T, 3), optionally a (T, T) mask shared by all samples (first or last input) and (1, T)
    position ids; blocks of (layout move, layer), then a head."""

    def __init__(self, blocks, mask, pos, mask_first):
        super().__init__()
        self.blocks, self.use_mask, self.use_pos, self.mask_first = blocks, mask, pos, mask_first
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in blocks)
        self.pos = nn.Embedding(T_MAX, 3) if pos else None
        self.head = nn.Linear(3, 2)

    def forward(self, a, b, pos):
        mask, x = (a, b) if self.mask_first else (b, a)
        h = x
        if self.use_pos:
            h = h + self.pos(pos)
        if self.use_mask:
            h = mask @ h
        for (move, act), layer in zip(self.blocks, self.layers):
            n, t, d = h.shape
            if move == "merge":
                h = layer(h.reshape(n * t, d)).reshape(n, t, d)
            elif move == "time_major":
                h = layer(h.transpose(0, 1)).transpose(0, 1)
            else:
                h = layer(h)
            if act:
                h = torch.tanh(h)
        return self.head(h)


def _inputs(model, n, t, gen):
    x = torch.randn(n, t, 3, generator=gen)
    mask = torch.randn(t, t, generator=gen)
    pos = torch.arange(t).unsqueeze(0)
    return ((mask, x) if model.mask_first else (x, mask)) + (pos,), (1 if model.mask_first else 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.lists(st.tuples(st.sampled_from(["merge", "time_major", "plain"]), st.booleans()), min_size=1,
                    max_size=3),
    mask=st.booleans(), pos=st.booleans(), mask_first=st.booleans(), with_example=st.booleans(),
    shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, T_MAX)), min_size=3, max_size=3),
    together=st.booleans(), by_keyword=st.booleans(),
)
def test_random_models_give_batches_of_one_or_an_error(blocks, mask, pos, mask_first, with_example, shapes,
                                                       together, by_keyword):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = RandomModel(blocks, mask, pos, mask_first)
    (example, _), rest = _inputs(model, *shapes[0], gen), shapes[1:]
    try:
        compiled = fxdp.compile_for_dp(model, example_inputs=example if with_example else None,
                                       loss_reduction="sum")
    except FxdpError:
        return  # refused up front: nothing handed out
    calls = [_inputs(model, n, t, gen) for n, t in ([shapes[0]] + rest)]
    groups = [calls[:1], calls[1:]] if together else [[c] for c in calls]  # two forwards, one backward
    for group in groups:
        clear(model)
        refs = [reference(model, inputs, [k], seed=j) for j, (inputs, k) in enumerate(group)]
        try:
            outs = [compiled(**dict(zip("abp", inputs[:2]), pos=inputs[2])) if by_keyword else compiled(*inputs)
                    for inputs, _ in group]
            loss = sum((out * R).sum() for out, (_, R) in zip(outs, refs))
            loss.backward()
        except Exception as exc:  # an error fxdp raised (in forward, or in backward before publishing)
            assert isinstance(exc, FxdpError) or str(exc).startswith("fxdp"), exc
            assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
            continue
        for name, p in model.named_parameters():  # one batch size: row i adds up sample i's uses in every call
            rows = [e[name] for e, _ in refs]
            want = sum(rows) if len({r.shape[0] for r in rows}) == 1 else torch.cat(rows)
            torch.testing.assert_close(p.grad_sample, want, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")
