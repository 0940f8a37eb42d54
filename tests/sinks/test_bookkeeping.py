"""Book-keeping sink: per-sample squared norms and clipped sums from (A, G) equal those of the materialised
per-sample gradients, checked against batches of one and against the materialising sink fed the same
captures.

The captures are built here as a DP-aware op builds them: a forward hook keeps each layer's batch-first
input A; a hook on its output receives G, scaled to a summed loss, and hands both sinks one LayerCapture
whose ``grad_samples`` runs the layer's registered rule.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdp
from fxdp.grad_sample import compute_grad_samples, register_grad_sampler
from fxdp.runtime.bookkeeping_calls import call_without_param_grads
from fxdp.sinks.bookkeeping import BookkeepingSink, describe_plans, plan_graph, plan_layer
from fxdp.sinks.contract import GradSampleSink, LayerCapture, PerSampleError, sink_of
from tests.support.per_sample_reference import batch_loss, expected_grad_samples

def attach(model, sinks, loss_reduction):
    """Every layer with trainable parameters of its own delivers a LayerCapture to each sink in backward,
    naming the model's forward call it belongs to."""
    handles, rerunning, calls = [], [False], [0]  # the generic rule re-runs the layer: no capture of that

    def count_call(mod, inputs):
        if not rerunning[0]:
            calls[0] += 1

    handles.append(model.register_forward_pre_hook(count_call))
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue

        def hook(mod, inputs, out, own=own):
            if rerunning[0]:
                return
            n = inputs[0].shape[0]
            acts = [x.detach() for x in inputs if isinstance(x, torch.Tensor)]
            call = calls[0]

            def on_grad(grad):
                g = grad * n if loss_reduction == "mean" else grad  # the mean's 1/N undone

                def grad_samples():
                    rerunning[0] = True
                    try:
                        return compute_grad_samples(mod, acts, g, loss_reduction="sum", batch_size=n)
                    finally:
                        rerunning[0] = False

                capture = LayerCapture(batch_size=n, grad_samples=grad_samples, module=mod, activations=acts,
                                       backprops=g, params=own, call=call)
                for sink in sinks:
                    sink.add(capture)

            out.register_hook(on_grad)

        handles.append(module.register_forward_hook(hook))
    return handles


def run_and_check(model, inputs, *, loss_reduction="mean", method=None, passes=1, seed=0, atol=1e-8, rtol=1e-6):
    """Run ``passes`` backward passes (batches ``inputs``, or a list of them) into a book-keeping sink and
    a materialising one; compare norms and clipped sums (random factors per parameter) with the loop."""
    batches = inputs if isinstance(inputs, list) else [inputs]
    batches = [x.double() if x.is_floating_point() else x for x in batches]  # float64: tight comparisons
    model = copy.deepcopy(model).double()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    expected, cotangents = {k: [] for k in params}, []
    for x in batches:
        want, R = expected_grad_samples(model, x, seed=seed)
        cotangents.append(R)
        for k in params:
            expected[k].append(want[k])
    expected = {k: torch.cat(v) for k, v in expected.items()}
    book, materialised = BookkeepingSink(method), GradSampleSink()
    handles = attach(model, [book, materialised], loss_reduction)
    for x, R in zip(batches, cotangents):
        batch_loss(model(x), R, loss_reduction).backward()
    for h in handles:
        h.remove()

    plist = list(params.values())
    norms, ref_norms = book.squared_norms(plist), materialised.squared_norms(plist)
    gen = torch.Generator().manual_seed(seed + 1)
    total = expected[next(iter(params))].shape[0]
    factors = {p: torch.rand(total, generator=gen, dtype=torch.float64) for p in plist}
    sums, ref_sums = book.clipped_sums(plist, factors), materialised.clipped_sums(plist, factors)
    for name, p in params.items():
        want = expected[name]
        torch.testing.assert_close(norms[p], want.flatten(1).pow(2).sum(1), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name} norms: {m}")
        torch.testing.assert_close(norms[p], ref_norms[p], atol=atol, rtol=rtol)
        torch.testing.assert_close(sums[p], torch.tensordot(factors[p], want, dims=1), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name} clipped sum: {m}")
        torch.testing.assert_close(sums[p], ref_sums[p], atol=atol, rtol=rtol)
        torch.testing.assert_close(book.grad_samples([p])[p], want, atol=atol, rtol=rtol)
    return book, model


