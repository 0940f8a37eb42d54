"""The inplace pass on item assignment (rewritten to a differentiable index_assign), a ResNet-style block,
and aliasing: writes through views that can be rewritten, and those kept and reported (an alias read
later, a parameter, an op without an out-of-place equivalent)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fxdp.diagnostics import Kind, Severity
from fxdp.passes.inplace import index_assign
from tests.support.inplace_rewrites import assert_rewritten, line_marked, remaining_inplace, rewrite


def marker_line(marker: str) -> int:
    """Line number in this file of the line ending with ``# <marker>``."""
    return line_marked(sys.modules[__name__], marker)


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
