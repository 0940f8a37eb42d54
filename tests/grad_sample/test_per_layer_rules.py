"""Each per-sample rule against a loop over batches of one, over swept shapes and both reductions."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fxdp.grad_sample import (
    compute_grad_samples,
    find_grad_sampler,
    functional_grad_samples,
    register_grad_sampler,
)
from fxdp.grad_sample import generic_grad_sampler as functorch_grad_sampler
from fxdp.grad_sample.conv import conv_grad_sample
from fxdp.grad_sample.linear import linear_grad_sample
from tests.support.grad_sample_harness import assert_rule_matches_loop, fixed_cotangent, loss_backprops

SWEEP = settings(max_examples=20, deadline=None)
REDUCTIONS = st.sampled_from(["sum", "mean"])
DTYPE = torch.float64


def seeded(seed: int) -> None:
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------- Linear


@SWEEP
@given(
    n=st.integers(1, 4),
    middle=st.lists(st.integers(1, 3), max_size=2),
    d_in=st.integers(1, 5),
    d_out=st.integers(1, 5),
    bias=st.booleans(),
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_linear_matches_loop(n, middle, d_in, d_out, bias, reduction, seed):
    seeded(seed)
    layer = nn.Linear(d_in, d_out, bias=bias).to(DTYPE)
    x = torch.randn(n, *middle, d_in, dtype=DTYPE)
    assert_rule_matches_loop(layer, [x], reduction)


def test_linear_subclass_uses_linear_rule():
    class NamedLinear(nn.Linear):
        def __init__(self, *args, name="proj", **kwargs):
            super().__init__(*args, **kwargs)
            self.name = name

    layer = NamedLinear(3, 2).to(DTYPE)
    assert find_grad_sampler(layer) is linear_grad_sample
    assert_rule_matches_loop(layer, [torch.randn(4, 5, 3, dtype=DTYPE)], "mean")


def test_frozen_parameters_get_no_entry():
    layer = nn.Linear(3, 2).to(DTYPE)
    layer.weight.requires_grad_(False)
    grad_samples = assert_rule_matches_loop(layer, [torch.randn(4, 3, dtype=DTYPE)], "sum")
    assert list(grad_samples) == [layer.bias]

    conv = nn.Conv2d(2, 3, 3).to(DTYPE)
    conv.bias.requires_grad_(False)
    grad_samples = assert_rule_matches_loop(conv, [torch.randn(2, 2, 5, 5, dtype=DTYPE)], "sum")
    assert list(grad_samples) == [conv.weight]

    frozen = nn.LayerNorm(4).to(DTYPE).requires_grad_(False)
    x = torch.randn(3, 4, dtype=DTYPE)
    out = frozen(x.requires_grad_())
    assert compute_grad_samples(frozen, [x], torch.ones_like(out), loss_reduction="sum", batch_size=3) == {}


# ----------------------------------------------------------------------------------------- Conv

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
# torch's own note that "same" with an even kernel pads a copy of the input: expected here
EVEN_SAME_NOTE = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")


@st.composite
def conv_configs(draw, ndim: int):
    groups = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(ndim))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(ndim))
    padding = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    stride = 1 if padding == "same" else tuple(draw(st.integers(1, 2)) for _ in range(ndim))
    if padding == "int":
        padding = draw(st.integers(0, 2))
    elif padding == "tuple":
        padding = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    # big enough for every kernel/dilation, and larger than any padding (reflect needs that)
    size_range = (5, 7) if ndim < 3 else (5, 6)
    spatial = tuple(draw(st.integers(*size_range)) for _ in range(ndim))
    return dict(
        n=draw(st.integers(1, 3)),
        in_channels=groups * draw(st.integers(1, 2)),
        out_channels=groups * draw(st.integers(1, 2)),
        groups=groups,
        kernel_size=kernel,
        dilation=dilation,
        padding=padding,
        stride=stride,
        spatial=spatial,
        bias=draw(st.booleans()),
    )


@EVEN_SAME_NOTE
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@SWEEP
@given(data=st.data(), reduction=REDUCTIONS)
def test_conv_matches_loop(ndim, padding_mode, data, reduction):
    cfg = data.draw(conv_configs(ndim))
    seeded(0)
    conv = CONV[ndim](
        cfg["in_channels"],
        cfg["out_channels"],
        cfg["kernel_size"],
        stride=cfg["stride"],
        padding=cfg["padding"],
        dilation=cfg["dilation"],
        groups=cfg["groups"],
        bias=cfg["bias"],
        padding_mode=padding_mode,
    ).to(DTYPE)
    x = torch.randn(cfg["n"], cfg["in_channels"], *cfg["spatial"], dtype=DTYPE)
    assert_rule_matches_loop(conv, [x], reduction)


@EVEN_SAME_NOTE
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("padding", ["same", "valid", 1, (2, 0)])
def test_conv2d_every_padding(padding_mode, padding):
    """Explicitly: every padding mode with "same" (even kernel: asymmetric), "valid", int, tuple."""
    seeded(1)
    conv = nn.Conv2d(4, 6, (2, 3), padding=padding, dilation=(1, 2), groups=2, padding_mode=padding_mode)
    conv = conv.to(DTYPE)
    x = torch.randn(3, 4, 6, 7, dtype=DTYPE)
    assert_rule_matches_loop(conv, [x], "mean")


def test_conv_float32_tight():
    seeded(2)
    conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
    x = torch.randn(5, 3, 9, 9)
    assert_rule_matches_loop(conv, [x], "mean", atol=1e-5, rtol=1e-5)


def test_conv_uses_conv_rule_for_subclass():
    class MyConv(nn.Conv1d):
        pass

    assert find_grad_sampler(MyConv(1, 1, 1)) is conv_grad_sample
    assert find_grad_sampler(nn.ConvTranspose2d(1, 1, 1)) is None  # not a Conv2d; goes generic


# ------------------------------------------------------------------------------------ Embedding


@SWEEP
@given(
    n=st.integers(1, 4),
    middle=st.lists(st.integers(1, 4), max_size=2),
    num_embeddings=st.integers(1, 6),
    dim=st.integers(1, 4),
    padding=st.sampled_from([None, 0, -1]),
    scale_grad_by_freq=st.booleans(),
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_embedding_matches_loop(n, middle, num_embeddings, dim, padding, scale_grad_by_freq, reduction, seed):
    seeded(seed)
    emb = nn.Embedding(num_embeddings, dim, padding_idx=padding, scale_grad_by_freq=scale_grad_by_freq)
    emb = emb.to(DTYPE)
    x = torch.randint(0, num_embeddings, (n, *middle))
    grad_samples = assert_rule_matches_loop(emb, [x], reduction)
    if padding is not None:
        assert torch.all(grad_samples[emb.weight][:, emb.padding_idx] == 0)


def test_embedding_padding_row_gets_zero_gradient():
    emb = nn.Embedding(5, 3, padding_idx=2).to(DTYPE)
    x = torch.tensor([[2, 2, 1], [0, 2, 4]])
    grad_samples = assert_rule_matches_loop(emb, [x], "sum")
    assert torch.all(grad_samples[emb.weight][:, 2] == 0)
    assert torch.all(grad_samples[emb.weight][0, 1] != 0)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_embedding_broadcast_positions(reduction):
    """Position ids built as (1, T) and expanded to (N, T): a stride-0 batch dimension."""
    seeded(3)
    n, t = 4, 5
    emb = nn.Embedding(t, 3).to(DTYPE)
    positions = torch.arange(t).unsqueeze(0).expand(n, t)
    assert positions.stride(0) == 0
    grad_samples = assert_rule_matches_loop(emb, [positions], reduction)
    # every sample touches every row once, with its own output gradient R
    assert grad_samples[emb.weight].shape == (n, t, 3)


def test_embedding_max_norm_is_refused():
    emb = nn.Embedding(5, 3, max_norm=1.0)
    x = torch.randint(0, 5, (2, 3))
    out = emb(x)
    with pytest.raises(NotImplementedError) as info:
        compute_grad_samples(emb, [x], torch.ones_like(out), loss_reduction="sum", batch_size=2)
    assert str(info.value).startswith(
        "fxdp: no per-sample gradient rule for Embedding with max_norm=1.0: max_norm rescales the "
        "embedding rows in place during the forward pass"
    )
    assert "register your own rule with fxdp.register_grad_sampler" in str(info.value)


def _bag_case(seed, num_bags, num_embeddings, include_last_offset):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (num_bags,), generator=gen)  # empty bags included
    lengths[0] = max(int(lengths[0]), 1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    # with include_last_offset, entries after the last offset belong to no bag: add two
    trailing = 2 if include_last_offset else 0
    indices = torch.randint(0, num_embeddings, (int(offsets[-1]) + trailing,), generator=gen)
    weights = torch.randn(indices.shape[0], generator=gen, dtype=DTYPE)
    if not include_last_offset:
        offsets = offsets[:-1]
    return indices, offsets, weights, lengths


@SWEEP
@given(
    num_bags=st.integers(1, 4),
    num_embeddings=st.integers(1, 6),
    dim=st.integers(1, 3),
    mode=st.sampled_from(["sum", "mean"]),
    use_weights=st.booleans(),
    padding=st.sampled_from([None, 0]),
    include_last_offset=st.booleans(),
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_embedding_bag_offsets_matches_loop(
    num_bags, num_embeddings, dim, mode, use_weights, padding, include_last_offset, reduction, seed
):
    """A 1D input with offsets: each bag is one sample; the loop runs each bag alone."""
    use_weights = use_weights and mode == "sum"  # per_sample_weights exist only for "sum"
    seeded(seed)
    bag = nn.EmbeddingBag(
        num_embeddings, dim, mode=mode, padding_idx=padding, include_last_offset=include_last_offset
    ).to(DTYPE)
    indices, offsets, weights, lengths = _bag_case(seed, num_bags, num_embeddings, include_last_offset)
    if not use_weights:
        weights = None
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])

    def sample_output(i):
        lo, hi = int(starts[i]), int(starts[i + 1])
        one_offsets = torch.tensor([0, hi - lo] if include_last_offset else [0])
        w = None if weights is None else weights[lo:hi]
        return bag(indices[lo:hi], one_offsets, per_sample_weights=w)

    activations = [indices, offsets] + ([] if weights is None else [weights])
    assert_rule_matches_loop(
        bag,
        activations,
        reduction,
        forward=lambda: bag(indices, offsets, per_sample_weights=weights),
        sample_output=sample_output,
    )


@SWEEP
@given(
    n=st.integers(1, 4),
    length=st.integers(1, 4),
    num_embeddings=st.integers(1, 6),
    mode=st.sampled_from(["sum", "mean"]),
    use_weights=st.booleans(),
    padding=st.sampled_from([None, 1]),
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_embedding_bag_2d_matches_loop(n, length, num_embeddings, mode, use_weights, padding, reduction, seed):
    use_weights = use_weights and mode == "sum"
    if padding is not None and padding >= num_embeddings:
        padding = None
    seeded(seed)
    bag = nn.EmbeddingBag(num_embeddings, 3, mode=mode, padding_idx=padding).to(DTYPE)
    x = torch.randint(0, num_embeddings, (n, length))
    if use_weights:
        w = torch.randn(n, length, dtype=DTYPE)
        assert_rule_matches_loop(
            bag,
            [x, w],
            reduction,
            forward=lambda: bag(x, per_sample_weights=w),
            sample_output=lambda i: bag(x[i : i + 1], per_sample_weights=w[i : i + 1]),
        )
    else:
        assert_rule_matches_loop(bag, [x], reduction)


def test_embedding_bag_max_is_refused():
    bag = nn.EmbeddingBag(5, 3, mode="max")
    x = torch.randint(0, 5, (2, 3))
    out = bag(x)
    with pytest.raises(NotImplementedError) as info:
        compute_grad_samples(bag, [x], torch.ones_like(out), loss_reduction="sum", batch_size=2)
    assert str(info.value) == (
        "fxdp: no per-sample gradient rule for EmbeddingBag with mode='max'; modes 'sum' and 'mean' "
        "are supported. Use one of those, or register your own rule with fxdp.register_grad_sampler."
    )


# ---------------------------------------------------------------------------------------- Norms


@SWEEP
@given(
    n=st.integers(1, 4),
    middle=st.lists(st.integers(1, 3), max_size=2),
    normalized=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    affine=st.booleans(),
    bias=st.booleans(),
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_layer_norm_matches_loop(n, middle, normalized, affine, bias, reduction, seed):
    seeded(seed)
    norm = nn.LayerNorm(normalized, elementwise_affine=affine, bias=bias).to(DTYPE)
    with torch.no_grad():  # away from the default 1 / 0, so a swapped weight/bias would show
        for p in norm.parameters():
            p.normal_()
    x = torch.randn(n, *middle, *normalized, dtype=DTYPE)
    grad_samples = assert_rule_matches_loop(norm, [x], reduction)
    assert len(grad_samples) == (0 if not affine else 1 + bias)


@SWEEP
@given(
    n=st.integers(1, 4),
    middle=st.lists(st.integers(1, 3), max_size=2),
    normalized=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    affine=st.booleans(),
    eps=st.sampled_from([None, 1e-5]),
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_loop(n, middle, normalized, affine, eps, reduction, seed):
    seeded(seed)
    norm = nn.RMSNorm(normalized, eps=eps, elementwise_affine=affine).to(DTYPE)
    x = torch.randn(n, *middle, *normalized, dtype=DTYPE)
    grad_samples = assert_rule_matches_loop(norm, [x], reduction)
    assert len(grad_samples) == int(affine)


@SWEEP
@given(
    n=st.integers(1, 4),
    groups=st.integers(1, 3),
    per_group=st.integers(1, 2),
    spatial=st.lists(st.integers(1, 4), max_size=2),
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_group_norm_matches_loop(n, groups, per_group, spatial, reduction, seed):
    seeded(seed)
    channels = groups * per_group
    if per_group * math.prod(spatial) < 2:
        spatial = spatial + [2]  # group_norm refuses a group of one value
    norm = nn.GroupNorm(groups, channels).to(DTYPE)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    x = torch.randn(n, channels, *spatial, dtype=DTYPE)
    assert_rule_matches_loop(norm, [x], reduction)


@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("running", ["none", "train", "eval"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_instance_norm_matches_loop(ndim, running, reduction):
    seeded(ndim)
    cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[ndim]
    norm = cls(3, affine=True, track_running_stats=running != "none").to(DTYPE)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
        if running == "eval":
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
    norm.train(running != "eval")
    x = torch.randn(3, 3, *([4] * ndim), dtype=DTYPE)
    assert_rule_matches_loop(norm, [x], reduction)


def test_instance_norm_rule_does_not_update_running_stats():
    norm = nn.InstanceNorm2d(2, affine=True, track_running_stats=True).to(DTYPE)
    x = torch.randn(2, 2, 3, 3, dtype=DTYPE)
    out = norm(x)
    before = norm.running_mean.clone()
    compute_grad_samples(norm, [x], torch.ones_like(out), loss_reduction="sum", batch_size=2)
    torch.testing.assert_close(norm.running_mean, before, atol=0, rtol=0)


# ------------------------------------------------------------------------------- Generic (torch.func)


class ScaleShift(nn.Module):
    """Bare parameters, a buffer, a frozen parameter and a nested Linear."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(1, d))
        self.frozen = nn.Parameter(torch.randn(d), requires_grad=False)
        self.register_buffer("offset", torch.randn(d))
        self.inner = nn.Linear(d, d)

    def forward(self, x):
        return self.inner(torch.tanh(x * self.scale + self.shift) + self.frozen * self.offset)