def plan_methods(book, model):
    return {name: book.plans[m].method for name, m in model.named_modules() if m in book.plans}


# -- Linear ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_linear_on_vectors_uses_the_outer_product_norm(loss_reduction):
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    book, m = run_and_check(model, torch.randn(6, 7), loss_reduction=loss_reduction)
    assert plan_methods(book, m) == {"0": "outer", "2": "outer"}


@pytest.mark.parametrize("method", ["ghost", "per_sample", None])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_linear_on_sequences_both_branches(method, loss_reduction):
    model = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 4, bias=False))
    book, m = run_and_check(model, torch.randn(5, 4, 6), loss_reduction=loss_reduction, method=method)
    if method is not None:
        assert set(plan_methods(book, m).values()) == {method}


def test_linear_on_two_middle_dimensions():
    book, m = run_and_check(nn.Linear(3, 2), torch.randn(4, 2, 5, 3), method="ghost")
    assert plan_methods(book, m) == {"": "ghost"}


def test_plan_picks_the_cheaper_norm_from_shapes():
    lin = nn.Linear(128, 512)
    short = plan_layer(lin, [(32, 64, 128)], (32, 64, 512))
    long = plan_layer(lin, [(32, 4096, 128)], (32, 4096, 512))
    assert (short.method, long.method) == ("ghost", "per_sample")
    assert short.ghost_cost == 64 * 64 * (128 + 512) and short.per_sample_cost == 64 * 128 * 512
    assert "T=64" in short.reason and "ghost" in short.reason
    assert plan_layer(lin, [(32, 128)], (32, 512)).method == "outer"
    conv = nn.Conv2d(3, 32, 3, padding=1)
    assert plan_layer(conv, [(8, 3, 32, 32)], (8, 32, 32, 32)).method == "per_sample"  # L^2 is large
    deep = nn.Conv2d(64, 64, 3)  # a 2x2 output: L^2 is small next to C_in * k * C_out
    assert plan_layer(deep, [(8, 64, 4, 4)], (8, 64, 2, 2)).method == "ghost"
    assert plan_layer(nn.LayerNorm(4), [(8, 4)], (8, 4)).method == "materialise"
    assert plan_layer(nn.Embedding(10, 4), [(8, 5)], (8, 5, 4)).method == "index"


# -- Conv -------------------------------------------------------------------------------------------------

CONVS = [
    ("conv1d", lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2), (3, 4, 11)),
    ("conv1d-same-reflect", lambda: nn.Conv1d(3, 2, 4, padding="same", padding_mode="reflect"), (3, 3, 9)),
    ("conv2d", lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)), (2, 3, 7, 6)),
    ("conv2d-groups", lambda: nn.Conv2d(4, 8, 3, padding=1, groups=4, bias=False), (3, 4, 5, 5)),
    ("conv2d-circular", lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"), (2, 2, 5, 4)),
    ("conv3d", lambda: nn.Conv3d(2, 4, 2, stride=(1, 2, 1), padding=1, groups=2), (2, 2, 4, 5, 3)),
]


@pytest.mark.parametrize("method", ["ghost", "per_sample"])
@pytest.mark.parametrize("name,make,shape", CONVS, ids=[c[0] for c in CONVS])
def test_conv_both_branches(name, make, shape, method):
    torch.manual_seed(0)
    book, m = run_and_check(make(), torch.randn(*shape), method=method)
    assert plan_methods(book, m) == {"": method}


def test_mnist_like_cnn_with_automatic_choice():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 4, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU(),
                          nn.Flatten(), nn.Linear(6 * 2 * 2, 3))
    run_and_check(model, torch.randn(5, 1, 8, 8), loss_reduction="sum")


# -- Embedding, norm layers, the generic rule -------------------------------------------------------------


class EmbedAndPool(nn.Module):
    def __init__(self, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=padding_idx)
        self.ln = nn.LayerNorm(4)
        self.out = nn.Linear(4, 2)

    def forward(self, idx):
        return self.out(self.ln(self.emb(idx)).sum(1))


