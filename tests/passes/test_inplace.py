"""The inplace pass: every in-place form rewritten out of place (augmented assignment, methods with a
trailing underscore, torch.* and F.* in-place functions, ``inplace=True`` functionals and modules),
outputs unchanged, each rewrite reported with the user's line. Item assignment, aliasing and what is
kept: test_inplace_aliasing.py."""

from __future__ import annotations

import operator
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxdp.grad_sample.registry import register_grad_sampler
from fxdp.passes.inplace import remove_inplace_ops
from tests.support.inplace_rewrites import assert_rewritten, line_marked, remaining_inplace, rewrite


def marker_line(marker: str) -> int:
    """Line number in this file of the line ending with ``# <marker>``."""
    return line_marked(sys.modules[__name__], marker)


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