class TwoInputs(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.query = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.randn(d))

    def forward(self, x, y):
        scores = self.query(x) @ y.transpose(-1, -2)  # (N, T, T): mixes positions, not samples
        return torch.softmax(scores, -1) @ y * torch.sigmoid(self.gate)


@SWEEP
@given(n=st.integers(1, 4), middle=st.lists(st.integers(1, 3), max_size=2), reduction=REDUCTIONS)
def test_functorch_rule_bare_parameters(n, middle, reduction):
    seeded(n)
    module = ScaleShift(3).to(DTYPE)
    assert find_grad_sampler(module) is None  # so compute_grad_samples takes the generic rule
    x = torch.randn(n, *middle, 3, dtype=DTYPE)
    grad_samples = assert_rule_matches_loop(module, [x], reduction)
    assert module.frozen not in grad_samples


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("n", [1, 3])
def test_functorch_rule_two_inputs(reduction, n):
    seeded(4)
    module = TwoInputs(4).to(DTYPE)
    x, y = torch.randn(n, 2, 4, dtype=DTYPE), torch.randn(n, 5, 4, dtype=DTYPE)
    assert_rule_matches_loop(module, [x, y], reduction)


def test_functorch_rule_agrees_with_hand_written_rule():
    seeded(5)
    layer = nn.Conv2d(2, 4, 3, padding=1, groups=2).to(DTYPE)
    x = torch.randn(3, 2, 5, 5, dtype=DTYPE)
    out = layer(x)
    backprops = loss_backprops(out, fixed_cotangent(out), "sum")
    generic = functorch_grad_sampler(layer, [x], backprops)
    specific = conv_grad_sample(layer, [x], backprops)
    for p in layer.parameters():
        torch.testing.assert_close(generic[p], specific[p], atol=1e-10, rtol=1e-8)