@pytest.mark.parametrize("padding_idx", [None, 0, 3])
def test_embedding_by_index_with_repeats_and_padding(padding_idx):
    idx = torch.tensor([[1, 2, 1, 0], [3, 3, 3, 3], [0, 0, 5, 6]])  # repeats within a sample, padding rows
    book, m = run_and_check(EmbedAndPool(padding_idx), idx)
    assert plan_methods(book, m) == {"emb": "index", "ln": "materialise", "out": "outer"}


@pytest.mark.parametrize("row", [[0, 1, 2, 3], [1, 2, 1, 0], [3, 3, 3, 3], [6, 0, 6, 5]],
                         ids=["positions", "repeats-and-padding", "one-row", "padding-and-repeats"])
@pytest.mark.parametrize("expanded", [True, False], ids=["expanded", "copied"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_looked_up_alike_by_every_sample(row, expanded, padding_idx):
    """Every sample looks up the same indices (a position embedding): norms and clipped sums are formed from
    the one row, for the row broadcast over the batch (stride 0) and for equal rows in memory."""
    idx = torch.tensor([row]).expand(3, 4)
    idx = idx if expanded else idx.clone()
    book, m = run_and_check(EmbedAndPool(padding_idx), idx)
    use = book._segments[m.emb.weight].uses[0]
    assert torch.equal(use.common_indices(), torch.tensor(row))
    different = torch.tensor([row, row, [4, 4, 4, 4]])
    book, m = run_and_check(EmbedAndPool(padding_idx), different)
    assert book._segments[m.emb.weight].uses[0].common_indices() is None


def test_embedding_scale_grad_by_freq_materialises():
    model = EmbedAndPool()
    model.emb.scale_grad_by_freq = True
    book, m = run_and_check(model, torch.tensor([[1, 2, 1, 0], [3, 3, 4, 3]]))
    assert book.plans[m.emb].method == "materialise" and "scale_grad_by_freq" in book.plans[m.emb].reason


def test_group_norm_and_generic_layers_materialise():
    class Scale(nn.Module):  # no rule: the generic rule
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.randn(4, 1, 1))

        def forward(self, x):
            return x * self.s

    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), Scale(), nn.Flatten(), nn.Linear(4 * 3 * 3, 2))
    book, m = run_and_check(model, torch.randn(3, 2, 5, 5))
    assert plan_methods(book, m) == {"0": "per_sample", "1": "materialise", "2": "materialise", "4": "outer"}


def test_a_user_rule_for_a_linear_subclass_is_not_bookkept():
    class MyLinear(nn.Linear):
        pass

    @register_grad_sampler(MyLinear)
    def rule(module, activations, backprops):  # the ordinary formula, but the sink cannot know that
        return {module.weight: torch.einsum("np,nd->npd", backprops, activations[0]), module.bias: backprops}

    book, m = run_and_check(nn.Sequential(MyLinear(3, 2)), torch.randn(4, 3))
    assert book.plans[m[0]].method == "materialise"


def test_frozen_weight_with_trainable_bias():
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    book, m = run_and_check(model, torch.randn(4, 5))
    assert m[0].weight not in book.squared_norms([m[0].weight])


# -- tied weights, layers called twice -------------------------------------------------------------------


class TwiceCalled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


class TiedPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.sin(self.a(x))) + self.a(x * 2).sum(-1, keepdim=True)


@pytest.mark.parametrize("method", ["ghost", "per_sample", None])
@pytest.mark.parametrize("shape", [(5, 4), (5, 3, 4)], ids=["vectors", "sequences"])
@pytest.mark.parametrize("make", [TwiceCalled, TiedPair], ids=["called-twice", "tied"])
def test_tied_linear_norms_of_the_summed_contributions(make, shape, method):
    torch.manual_seed(0)
    book, m = run_and_check(make(), torch.randn(*shape), method=method)
    assert len(book.tied) >= 1 and all(n >= 2 for n in book.tied.values())


