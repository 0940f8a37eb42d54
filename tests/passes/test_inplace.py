"""The inplace pass: every in-place form rewritten out of place, outputs unchanged, each rewrite
reported with the user's line; in-place ops with no safe rewrite kept and reported."""

from __future__ import annotations

import inspect
import operator
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fxdp import meta
from fxdp.diagnostics import Kind, Severity
from fxdp.grad_sample.registry import register_grad_sampler
from fxdp.passes.inplace import index_assign, remove_inplace_ops
from fxdp.tracing import trace

_IN_PLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.setitem,
}


def marker_line(marker: str) -> int:
    """Line number in this file of the line ending with ``# <marker>``."""
    lines, _ = inspect.getsourcelines(sys.modules[__name__])
    hits = [number for number, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def remaining_inplace(gm: torch.fx.GraphModule):
    """Nodes that still write in place, found independently of the pass's own classification."""
    left = []
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", n.target if isinstance(n.target, str) else "")
        if n.op == "call_function" and (
            n.target in _IN_PLACE_OPERATORS
            or (name.endswith("_") and name not in ("and_", "or_"))
            or n.kwargs.get("inplace") is True
            or "out" in n.kwargs
        ):
            left.append(n)
        elif n.op == "call_method" and n.target.endswith("_"):
            left.append(n)
        elif n.op == "call_module" and getattr(gm.get_submodule(n.target), "inplace", False) is True:
            left.append(n)
    return left


def clone_all(inputs):
    return tuple(t.clone() for t in inputs)


def rewrite(model: nn.Module):
    traced = trace(model)
    assert traced.ok, traced.reason
    return remove_inplace_ops(traced.graph_module)


def assert_rewritten(model, inputs, *, marker, op, message=None, seed=0):
    """(a) same outputs, (b) nothing in place left, (c) the rewrite reported at the marker's line."""
    torch.manual_seed(seed)
    expected = model(*clone_all(inputs))
    result = rewrite(model)
    gm = result.graph_module
    torch.manual_seed(seed)
    actual = gm(*clone_all(inputs))
    torch.testing.assert_close(actual, expected)
    assert remaining_inplace(gm) == [], gm.graph
    report = result.report
    assert report.name == "inplace"
    assert [f for f in report.findings if f.severity is not Severity.INFO] == []
    matching = [c for c in report.changes if c.op.startswith(op)]
    assert matching, [c.op for c in report.changes]
    change = matching[0]
    assert change.kind is Kind.REWRITE and change.severity is Severity.INFO
    assert os.path.samefile(change.location.file, __file__)
    assert change.location.line == marker_line(marker)
    if message is not None:
        assert change.message == message
    new_nodes = [n for n in gm.graph.nodes if meta.INPLACE_REWRITE in n.meta]
    assert new_nodes and all(n.meta[meta.SOURCE] is not None for n in new_nodes)
    return result


# -- augmented assignment ---------------------------------------------------------------------------


class Augmented(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x, other):
        y = x * 1
        if self.op == "iadd":
            y += other  # <iadd>
        elif self.op == "isub":
            y -= other  # <isub>
        elif self.op == "imul":
            y *= other  # <imul>
        elif self.op == "itruediv":
            y /= other  # <itruediv>
        elif self.op == "ifloordiv":
            y //= other  # <ifloordiv>
        elif self.op == "imod":
            y %= other  # <imod>
        elif self.op == "ipow":
            y **= other  # <ipow>
        elif self.op == "imatmul":
            y @= other  # <imatmul>
        elif self.op == "iand":
            y &= other  # <iand>
        elif self.op == "ior":
            y |= other  # <ior>
        elif self.op == "ixor":
            y ^= other  # <ixor>
        elif self.op == "ilshift":
            y <<= other  # <ilshift>
        elif self.op == "irshift":
            y >>= other  # <irshift>
        return y, x


_SYMBOL = {"iadd": "+", "isub": "-", "imul": "*", "itruediv": "/", "ifloordiv": "//", "imod": "%",
           "ipow": "**", "imatmul": "@", "iand": "&", "ior": "|", "ixor": "^", "ilshift": "<<", "irshift": ">>"}


def _augmented_inputs(op):
    if op in ("iand", "ior", "ixor"):
        return torch.randint(0, 16, (3, 4)), torch.randint(0, 16, (3, 4))
    if op in ("ilshift", "irshift"):
        return torch.randint(0, 16, (3, 4)), torch.randint(0, 3, (3, 4))
    if op == "imatmul":
        return torch.randn(3, 3), torch.randn(3, 3)
    if op == "ipow":
        return torch.rand(3, 4) + 0.5, torch.randn(3, 4)
    return torch.randn(3, 4), torch.rand(3, 4) + 0.5


@pytest.mark.parametrize("op", list(_SYMBOL))
def test_augmented_assignment_is_rewritten(op):
    plain = op[1:] if op not in ("iand", "ior") else op[1:] + "_"
    assert_rewritten(
        Augmented(op), _augmented_inputs(op), marker=op, op=f"operator.{op} → operator.{plain}",
        message=f"`y {_SYMBOL[op]}= other` rewritten as `y = y {_SYMBOL[op]} other`",
    )


# -- Tensor methods with a trailing underscore ------------------------------------------------------


class Method(nn.Module):
    """Each branch writes into ``y`` and returns ``y`` afterwards: later reads must see the write."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x, other):
        y = x * 2
        if self.op == "add_":
            y.add_(other, alpha=2)  # <add_>
        elif self.op == "sub_":
            y.sub_(other)  # <sub_>
        elif self.op == "mul_":
            y.mul_(other)  # <mul_>
        elif self.op == "div_":
            y.div_(other)  # <div_>
        elif self.op == "clamp_":
            y.clamp_(-0.5, 0.5)  # <clamp_>
        elif self.op == "clamp_min_":
            y.clamp_min_(0.1)  # <clamp_min_>
        elif self.op == "masked_fill_":
            y.masked_fill_(other > 1.0, -1.0)  # <masked_fill_>
        elif self.op == "copy_":
            y.copy_(other[0])  # <copy_>
        elif self.op == "fill_":
            y.fill_(3.0)  # <fill_>
        elif self.op == "zero_":
            y.zero_()  # <zero_>
        elif self.op == "sigmoid_":
            y.sigmoid_()  # <sigmoid_>
        elif self.op == "tanh_":
            y.tanh_()  # <tanh_>
        elif self.op == "exp_":
            y.exp_()  # <exp_>
        elif self.op == "neg_":
            y.neg_()  # <neg_>
        elif self.op == "abs_":
            y.abs_()  # <abs_>
        elif self.op == "pow_":
            y.pow_(2)  # <pow_>
        elif self.op == "sqrt_":
            y.abs_().sqrt_()  # <sqrt_>
        elif self.op == "relu_":
            y.relu_()  # <relu_>
        elif self.op == "addcmul_":
            y.addcmul_(other, other, value=0.5)  # <addcmul_>
        elif self.op == "index_fill_":
            y.index_fill_(1, torch.tensor([0, 2]), 7.0)  # <index_fill_>
        elif self.op == "scatter_":
            y.scatter_(1, torch.tensor([[1], [0], [3]]), other)  # <scatter_>
        elif self.op == "index_put_":
            y.index_put_((torch.tensor([0, 2]),), other[0])  # <index_put_>
        elif self.op == "eq_":
            y.eq_(other)  # <eq_>
        elif self.op == "normal_":
            y.normal_(0.0, 2.0)  # <normal_>
        elif self.op == "fill_diagonal_":
            y.fill_diagonal_(5.0)  # <fill_diagonal_>
        return y + 0, x


_METHOD_MESSAGES = {
    "add_": "`y.add_(other, alpha=2)` rewritten as `y = y.add(other, alpha=2)`",
    "masked_fill_": "`y.masked_fill_(other > 1.0, -1.0)` rewritten as `y = y.masked_fill(other > 1.0, -1.0)`",
    "copy_": "`y.copy_(other[0])` rewritten as `y = copy_into(y, other[0])`",
    "fill_": "`y.fill_(3.0)` rewritten as `y = torch.fill(y, 3.0)`",
    "zero_": "`y.zero_()` rewritten as `y = torch.zeros_like(y)`",
    "clamp_": "`y.clamp_(-0.5, 0.5)` rewritten as `y = y.clamp(-0.5, 0.5)`",
    "relu_": "`y.relu_()` rewritten as `y = y.relu()`",
}


@pytest.mark.parametrize(
    "op",
    ["add_", "sub_", "mul_", "div_", "clamp_", "clamp_min_", "masked_fill_", "copy_", "fill_", "zero_",
     "sigmoid_", "tanh_", "exp_", "neg_", "abs_", "pow_", "sqrt_", "relu_", "addcmul_", "index_fill_",
     "scatter_", "index_put_", "eq_", "normal_", "fill_diagonal_"],
)
def test_inplace_method_is_rewritten(op):
    x, other = torch.randn(3, 4), torch.rand(3, 4) + 0.5
    assert_rewritten(Method(op), (x, other), marker=op, op=f"Tensor.{op}", message=_METHOD_MESSAGES.get(op))


def test_comparison_in_place_keeps_the_dtype():
    result = rewrite(Method("eq_"))
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out, _ = result.graph_module(x, x * 2)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, torch.ones(2, 2))


# -- torch.* and F.* in-place functions ---------------------------------------------------------------


class Function(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        y = x * 2
        if self.op == "torch.relu_":
            torch.relu_(y)  # <torch.relu_>
        elif self.op == "torch.sigmoid_":
            torch.sigmoid_(y)  # <torch.sigmoid_>
        elif self.op == "torch.clamp_":
            torch.clamp_(y, min=-0.3, max=0.3)  # <torch.clamp_>
        elif self.op == "torch.zero_":
            torch.zero_(y)  # <torch.zero_>
        elif self.op == "F.leaky_relu_":
            F.leaky_relu_(y, 0.2)  # <F.leaky_relu_>
        elif self.op == "F.elu_":
            F.elu_(y)  # <F.elu_>
        elif self.op == "F.hardtanh_":
            F.hardtanh_(y, -0.5, 0.5)  # <F.hardtanh_>
        return y - 1


@pytest.mark.parametrize(
    "op", ["torch.relu_", "torch.sigmoid_", "torch.clamp_", "torch.zero_", "F.leaky_relu_", "F.elu_",
           "F.hardtanh_"],
)
def test_inplace_function_is_rewritten(op):
    assert_rewritten(Function(op), (torch.randn(3, 4),), marker=op, op=op)


def test_tensor_method_called_as_a_function_is_rewritten():
    # fx cannot trace `torch.Tensor.mul_(y, 3.0)`, but other tracers record it: build the graph by hand.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(operator.mul, (x, 2.0))
    graph.call_function(torch.Tensor.mul_, (y, 3.0))
    graph.output(y)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    result = remove_inplace_ops(gm)
    assert [c.op for c in result.report.changes] == ["Tensor.mul_ → Tensor.mul"]
    assert remaining_inplace(gm) == []
    torch.testing.assert_close(gm(torch.ones(2)), torch.full((2,), 6.0))


def test_torch_relu_message_names_the_rewrite():
    assert_rewritten(Function("torch.relu_"), (torch.randn(3, 4),), marker="torch.relu_", op="torch.relu_",
                     message="`torch.relu_(y)` rewritten as `y = torch.relu(y)`")


# -- functionals with inplace=True ----------------------------------------------------------------------

_FUNCTIONALS = {
    "relu": (F.relu, {}, (2, 3)),
    "relu6": (F.relu6, {}, (2, 3)),
    "leaky_relu": (F.leaky_relu, {"negative_slope": 0.2}, (2, 3)),
    "elu": (F.elu, {}, (2, 3)),
    "selu": (F.selu, {}, (2, 3)),
    "celu": (F.celu, {}, (2, 3)),
    "silu": (F.silu, {}, (2, 3)),
    "hardswish": (F.hardswish, {}, (2, 3)),
    "hardsigmoid": (F.hardsigmoid, {}, (2, 3)),
    "hardtanh": (F.hardtanh, {}, (2, 3)),
    "mish": (F.mish, {}, (2, 3)),
    "threshold": (F.threshold, {"threshold": 0.1, "value": 2.0}, (2, 3)),
    "dropout": (F.dropout, {"p": 0.5, "training": True}, (2, 3)),
    "dropout1d": (F.dropout1d, {"p": 0.5, "training": True}, (2, 3, 5)),
    "dropout2d": (F.dropout2d, {"p": 0.5, "training": True}, (2, 3, 4, 4)),
    "dropout3d": (F.dropout3d, {"p": 0.5, "training": True}, (2, 3, 2, 2, 2)),
    "alpha_dropout": (F.alpha_dropout, {"p": 0.5, "training": True}, (2, 3)),
    "feature_alpha_dropout": (F.feature_alpha_dropout, {"p": 0.5, "training": True}, (2, 3, 4)),
    "rrelu": (F.rrelu, {"training": True}, (2, 3)),
}


class Functional(nn.Module):
    def __init__(self, fn, kwargs):
        super().__init__()
        self.fn, self.kwargs = fn, kwargs

    def forward(self, x):
        y = x * 2
        z = self.fn(y, inplace=True, **self.kwargs)  # <functional>
        return z, y


@pytest.mark.parametrize("name", list(_FUNCTIONALS))
def test_functional_with_inplace_true_is_rewritten(name):
    fn, kwargs, shape = _FUNCTIONALS[name]
    result = assert_rewritten(Functional(fn, kwargs), (torch.randn(*shape),), marker="functional",
                              op=f"F.{name}(inplace=True) → F.{name}(inplace=False)")
    rewritten = [n for n in result.graph_module.graph.nodes if n.op == "call_function" and "inplace" in n.kwargs]
    assert [n.kwargs["inplace"] for n in rewritten] == [False]


# -- modules built with inplace=True ----------------------------------------------------------------------

_MODULES = {
    "ReLU": (lambda: nn.ReLU(inplace=True), (2, 3)),
    "ReLU6": (lambda: nn.ReLU6(inplace=True), (2, 3)),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.2, inplace=True), (2, 3)),
    "ELU": (lambda: nn.ELU(inplace=True), (2, 3)),
    "SELU": (lambda: nn.SELU(inplace=True), (2, 3)),
    "CELU": (lambda: nn.CELU(inplace=True), (2, 3)),
    "SiLU": (lambda: nn.SiLU(inplace=True), (2, 3)),
    "Hardswish": (lambda: nn.Hardswish(inplace=True), (2, 3)),
    "Hardsigmoid": (lambda: nn.Hardsigmoid(inplace=True), (2, 3)),
    "Hardtanh": (lambda: nn.Hardtanh(-0.5, 0.5, inplace=True), (2, 3)),
    "Mish": (lambda: nn.Mish(inplace=True), (2, 3)),
    "Threshold": (lambda: nn.Threshold(0.1, 20.0, inplace=True), (2, 3)),
    "RReLU": (lambda: nn.RReLU(inplace=True), (2, 3)),
    "Dropout": (lambda: nn.Dropout(0.5, inplace=True), (2, 3)),
    "Dropout1d": (lambda: nn.Dropout1d(0.5, inplace=True), (2, 3, 5)),
    "Dropout2d": (lambda: nn.Dropout2d(0.5, inplace=True), (2, 3, 4, 4)),
    "Dropout3d": (lambda: nn.Dropout3d(0.5, inplace=True), (2, 3, 2, 2, 2)),
    "AlphaDropout": (lambda: nn.AlphaDropout(0.5, inplace=True), (2, 3)),
    "FeatureAlphaDropout": (lambda: nn.FeatureAlphaDropout(0.5, inplace=True), (2, 3, 4)),
}


class WithModule(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        y = x * 2
        z = self.act(y)  # <module>
        return z, y  # y was overwritten by the in-place module: it must read z's values


@pytest.mark.parametrize("name", list(_MODULES))
def test_module_with_inplace_true_is_swapped_for_a_copy(name):
    make, shape = _MODULES[name]
    model = WithModule(make())
    user_module = model.act
    result = assert_rewritten(model, (torch.randn(*shape),), marker="module",
                              op=f"nn.{name}(inplace=True) → nn.{name}(inplace=False)")
    gm = result.graph_module
    assert model.act is user_module and model.act.inplace is True  # (d) the user's model is untouched
    assert gm.act is not user_module and type(gm.act) is type(user_module) and gm.act.inplace is False
    change = result.report.changes[0]
    assert change.message == (f"`z = self.act(y)` calls `act` (nn.{name}(inplace=True)); it now runs a copy "
                              f"with inplace=False (the model's own {name} is unchanged)")


def test_module_nested_in_a_leaf_called_whole_gets_a_new_name():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.lin(x)

    register_grad_sampler(Block)(lambda module, activations, backprops: {})  # a leaf for the tracer

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            y = self.block(x) * 2
            return self.block.act(y), y

    model = Model()
    x = torch.randn(2, 3)
    expected = model(x)
    gm = rewrite(model).graph_module
    torch.testing.assert_close(gm(x), expected)
    assert model.block.act.inplace is True  # gm.block is the user's Block: it must not be touched
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert called == ["block", "block_act_out_of_place"]
    assert gm.block_act_out_of_place.inplace is False


# -- item assignment -------------------------------------------------------------------------------------


class SetItem(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.lin = nn.Linear(4, 4)

    def forward(self, x, v):
        y = self.lin(x)
        if self.op == "bool_mask":
            y[y > 0] = 0.0  # <bool_mask>
        elif self.op == "mask_tensor_value":
            y[v > 0.5] = v[v > 0.5] * 3  # <mask_tensor_value>
        elif self.op == "index":
            y[1] = v[0]  # <index>
        elif self.op == "slice":
            y[:, 1:3] = v[:, :2]  # <slice>
        elif self.op == "tensor_index":
            y[torch.tensor([0, 2])] = v[0]  # <tensor_index>
        elif self.op == "mixed":
            y[1:, torch.tensor([0, 3])] = -1.0  # <mixed>
        elif self.op == "ellipsis":
            y[..., None, 0] = v[:, :1]  # <ellipsis>
        elif self.op == "augmented":
            y[:, 0] += v[:, 1]  # <augmented>
        return y * 2


_SETITEM_MESSAGES = {
    "bool_mask": "`y[y > 0] = 0.0` rewritten as `y = index_assign(y, [y > 0], 0.0)`",
    "index": "`y[1] = v[0]` rewritten as `y = index_assign(y, [1], v[0])`",
}


@pytest.mark.parametrize(
    "op", ["bool_mask", "mask_tensor_value", "index", "slice", "tensor_index", "mixed", "ellipsis", "augmented"]
)
def test_item_assignment_is_rewritten_and_differentiable(op):
    model = SetItem(op)
    x, v = torch.randn(3, 4), torch.rand(3, 4).requires_grad_()
    result = assert_rewritten(model, (x, v), marker=op, op="operator.setitem → index_assign",
                              message=_SETITEM_MESSAGES.get(op))
    # Gradients through the rewrite match the eager in-place model's.
    v_eager = v.detach().clone().requires_grad_()
    model(x, v_eager).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()] + [v_eager.grad]
    model.zero_grad()
    v_graph = v.detach().clone().requires_grad_()
    result.graph_module(x, v_graph).square().sum().backward()
    actual = [p.grad for p in model.parameters()] + [v_graph.grad]
    torch.testing.assert_close(actual, expected)


def test_augmented_item_assignment_reports_both_halves():
    result = rewrite(SetItem("augmented"))
    line = marker_line("augmented")
    assert [(c.op, c.location.line, c.message) for c in result.report.changes] == [
        ("operator.iadd → operator.add", line, "`y[:, 0] += v[:, 1]` rewritten as `y[:, 0] = y[:, 0] + v[:, 1]`"),
        ("operator.setitem → index_assign", line,
         "`y[:, 0] += v[:, 1]` rewritten as `y = index_assign(y, [:, 0], y[:, 0] + v[:, 1])`"),
    ]


_BASIC_INDEX = st.one_of(
    st.integers(-2, 1),
    st.builds(slice, st.one_of(st.none(), st.integers(-3, 2)), st.one_of(st.none(), st.integers(-2, 3)),
              st.one_of(st.none(), st.integers(1, 2))),
    st.just(None),
)


@settings(max_examples=30, deadline=None)
@given(index=st.lists(_BASIC_INDEX, min_size=1, max_size=3), ellipsis_at=st.integers(-1, 3),
       scalar=st.booleans())
def test_index_assign_matches_setitem_for_basic_indexing(index, ellipsis_at, scalar):
    index = tuple(index)
    if 0 <= ellipsis_at <= len(index):
        index = index[:ellipsis_at] + (Ellipsis,) + index[ellipsis_at:]
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    region = x.detach()[index]
    value = torch.tensor(1.5, dtype=torch.float64) if scalar else torch.randn(region.shape, dtype=torch.float64)
    value.requires_grad_()
    expected = x.detach().clone()
    expected[index] = value.detach()
    out = index_assign(x, index, value)
    torch.testing.assert_close(out, expected)
    weights = torch.randn(out.shape, dtype=torch.float64)
    grad_x, grad_v = torch.autograd.grad((out * weights).sum(), (x, value), allow_unused=True)
    written = torch.zeros_like(expected, dtype=torch.bool)
    written[index] = True
    torch.testing.assert_close(grad_x, torch.where(written, 0.0, weights))
    expected_grad_v = weights[index].sum() if scalar else weights[index]
    torch.testing.assert_close(grad_v, expected_grad_v)


# -- a ResNet-style block -----------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, channels=4):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(2, channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.GroupNorm(2, channels)

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)  # <resnet relu 1>
        out = self.conv2(out)
        out = self.bn2(out)
        out += identity  # <resnet iadd>
        out = self.relu(out)  # <resnet relu 2>
        return out


def test_resnet_block_outputs_gradients_and_report():
    model = BasicBlock()
    x = torch.randn(2, 4, 5, 5)
    expected = model(x)
    expected.square().sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    result = rewrite(model)
    gm = result.graph_module
    out = gm(x)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    torch.testing.assert_close([p.grad for p in model.parameters()], expected_grads)
    assert remaining_inplace(gm) == []
    assert model.relu.inplace is True and gm.relu.inplace is False
    assert [(c.op, c.location.line, c.message) for c in result.report.changes] == [
        ("nn.ReLU(inplace=True) → nn.ReLU(inplace=False)", marker_line("resnet relu 1"),
         "`out = self.relu(out)` calls `relu` (nn.ReLU(inplace=True)); it now runs a copy with inplace=False "
         "(the model's own ReLU is unchanged)"),
        ("operator.iadd → operator.add", marker_line("resnet iadd"),
         "`out += identity` rewritten as `out = out + identity`"),
        ("nn.ReLU(inplace=True) → nn.ReLU(inplace=False)", marker_line("resnet relu 2"),
         "`out = self.relu(out)` calls `relu` (nn.ReLU(inplace=True)); it now runs a copy with inplace=False "
         "(the model's own ReLU is unchanged)"),
    ]
    assert result.report.findings == ()
    assert all(os.path.samefile(c.location.file, __file__) for c in result.report.changes)


# -- aliasing: what can and cannot be rewritten --------------------------------------------------------------


class Aliasing(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case

    def forward(self, x):
        y = x * 2
        if self.case == "view_of_base_used_later":
            v = y.view(-1)
            v.add_(1)  # <view_of_base_used_later>
            return y
        if self.case == "base_with_live_view":
            v = y[0]
            y.mul_(3)  # <base_with_live_view>
            return v
        if self.case == "getitem_view_written_back":
            y[0].mul_(3)  # <getitem_view_written_back>
            return y
        if self.case == "disjoint_chunks":
            a, b = y.chunk(2)
            a.add_(1)  # <disjoint_chunks>
            return a, b
        raise AssertionError(self.case)


@pytest.mark.parametrize("case", ["view_of_base_used_later", "base_with_live_view"])
def test_write_through_an_alias_read_later_is_kept_and_reported(case):
    model = Aliasing(case)
    x = torch.randn(2, 3)
    expected = model(x)
    result = rewrite(model)
    torch.testing.assert_close(result.graph_module(x), expected)
    assert result.report.changes == ()
    (finding,) = result.report.findings
    assert finding.severity is Severity.WARNING
    assert finding.location.line == marker_line(case)
    assert "shares memory with" in finding.message and "the op is kept" in finding.message
    assert len(remaining_inplace(result.graph_module)) == 1


@pytest.mark.parametrize("case", ["getitem_view_written_back", "disjoint_chunks"])
def test_write_into_a_view_that_can_be_rewritten(case):
    assert_rewritten(Aliasing(case), (torch.randn(4, 3),), marker=case, op="Tensor.")


def test_write_into_a_model_input_is_rewritten_with_a_warning():
    class WritesInput(nn.Module):
        def forward(self, x):
            x.mul_(2)  # <input write>
            return x + 1

    model = WritesInput()
    x = torch.randn(2, 3)
    expected = model(x.clone())
    result = rewrite(model)
    x_before = x.clone()
    torch.testing.assert_close(result.graph_module(x), expected)
    torch.testing.assert_close(x, x_before)  # the caller's tensor is no longer modified
    (change,) = result.report.changes
    (finding,) = result.report.findings
    assert finding.severity is Severity.WARNING and finding.location.line == marker_line("input write")
    assert finding.message == ("`x.mul_(2)` wrote into the model input `x`; after the rewrite the caller's "
                               "tensor is left unchanged (the model's outputs are the same).")


def test_write_into_a_parameter_is_kept_as_an_error():
    class WritesParameter(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            with torch.no_grad():
                self.scale.mul_(0.5)  # <parameter write>
            return x * self.scale

    model = WritesParameter()
    result = rewrite(model)
    (finding,) = result.report.findings
    assert finding.severity is Severity.ERROR and finding.kind is Kind.CANNOT_BE_PRIVATE
    assert finding.location.line == marker_line("parameter write")
    assert finding.message.startswith("`self.scale.mul_(0.5)` writes into parameter `scale` during forward")
    assert len(remaining_inplace(result.graph_module)) == 1
    torch.testing.assert_close(model.scale.detach(), torch.ones(3))  # tracing and the pass ran nothing


def test_inplace_op_without_equivalent_is_kept_and_reported():
    class Resizes(nn.Module):
        def forward(self, x):
            y = x * 1
            y.resize_(6)  # <resize>
            return y

    result = rewrite(Resizes())
    (finding,) = result.report.findings
    assert finding.severity is Severity.WARNING and finding.location.line == marker_line("resize")
    assert finding.message == ("`y.resize_(6)`: `Tensor.resize_` changes the tensor's storage and has no "
                               "out-of-place equivalent; the op is kept.")


def test_out_argument_is_rewritten():
    class WritesOut(nn.Module):
        def forward(self, a, b):
            y = a * 1
            torch.add(a, b, out=y)  # <out>
            return y

    assert_rewritten(WritesOut(), (torch.randn(3), torch.randn(3)), marker="out", op="torch.add(out=...)")


def test_rewritten_graph_module_keeps_working_after_recompile_and_deepcopy():
    import copy

    result = rewrite(SetItem("bool_mask"))
    clone = copy.deepcopy(result.graph_module)
    x, v = torch.randn(3, 4), torch.rand(3, 4)
    torch.testing.assert_close(clone(x, v), result.graph_module(x, v))
    assert "index_assign" in result.graph_module.code