def test_functorch_rule_names_the_module_on_failure():
    module = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).train()
    x = torch.randn(2, 3)
    out = module(x)
    with pytest.raises(RuntimeError) as info:
        compute_grad_samples(module, [x], torch.ones_like(out), loss_reduction="sum", batch_size=2)
    assert str(info.value).startswith("fxdp: the generic per-sample rule (torch.func) failed on Sequential (")
    assert "Register a rule for it with fxdp.register_grad_sampler." in str(info.value)
    assert info.value.__cause__ is not None


# ------------------------------------------------------------------- functional_grad_samples


def _functional_case(fn, args, kwargs, param_positions, batched_positions, reduction):
    """Compare functional_grad_samples with a loop that slices the batched args per sample."""
    args = list(args)
    params = [args[p] if isinstance(p, int) else kwargs[p] for p in param_positions]

    def call(a, kw):
        return getattr(a[0], fn)(*a[1:], **kw) if isinstance(fn, str) else fn(*a, **kw)

    def sliced(i):
        a, kw = list(args), dict(kwargs)
        for pos in batched_positions:
            if isinstance(pos, int):
                a[pos] = a[pos][i : i + 1]
            else:
                kw[pos] = kw[pos][i : i + 1]
        return a, kw

    out = call(args, kwargs)
    n = out.shape[0]
    R = fixed_cotangent(out)
    backprops = loss_backprops(out, R, reduction) * (n if reduction == "mean" else 1)
    got = functional_grad_samples(fn, args, kwargs, param_positions, batched_positions, backprops)
    for k, p in enumerate(params):
        want = torch.stack([torch.autograd.grad((call(*sliced(i)) * R).sum(), p)[0] for i in range(n)])
        assert got[k].shape == (n, *p.shape)
        torch.testing.assert_close(got[k], want, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("n", [1, 3])
def test_functional_linear(n, reduction):
    seeded(6)
    x = torch.randn(n, 2, 4, dtype=DTYPE)
    w = nn.Parameter(torch.randn(3, 4, dtype=DTYPE))
    b = nn.Parameter(torch.randn(3, dtype=DTYPE))
    _functional_case(F.linear, [x, w], {"bias": b}, [1, "bias"], [0], reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_functional_mul_scale(reduction):
    seeded(7)
    x = torch.randn(4, 3, 5, dtype=DTYPE)
    scale = nn.Parameter(torch.randn(5, dtype=DTYPE))
    _functional_case(operator.mul, [x, scale], {}, [1], [0], reduction)


@pytest.mark.parametrize("pos_shape", [(1, 3, 2), (3, 2)])
def test_functional_add_pos_embedding(pos_shape):
    seeded(8)
    x = torch.randn(4, 3, 2, dtype=DTYPE)
    pos = nn.Parameter(torch.randn(*pos_shape, dtype=DTYPE))
    _functional_case(operator.add, [pos, x], {}, [0], [1], "mean")  # parameter on the left


@pytest.mark.parametrize("fn", [operator.matmul, "matmul"])
def test_functional_matmul_proj(fn):
    seeded(9)
    x = torch.randn(3, 2, 4, dtype=DTYPE)
    proj = nn.Parameter(torch.randn(4, 5, dtype=DTYPE))
    _functional_case(fn, [x, proj], {}, [1], [0], "sum")


def test_functional_rejects_output_without_batch_first():
    x = torch.randn(3, 4, dtype=DTYPE)
    w = nn.Parameter(torch.randn(4, dtype=DTYPE))
    with pytest.raises(RuntimeError, match="the output must be batch first"):
        functional_grad_samples(lambda a, b: (a * b).sum(), [x, w], {}, [1], [0], torch.ones(3, dtype=DTYPE))


# ------------------------------------------------------------------------------------ Registry


class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x * self.w * 2


def test_register_custom_rule_last_registration_wins():
    @register_grad_sampler(Doubler)
    def first(module, activations, backprops):
        return {module.w: torch.full((backprops.shape[0], 2), 1.0)}

    @register_grad_sampler([Doubler])
    def second(module, activations, backprops):
        return {module.w: 2 * activations[0] * backprops}

    module = Doubler().to(DTYPE)
    assert find_grad_sampler(module) is second
    assert_rule_matches_loop(module, [torch.randn(3, 2, dtype=DTYPE)], "mean")


def test_registered_rule_replaces_generic_rule():
    module = Doubler()
    x = torch.randn(3, 2)
    backprops = torch.ones(3, 2)
    generic = compute_grad_samples(module, [x], backprops, loss_reduction="sum", batch_size=3)
    torch.testing.assert_close(generic[module.w], 2 * x)

    @register_grad_sampler(Doubler)
    def marker(module, activations, backprops):
        return {module.w: torch.zeros(3, 2)}

    replaced = compute_grad_samples(module, [x], backprops, loss_reduction="sum", batch_size=3)
    assert torch.all(replaced[module.w] == 0)


def test_clean_registry_restores_builtin_rules():
    """Runs after the tests above: the fixture put the built-in rules back."""
    assert find_grad_sampler(nn.Linear) is linear_grad_sample
    assert find_grad_sampler(Doubler) is None