class TiedLM(nn.Module):
    """An embedding used twice and tied to the output layer (Embedding + Linear uses of one weight)."""

    def __init__(self, tie_head):
        super().__init__()
        self.emb = nn.Embedding(9, 4, padding_idx=1)
        self.head = nn.Linear(4, 9, bias=False)
        if tie_head:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        h = torch.tanh(self.emb(idx) + self.emb(idx.flip(1)))
        return self.head(h)


@pytest.mark.parametrize("tie_head", [False, True])
def test_tied_embedding_and_head(tie_head):
    idx = torch.tensor([[2, 3, 2, 1], [1, 1, 4, 8], [5, 6, 7, 5]])
    book, m = run_and_check(TiedLM(tie_head), idx)
    assert book.tied[m.emb.weight] == (3 if tie_head else 2)


def test_conv_called_twice_materialises_that_parameter_only():
    class ConvTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 2, 3, padding=1)
            self.fc = nn.Linear(2 * 6, 2)

        def forward(self, x):
            return self.fc(self.conv(torch.relu(self.conv(x))).flatten(1))

    book, m = run_and_check(ConvTwice(), torch.randn(3, 2, 6))
    assert book.tied[m.conv.weight] == 2 and m.fc.weight not in book.tied


# -- several backward passes, factors, errors ------------------------------------------------------------


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_two_losses_on_one_forward_give_one_row_per_sample_in_both_sinks(loss_reduction):
    """loss1.backward(retain_graph=True); loss2.backward(): each sample's row is its total gradient (what one
    (loss1 + loss2).backward() gives), its norm the norm of that sum, in both sinks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 2), nn.Flatten(), nn.Linear(3 * 4, 2)).double()
    x = torch.randn(3, 2, 5, dtype=torch.float64)
    want1, R1 = expected_grad_samples(model, x, seed=0)
    want2, R2 = expected_grad_samples(model, x, seed=1)
    sinks = [BookkeepingSink(), GradSampleSink()]
    attach(model, sinks, loss_reduction)
    out = model(x)
    batch_loss(out, R1, loss_reduction).backward(retain_graph=True)
    batch_loss(out, R2, loss_reduction).backward()
    params = dict(model.named_parameters())
    factors = {p: torch.rand(3, dtype=torch.float64) for p in params.values()}
    for sink in sinks:
        norms, sums = sink.squared_norms(params.values()), sink.clipped_sums(params.values(), factors)
        for name, p in params.items():
            total = want1[name] + want2[name]
            torch.testing.assert_close(norms[p], total.flatten(1).pow(2).sum(1))
            torch.testing.assert_close(sums[p], torch.tensordot(factors[p], total, dims=1))


def test_backward_passes_over_two_batches_are_refused_by_both_sinks():
    """forward x1, backward, forward x2, backward: another batch, refused when read (the optimizer's step),
    whatever the batch sizes; cleared, the sink takes the next batch."""
    model = nn.Linear(3, 2)
    sinks = [BookkeepingSink(), GradSampleSink()]
    attach(model, sinks, "sum")
    for n2 in (4, 2):
        model(torch.randn(4, 3)).sum().backward()
        model(torch.randn(n2, 3)).sum().backward()
        for sink in sinks:
            with pytest.raises(PerSampleError, match="another batch" if n2 == 4 else r"batches of \[2, 4\] samples"):
                sink.squared_norms([model.weight])
            with pytest.raises(PerSampleError):
                sink.clipped_sums([model.weight], {model.weight: torch.ones(4)})
            sink.clear(list(model.parameters()))
            assert sink.squared_norms([model.weight]) == {}
    model(torch.randn(5, 3)).sum().backward()
    assert all(sink.squared_norms([model.weight])[model.weight].shape == (5,) for sink in sinks)


def test_clip_factors_of_the_wrong_length_are_an_error():
    model = nn.Linear(3, 2)
    book = BookkeepingSink()
    attach(model, [book], "mean")
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(ValueError, match="one factor per sample"):
        book.clipped_sums([model.weight], {model.weight: torch.ones(3)})


def test_a_backward_pass_over_two_batch_sizes_is_an_error():
    model = nn.Linear(3, 2)
    book = BookkeepingSink()
    attach(model, [book], "sum")
    with pytest.raises(RuntimeError, match=r"batches of \[2, 4\] samples"):
        (model(torch.randn(4, 3)).sum() + model(torch.randn(2, 3)).sum()).backward()


def test_flat_clipping_end_to_end_matches_the_materialised_sink():
    """Flat clipping as the optimizer does it: total norm over parameters, one factor vector for all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(7, 4, 6)
    sinks = [BookkeepingSink(), GradSampleSink()]
    attach(model, sinks, "mean")
    model(x).pow(2).mean().backward()
    params = list(model.parameters())
    results = []
    for sink in sinks:
        norms = torch.stack(list(sink.squared_norms(params).values())).sum(0).sqrt()
        c = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        results.append(sink.clipped_sums(params, {p: c for p in params}))
    for p in params:
        torch.testing.assert_close(results[0][p], results[1][p])


def test_mixed_sink_method_argument_is_checked():
    with pytest.raises(ValueError, match="method must be"):
        BookkeepingSink("fast")


# -- layers run without their parameter gradients ---------------------------------------------------------

LAYERS_WITHOUT_PARAM_GRADS = [
    ("linear", lambda: nn.Linear(5, 3), lambda: torch.randn(4, 2, 5, requires_grad=True)),
    ("linear-no-bias", lambda: nn.Linear(5, 3, bias=False), lambda: torch.randn(4, 5, requires_grad=True)),
    # a first layer, on data that needs no gradient: an autograd Function keeps its output in the graph
    ("linear-on-data", lambda: nn.Linear(5, 3), lambda: torch.randn(4, 2, 5)),
    ("conv2d-on-data", lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), lambda: torch.randn(2, 2, 6, 5)),
    ("conv1d", lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2),
     lambda: torch.randn(3, 4, 11, requires_grad=True)),
    ("conv2d-same-reflect", lambda: nn.Conv2d(2, 3, 4, padding="same", padding_mode="reflect"),
     lambda: torch.randn(2, 2, 6, 5, requires_grad=True)),
    ("conv3d", lambda: nn.Conv3d(2, 2, 2, padding=1), lambda: torch.randn(2, 2, 3, 4, 3, requires_grad=True)),
    ("embedding", lambda: nn.Embedding(6, 3, padding_idx=2), lambda: torch.tensor([[1, 2, 2], [5, 0, 1]])),
]


