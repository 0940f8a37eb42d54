"""The batch rules (fxdp/passes/batch_rules/): each family's rule on one op at a time, the building
blocks (reshape maps, einsum equations), and what happens where no rule exists: the op is unverified and
what follows unknown, or, in strict mode, an error naming the node, the op and the user's line.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxdp import meta
from fxdp.diagnostics import Kind, Severity, render_findings
from fxdp.grad_sample.registry import register_grad_sampler
from fxdp.layout import BatchLayout, UNBATCHED_LAYOUT, UNKNOWN_LAYOUT
from fxdp.passes import batch_rules
from fxdp.passes.batch_dim import MissingBatchRuleError
from fxdp.diagnostics import op_name
from fxdp.passes.batch_rules import find_batch_rule, keeps_layout, layout_through, parse_einsum, register_batch_rule, reshape_map
from tests.support.batch_dim_analysis import analyse, node_named
from tests.support.batch_models import N, T, D, E, marker_line



# --------------------------------------------------------------------------------------------
# Unverified ops, strict mode, custom rules
# --------------------------------------------------------------------------------------------


class Spectral(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x):
        h = self.lin(x)
        f = torch.fft.rfft(h)  # NO RULE
        return f.abs() + 1


def test_op_without_rule_is_unverified_and_what_follows_is_unknown():
    model = Spectral()
    gm, findings = analyse(model, torch.randn(N, D))
    assert [(f.kind, f.severity, f.op) for f in findings] == [(Kind.UNVERIFIED, Severity.WARNING, "torch.fft.rfft")]
    assert findings[0].location.line == marker_line(model, "NO RULE")[1]
    assert "no batch rule for torch.fft.rfft" in findings[0].message and "batch@0" in findings[0].message
    assert findings[0].path == ("x", "lin", "fft_rfft")
    assert node_named(gm, "fft_rfft").meta[meta.BATCH_LAYOUT] == UNKNOWN_LAYOUT
    assert node_named(gm, "add").meta[meta.BATCH_LAYOUT] == UNKNOWN_LAYOUT


def test_strict_mode_raises_on_an_op_without_rule_naming_node_op_and_line():
    model = Spectral()
    line = marker_line(model, "NO RULE")[1]
    with pytest.raises(MissingBatchRuleError) as info:
        analyse(model, torch.randn(N, D), strict=True)
    text = str(info.value)
    assert "no batch rule for torch.fft.rfft" in text and "node fft_rfft" in text
    assert f"test_rules.py:{line}" in text and "register_batch_rule" in text


class MaskSelect(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)

    def forward(self, x, keep):
        h = self.lin(x)
        picked = h[keep]  # DATA DEPENDENT
        return picked.sum(-1)


def test_data_dependent_shapes_are_unverified_not_a_crash():
    model = MaskSelect()
    gm, findings = analyse(model, (torch.randn(N, D), torch.tensor([True, False, True, True])))
    assert [f.kind for f in findings] == [Kind.UNVERIFIED]
    assert findings[0].location.line == marker_line(model, "DATA DEPENDENT")[1]
    assert "depends on the data" in findings[0].message
    assert node_named(gm, "getitem").meta[meta.FAKE_VALUE] is None
    assert node_named(gm, "sum_1").meta[meta.BATCH_LAYOUT] == UNKNOWN_LAYOUT


class ScaleBase(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(E))

    def forward(self, x):
        return x * self.scale


class Scale(ScaleBase):
    pass


def _scale_grad_sampler(module, activations, backprops):
    return {module.scale: (activations[0] * backprops).reshape(backprops.shape[0], -1, E).sum(1)}


class UsesScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, E)
        self.scale = Scale()

    def forward(self, x):
        return self.scale(self.lin(x))


def test_a_registered_rule_for_a_base_class_serves_its_subclasses():
    from fxdp.grad_sample.registry import _GRAD_SAMPLERS

    register_grad_sampler(Scale)(_scale_grad_sampler)  # makes Scale a layer the graph calls whole
    try:
        model = UsesScale()
        # no batch rule yet: the per-sample rule's contract (batch in dimension 0, in and out) is used
        gm, findings = analyse(model, torch.randn(N, D))
        assert findings == []
        assert node_named(gm, "scale").meta[meta.BATCH_LAYOUT] == BatchLayout.at(0)
        assert find_batch_rule(Scale()) is batch_rules.core._registered_layer
        register_batch_rule(ScaleBase)(keeps_layout)
        gm, findings = analyse(model, torch.randn(N, D))
        assert findings == []
        assert node_named(gm, "scale").meta[meta.BATCH_LAYOUT] == BatchLayout.at(0)
        assert find_batch_rule(Scale()) is keeps_layout
    finally:
        _GRAD_SAMPLERS.pop(Scale, None)
        batch_rules.core.LAYER_RULES.entries.pop(ScaleBase, None)


def test_registry_lookup_walks_the_mro_and_names_ops():
    class MyLinear(nn.Linear):
        pass

    assert find_batch_rule(MyLinear(2, 3)) is find_batch_rule(nn.Linear(2, 3)) is not None
    assert find_batch_rule("transpose") is find_batch_rule(torch.transpose)
    assert find_batch_rule(torch.fft.rfft) is None
    assert [op_name(o) for o in (torch.sum, F.softmax, operator.add, "transpose", nn.BatchNorm1d(3), MyLinear)] == [
        "torch.sum", "F.softmax", "operator.add", "transpose", "nn.BatchNorm1d", "MyLinear"]



# --------------------------------------------------------------------------------------------
# Rule building blocks
# --------------------------------------------------------------------------------------------


def test_reshape_maps_merge_and_split_the_batch():
    merged = layout_through(reshape_map((N, T, D), (N * T, D)), (N, T, D), BatchLayout.at(0), N)
    assert merged == BatchLayout.merged(0, T)
    time_major = layout_through(reshape_map((T, N, D), (T * N, D)), (T, N, D), BatchLayout.at(1), N)
    assert time_major == BatchLayout.merged(0, 1)
    back = layout_through(reshape_map((N * T, D), (N, T, D)), (N * T, D), BatchLayout.merged(0, T), N)
    assert back == BatchLayout.at(0)
    split_out = layout_through(reshape_map((T * N, D), (T, N, D)), (T * N, D), BatchLayout.merged(0, 1), N)
    assert split_out == BatchLayout.at(1)
    torn = layout_through(reshape_map((N, D), (2, N // 2, D)), (N, D), BatchLayout.at(0), N)
    assert torn == UNKNOWN_LAYOUT


def test_einsum_equations_with_ellipsis_and_implicit_output():
    labels, out = parse_einsum("...ij,jk", [(2, 3, 4, 5), (5, 6)])
    assert labels == [(("...", 0), ("...", 1), "i", "j"), ("j", "k")]
    assert out == (("...", 0), ("...", 1), "i", "k")
    labels, out = parse_einsum("bij, bjk -> bik", [(2, 3, 4), (2, 4, 5)])
    assert out == ("b", "i", "k")


# --------------------------------------------------------------------------------------------
# One op at a time: the families' rules on inputs with the batch at dim 0 (N=4)
# --------------------------------------------------------------------------------------------


class Apply(nn.Module):
    """Runs ``fn(self, x)``; ``layer`` is a submodule the graph calls whole."""

    def __init__(self, fn, layer=None):
        super().__init__()
        self.fn = fn
        self.layer = layer

    def forward(self, x):
        return self.fn(self, x)


class Apply2(Apply):
    def forward(self, x, y):
        return self.fn(self, x, y)


B0, B1, B2 = BatchLayout.at(0), BatchLayout.at(1), BatchLayout.at(2)
MIXES, MOVES = {Kind.MIXES_SAMPLES}, {Kind.MOVES_BATCH}
x2, x3, x4 = (lambda: torch.randn(N, D)), (lambda: torch.randn(N, T, D)), (lambda: torch.randn(N, C_, 6, 6))
C_ = 3

OPS = [
    # (name, fn, layer, inputs, layout of the output, kinds of findings)
    ("repeat_features", lambda s, x: x.repeat(1, 2), None, x2, B0, set()),
    ("repeat_batch_merges", lambda s, x: x.repeat(2, 1) + 1, None, x2, BatchLayout.merged(0, 1), MOVES),
    ("tile_leading", lambda s, x: torch.tile(x, (2, 1, 1)) * 2, None, x2, B1, MOVES),
    ("repeat_interleave_batch", lambda s, x: x.repeat_interleave(3, dim=0) * 2, None, x2, BatchLayout.merged(0, 3), MOVES),
    ("expand_new_leading", lambda s, x: x.expand(2, N, D) * 2, None, x2, B1, MOVES),
    ("squeeze_keeps", lambda s, x: x.unsqueeze(1).squeeze(1), None, x2, B0, set()),
    ("select_time", lambda s, x: x.select(1, 0), None, x3, B0, set()),
    ("select_batch", lambda s, x: x.select(0, 1), None, x3, UNBATCHED_LAYOUT, MIXES),
    ("narrow_time", lambda s, x: x.narrow(1, 1, 2), None, x3, B0, set()),
    ("narrow_batch", lambda s, x: x.narrow(0, 1, 2), None, x3, UNBATCHED_LAYOUT, MIXES),
    ("index_select_time", lambda s, x: x.index_select(1, torch.tensor([0, 2])), None, x3, B0, set()),
    ("gather_batch_index_per_sample", lambda s, x, i: torch.gather(x, 1, i), None,
     lambda: (torch.randn(N, D), torch.zeros(N, 2, dtype=torch.long)), B0, set()),
    ("scatter_features", lambda s, x: torch.zeros_like(x).scatter(1, torch.zeros(N, 1, dtype=torch.long), x), None,
     x2, B0, set()),
    ("scatter_batch", lambda s, x: torch.zeros_like(x).scatter_add(0, torch.zeros(N, D, dtype=torch.long), x), None,
     x2, UNBATCHED_LAYOUT, MIXES),
    ("take_flat", lambda s, x: torch.take(x, torch.tensor([0, 5])), None, x2, UNBATCHED_LAYOUT, MIXES),
    ("cosine_similarity_features", lambda s, x: F.cosine_similarity(x, x + 1), None, x2, B0, set()),
    ("cosine_similarity_batch", lambda s, x: F.cosine_similarity(x, x + 1, dim=0), None, x2, UNBATCHED_LAYOUT, MIXES),
    ("pairwise_distance", lambda s, x: F.pairwise_distance(x, x * 2), None, x2, B0, set()),
    ("tensordot_features", lambda s, x: torch.tensordot(x, torch.ones(D, 5), dims=1), None, x2, B0, set()),
    ("tensordot_batch", lambda s, x: torch.tensordot(x, torch.ones(N, 5), dims=([0], [0])), None, x2,
     UNBATCHED_LAYOUT, MIXES),
    ("outer_pairs", lambda s, x: torch.outer(x[:, 0], x[:, 1]), None, x2, B0, MIXES),
    ("addmm", lambda s, x: torch.addmm(torch.zeros(5), x, torch.ones(D, 5)), None, x2, B0, set()),
    ("functional_linear", lambda s, x: F.linear(x, torch.ones(5, D), torch.zeros(5)), None, x3, B0, set()),
    ("bilinear_layer", lambda s, x: s.layer(x, x), nn.Bilinear(D, D, 3), x2, B0, set()),
    ("functional_conv", lambda s, x: F.conv2d(x, torch.ones(2, C_, 3, 3)), None, x4, B0, set()),
    ("functional_pool", lambda s, x: F.max_pool2d(x, 2), None, x4, B0, set()),
    ("pool_with_indices", lambda s, x: F.max_pool2d(x, 2, return_indices=True)[0], None, x4, B0, set()),
    ("pool_batch_in_space", lambda s, x: F.avg_pool1d(x.T.unsqueeze(0), 2), None, x2, B2, MIXES | MOVES),
    ("interpolate", lambda s, x: F.interpolate(x, scale_factor=2.0), None, x4, B0, set()),
    ("pad_space", lambda s, x: F.pad(x, (1, 1)), None, x4, B0, set()),
    ("pad_batch", lambda s, x: F.pad(x, (0, 0, 1, 0)), None, x2, UNKNOWN_LAYOUT, MIXES),
    ("zero_pad_layer", lambda s, x: s.layer(x), nn.ZeroPad2d(1), x4, B0, set()),
    ("pixel_shuffle", lambda s, x: F.pixel_shuffle(x.repeat(1, 4, 1, 1)[:, :4], 2), None, x4, B0, set()),
    ("group_norm", lambda s, x: F.group_norm(x, 1), None, x4, B0, set()),
    ("instance_norm_layer", lambda s, x: s.layer(x), nn.InstanceNorm2d(C_), x4, B0, set()),
    ("instance_norm_batch_in_space", lambda s, x: s.layer(x.T.unsqueeze(0)), nn.InstanceNorm1d(D), x2, B2, MIXES | MOVES),
    ("layer_norm_module", lambda s, x: s.layer(x), nn.LayerNorm(D), x3, B0, set()),
    ("local_response_norm_batch", lambda s, x: s.layer(x.transpose(0, 1)), nn.LocalResponseNorm(2), x4, B1,
     MIXES | MOVES),
    ("embedding_functional", lambda s, x: F.embedding(x, torch.ones(10, 3)), None,
     lambda: torch.randint(0, 10, (N, T)), B0, set()),
    ("one_hot", lambda s, x: F.one_hot(x, 10).float(), None, lambda: torch.randint(0, 10, (N, T)), B0, set()),
    ("embedding_bag", lambda s, x: s.layer(x), nn.EmbeddingBag(10, 3), lambda: torch.randint(0, 10, (N, T)), B0, set()),
    ("split_features", lambda s, x: torch.split(x, 3, dim=1)[1], None, x2, B0, set()),
    ("unbind_time", lambda s, x: x.unbind(1)[0], None, x3, B0, set()),
    ("unbind_batch", lambda s, x: x.unbind(0)[0], None, x3, UNBATCHED_LAYOUT, MIXES),
    ("where_clamp", lambda s, x: torch.where(x > 0, x, torch.zeros(D)).clamp(-1, 1), None, x2, B0, set()),
    ("data_attribute", lambda s, x: x.data * 2, None, x2, B0, set()),
    ("lstm_cell", lambda s, x: s.layer(x)[0], nn.LSTMCell(D, 3), x2, B0, set()),
    ("flatten_layer_from_0", lambda s, x: s.layer(x) * 2, nn.Flatten(0), x3, BatchLayout.merged(0, T * D), MOVES),
    ("unflatten_layer", lambda s, x: s.layer(x), nn.Unflatten(1, (2, 4)), x2, B0, set()),
    ("softmax_layer_batch", lambda s, x: s.layer(x), nn.Softmax(dim=0), x2, B0, MIXES),
    ("softmax_implicit_dim", lambda s, x: F.softmax(x, dim=None), None, x2, B0, set()),
    ("cosine_similarity_layer", lambda s, x: s.layer(x, x), nn.CosineSimilarity(), x2, B0, set()),
    ("loss_reduction_none", lambda s, x: s.layer(x, torch.zeros(N, D)), nn.MSELoss(reduction="none"), x2, B0, set()),
    ("loss_mean_layer", lambda s, x: s.layer(x, torch.zeros(N, D)), nn.L1Loss(), x2, UNBATCHED_LAYOUT, MIXES),
    ("new_zeros_batch_sized", lambda s, x: x.new_zeros(x.size(0), 3), None, x2, B0, set()),
    ("arange_sample_index", lambda s, x: torch.arange(x.shape[0]), None, x2, B0, set()),
    ("full_unbatched", lambda s, x: x.new_full((2, 3), 1.0), None, x2, UNBATCHED_LAYOUT, set()),
    # the in-place add makes the zeros per-sample: summing them over the batch then mixes samples
    ("inplace_add_then_mix", lambda s, x: [b := x.new_zeros(N, D), b.add_(x), b.sum(0)][-1], None, x2,
     UNBATCHED_LAYOUT, MIXES),
    ("stack_time", lambda s, x: torch.stack([x, x], dim=1), None, x2, B0, set()),
    ("cat_two_layouts", lambda s, x: torch.cat([x[:, :N], x[:, :N].T], 1), None, x2, UNKNOWN_LAYOUT, MIXES | MOVES),
    ("baddbmm", lambda s, x: torch.baddbmm(torch.zeros(T, T), x, x.transpose(1, 2)), None, x3, B0, set()),
    ("matmul_vector", lambda s, x: x @ torch.ones(D), None, x3, B0, set()),
    ("einsum_implicit_output", lambda s, x: torch.einsum("ntd,de", x, torch.ones(D, 2)), None, x3, B1, set()),
]


@pytest.mark.parametrize("name, fn, layer, inputs, layout, kinds", OPS, ids=[o[0] for o in OPS])
def test_rule_gives_the_output_layout_and_findings(name, fn, layer, inputs, layout, kinds):
    example = inputs()
    model = (Apply2 if isinstance(example, tuple) else Apply)(fn, layer)
    gm, findings = analyse(model, example)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].meta[meta.BATCH_LAYOUT]
    assert out == layout, render_findings(findings)
    assert {f.kind for f in findings} == kinds, render_findings(findings)