@pytest.mark.parametrize("name,make,make_x", LAYERS_WITHOUT_PARAM_GRADS, ids=[c[0] for c in LAYERS_WITHOUT_PARAM_GRADS])
def test_layers_called_without_param_grads_give_the_same_output_and_input_gradient(name, make, make_x):
    torch.manual_seed(0)
    layer, x = make(), make_x()
    want = layer(x)
    cotangent = torch.randn_like(want)
    want_dx = torch.autograd.grad(want, x, cotangent)[0] if x.requires_grad else None
    layer.zero_grad(set_to_none=True)
    got = call_without_param_grads(BookkeepingSink(), layer, (x,), {})
    torch.testing.assert_close(got, want)
    seen = []
    got.register_hook(seen.append)  # the output gradient still reaches the op's hook
    if x.requires_grad:
        (got * cotangent).sum().backward()
        torch.testing.assert_close(x.grad, want_dx)
    else:
        (got * cotangent).sum().backward()
    assert len(seen) == 1 and all(p.grad is None for p in layer.parameters())


def test_the_gram_of_g_is_formed_as_g_is_delivered_except_where_two_projections_share_it():
    """A ghost-norm Linear weight's G Gram blocks exist as soon as backward has delivered G (G is then still
    in the CPU's cache); a recurrent layer's projections, which share one G, leave it to their shared
    Gram. The norms are checked against the loop by the tests above and below."""
    torch.manual_seed(0)

    class SeqModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.lstm = nn.LSTM(6, 5, batch_first=True)

        def forward(self, x):
            out, _ = self.lstm(self.fc(x))
            return out

    model, x = SeqModel(), torch.randn(3, 4, 6)
    sink = BookkeepingSink("ghost")
    dp = fxdp.compile_for_dp(model, example_inputs=x, sink=sink)
    formed = {}
    original = sink._publish

    def publish(task):
        formed.update((p, use.g_blocks is not None) for p, uses in sink._pending[task].items() for use in uses
                      if hasattr(use, "g_blocks"))
        original(task)

    sink._publish = publish
    dp(x).sum().backward()
    assert formed[model.fc.weight] is True
    assert formed[model.lstm.weight_ih_l0] is False and formed[model.lstm.weight_hh_l0] is False
    assert sink.shared[model.lstm.weight_ih_l0] == 2


def test_layers_without_a_fast_call_are_called_as_usual():
    sink = BookkeepingSink()
    assert call_without_param_grads(sink, nn.GroupNorm(1, 3), (torch.randn(2, 3),), {}) is None
    assert call_without_param_grads(sink, nn.Embedding(4, 2, max_norm=1.0), (torch.tensor([[1]]),), {}) is None

    class Shifted(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    assert call_without_param_grads(sink, Shifted(3, 2), (torch.randn(2, 3),), {}) is None
    with torch.no_grad():
        assert call_without_param_grads(sink, nn.Linear(3, 2), (torch.randn(2, 3),), {}) is None
    # a sink that forms no parameter gradient itself runs every layer as usual
    assert call_without_param_grads(GradSampleSink(), nn.Linear(3, 2), (torch.randn(2, 3),), {}) is None


def test_a_layer_norm_runs_with_input_gradients_only():
    sink, norm = BookkeepingSink(), nn.LayerNorm(3, eps=1e-3).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    out = call_without_param_grads(sink, norm, (x,), {})
    torch.testing.assert_close(out, norm(x))
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, g, retain_graph=True)
    torch.testing.assert_close(grad, torch.autograd.grad(norm(x), x, g)[0])
    out.backward(g)
    assert norm.weight.grad is None and norm.bias.grad is None


def test_the_sink_survives_deepcopy_with_its_method_and_nothing_recorded():
    model = nn.Linear(3, 2)
    model.fxdp_sink = BookkeepingSink("ghost")
    attach(model, [model.fxdp_sink], "sum")
    model(torch.randn(2, 3)).sum().backward()
    copied = copy.deepcopy(model)
    assert copied.fxdp_sink.method == "ghost" and copied.fxdp_sink.squared_norms(copied.parameters()) == {}


def test_plans_of_a_compiled_graph_come_from_the_shapes_the_batch_dim_pass_found():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.seq = nn.Linear(16, 32)  # on (T, N, d): the batch moved
            self.ln = nn.LayerNorm(32)
            self.head = nn.Linear(32, 2)

        def forward(self, idx):
            h = self.ln(self.seq(self.emb(idx).transpose(0, 1)))
            return self.head(h.mean(0))

    x = torch.randint(0, 50, (4, 300))
    plans = dict(plan_graph(fxdp.compile_for_dp(Net(), example_inputs=x)))
    assert {k: p.method for k, p in plans.items()} == {"emb": "index", "seq": "per_sample", "ln": "materialise",
                                                       "head": "outer"}
    assert plans["seq"].per_sample_cost == 300 * 16 * 32 and "T=300" in plans["seq"].reason  # batch-first T
    assert describe_plans([("head", plans["head"])]) == ["book-keeping: 'head' (Linear): outer (input (N, d): "
                                                         "||a_i|| * ||g_i||)"]
    assert plan_graph(fxdp.compile_for_dp(Net())) == []  # without example inputs: decided on the first batch


# -- as the sink of a compiled model ----------------------------------------------------------------------

class TimeMajor(nn.Module):
    """A model that moves the batch: (N, T, d) -> (T, N, d) before its layers, and back."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.fc = nn.Linear(6, 5)
        self.ln = nn.LayerNorm(5)
        self.out = nn.Linear(5, 3)

    def forward(self, idx):
        h = self.emb(idx).transpose(0, 1)  # (T, N, d)
        h = self.ln(torch.tanh(self.fc(h)))
        return self.out(h.transpose(0, 1).sum(1))


COMPILED = [
    ("mlp", lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), lambda: torch.randn(5, 6)),
    ("cnn", lambda: nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                                  nn.Conv2d(4, 4, 2, groups=2), nn.Flatten(), nn.Linear(4 * 2 * 2, 3)),
     lambda: torch.randn(4, 2, 6, 6)),
    ("time-major", TimeMajor, lambda: torch.tensor([[1, 2, 2, 0], [3, 0, 0, 4], [5, 6, 7, 5]])),
    ("tied", lambda: TiedLM(True), lambda: torch.tensor([[2, 3, 2, 1], [1, 1, 4, 8], [5, 6, 7, 5]])),
]


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("name,make,make_x", COMPILED, ids=[c[0] for c in COMPILED])
def test_compiled_model_with_the_bookkeeping_sink(name, make, make_x, loss_reduction):
    torch.manual_seed(0)
    model, x = make().double(), make_x()
    x = x.double() if x.is_floating_point() else x
    if name == "time-major":
        model.fc.weight.requires_grad_(False)  # a frozen parameter
    expected, R = expected_grad_samples(model, x)
    sink = BookkeepingSink()
    dp = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction=loss_reduction, sink=sink)
    assert sink_of(dp) is sink and fxdp.report(dp).engine == "fx"
    batch_loss(dp(x), R, loss_reduction).backward()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    norms = sink.squared_norms(params.values())
    factors = {p: torch.rand(len(x), dtype=torch.float64) for p in params.values()}
    sums = sink.clipped_sums(params.values(), factors)
    assert set(norms) == set(params.values())
    for k, p in params.items():
        torch.testing.assert_close(norms[p], expected[k].flatten(1).pow(2).sum(1), msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(sums[p], torch.tensordot(factors[p], expected[k], dims=1), msg=lambda m: f"{k}: {m}")
        assert getattr(p, "grad_sample", None) is None
    skipped = [k for k, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding))]
    for k in skipped:  # only input gradients flowed through the book-kept layers
        assert all(p.grad is None for p in model.get_submodule(k).parameters()), k


def test_hooks_engine_delivers_to_the_bookkeeping_sink():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double(), torch.randn(6, 4).double()
    expected, R = expected_grad_samples(model, x)
    sink = BookkeepingSink()
    dp = fxdp.compile_for_dp(model, grad_sample_mode="hooks", sink=sink)
    batch_loss(dp(x), R, "mean").backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(sink.squared_norms([p])[p], expected[k].flatten(1).pow(2).sum(1))


def test_engines_that_write_grad_sample_themselves_take_no_sink():
    with pytest.raises(ValueError, match="delivers nothing to a sink"):
        fxdp.compile_for_dp(nn.Linear(2, 2), grad_sample_mode="ew", sink=BookkeepingSink())


def test_the_compile_report_says_how_each_layer_is_bookkept():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    notes = fxdp.report(fxdp.compile_for_dp(model, example_inputs=torch.randn(3, 1, 6, 6), sink=BookkeepingSink())).notes
    assert [n.split(":")[1].strip() for n in notes] == ["'0' (Conv2d)", "'2' (Linear)"]
    assert "outer (input (N, d)" in notes[1]
    assert fxdp.report(fxdp.compile_for_dp(model, example_inputs=torch.randn(3, 1, 6, 6))).notes == ()
    hooked = fxdp.report(fxdp.compile_for_dp(model, grad_sample_mode="hooks", sink=BookkeepingSink())).notes
    assert hooked == ("book-keeping on the hooks engine: each layer's method is chosen from its shapes on the first "
                      "backward (model.fxdp_sink.plans)",)


def test_the_compile_report_lists_functional_uses_of_parameters_too():
    """A parameter used by a function rather than a layer (``x * self.scale``) has the generic rule, which
    materialises: the report says so, naming the parameter, instead of leaving it out."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.fc(x) * self.scale

    notes = fxdp.report(fxdp.compile_for_dp(Scaled(), example_inputs=torch.randn(3, 4), sink=BookkeepingSink())).notes
    assert notes[0].startswith("book-keeping: 'fc' (Linear): outer")
    assert notes[1] == ("book-keeping: '_operator.mul' (generic): materialise ('mul' using 'scale': functional use of "
                        "parameters: the generic rule materialises)")
