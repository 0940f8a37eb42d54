"""Models that once gave wrong or missing per-sample gradients: each is checked against batches of one
(or must be refused with a clear error), never trusted."""

import pytest
import torch
from torch import nn

import fxdp
from tests.support.per_sample_reference import assert_grad_samples_match, batch_loss, expected_grad_samples


class SlicedPositions(nn.Module):
    """`self.pos[:T]` with T equal to N: a shape that happens to match the batch is not the batch."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(10, 4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x + self.pos[: x.shape[1]])


class ClsToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # (N, T, 4)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.fc(tokens)


class ParameterThroughActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.raw = nn.Parameter(torch.randn(4))
        self.act = nn.Softplus()

    def forward(self, x):
        return self.fc(x) * self.act(self.raw)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out)


class PositionIdsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.pos = nn.Embedding(6, 4)

    def forward(self, ids, pos_ids):
        return self.tok(ids) + self.pos(pos_ids)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("model, x", [
    (SlicedPositions, lambda: torch.randn(4, 4, 4)),
    (ClsToken, lambda: torch.randn(4, 3, 4)),
    (ParameterThroughActivation, lambda: torch.randn(4, 4)),
    (Recurrent, lambda: torch.randn(3, 5, 4)),
], ids=["sliced_positions_T_equals_N", "cls_token", "parameter_through_activation", "lstm"])
def test_per_sample_gradients_match_batches_of_one(model, x, reduction):
    torch.manual_seed(0)
    assert_grad_samples_match(model(), x(), loss_reduction=reduction)


def test_a_sample_cannot_change_another_samples_gradient():
    torch.manual_seed(0)
    model = SlicedPositions()
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(4, 4, 4), loss_reduction="sum")
    x = torch.randn(4, 4, 4)

    def rows(inputs):
        fxdp.zero_grad_sample(model)
        (compiled(inputs) ** 2).sum().backward()
        return model.pos.grad_sample[:3].clone()

    changed = x.clone()
    changed[3] += 10.0
    torch.testing.assert_close(rows(x), rows(changed))


def test_unfreezing_after_compiling_gives_grad_samples():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(3, 4))
    model[0].requires_grad_(True)
    x = torch.randn(3, 4)
    expected, R = expected_grad_samples(model, x)
    batch_loss(compiled(x), R, "mean").backward()
    torch.testing.assert_close(model[0].weight.grad_sample, expected["0.weight"])


def test_a_random_op_under_the_generic_rule_is_an_error_not_a_wrong_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.3, batch_first=True))
    # an attention with add_bias_kv is not decomposed (fxdp.grad_sample.transformer): the layer takes the generic rule
    model[0].self_attn = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True, add_bias_kv=True)
    compiled = fxdp.compile_for_dp(model, example_inputs=torch.randn(3, 5, 8))
    with pytest.raises(RuntimeError, match=r"failed on '0' at node '_0': it uses random ops \(dropout\).*"
                                           r"set the layer's dropout to 0"):
        compiled(torch.randn(3, 5, 8)).sum().backward()


def test_a_first_batch_of_one_does_not_fix_the_layouts():
    torch.manual_seed(0)
    model = PositionIdsInput()
    compiled = fxdp.compile_for_dp(model)  # analysed on the first batch
    pos = torch.arange(5).unsqueeze(0)
    with torch.no_grad():
        compiled(torch.randint(0, 10, (1, 5)), pos)  # a smoke test with one sample
    ids = torch.randint(0, 10, (4, 5))
    expected, R = expected_grad_samples(model, (ids, pos))
    batch_loss(compiled(ids, pos), R, "mean").backward()
    torch.testing.assert_close(model.pos.weight.grad_sample, expected["pos.weight"])


def test_the_report_shows_the_layouts_found_on_the_first_batch():
    class Merged(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            n, t, d = x.shape
            return self.fc(x.reshape(n * t, d)).view(n, t, 2)

    compiled = fxdp.compile_for_dp(Merged())
    compiled(torch.randn(3, 5, 4))
    change = fxdp.report(compiled).pass_report("per_sample").changes[0]
    assert "input merged@0(inner=5)" in change.message


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_lstm_in_the_other_engines(mode):
    torch.manual_seed(0)
    assert_grad_samples_match(Recurrent(), torch.randn(3, 5, 4), mode=mode)


class TransposedWeightWithMaskAndTwoOutputs(nn.Module):
    """A parameter passed through a layer before it meets the input (`self.keep(self.w)`) sends the model
    to the whole-model engine; it must still take a batched keyword input and return a tuple."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.fc = nn.Linear(3, 2)
        self.keep = nn.Identity()

    def forward(self, x, mask=None):
        h = (x * mask) @ self.keep(self.w).t()
        return self.fc(h), h.sum(-1)


def test_the_whole_model_engine_takes_keyword_inputs_and_tuple_outputs():
    torch.manual_seed(0)
    model = TransposedWeightWithMaskAndTwoOutputs()
    x, mask = torch.randn(4, 4), (torch.rand(4, 4) > 0.3).float()
    compiled = fxdp.compile_for_dp(model, example_inputs={"x": x, "mask": mask}, loss_reduction="sum")
    rep = fxdp.report(compiled)
    assert rep.engine == "fx+whole-model" and "the whole model runs as one op" in rep.fallback_reason
    assert any("parameter 'w' reaches the loss through 'keep'" in f.message for f in rep.findings)

    R1, R2 = torch.randn(1, 2), torch.randn(1)
    out, total = compiled(x, mask=mask)
    ((out * R1).sum() + (total * R2).sum()).backward()
    for name, p in model.named_parameters():
        rows = []
        for i in range(4):
            o, t = model(x[i:i + 1], mask=mask[i:i + 1])
            rows.append(torch.autograd.grad((o * R1).sum() + (t * R2).sum(), p)[0])
        torch.testing.assert_close(p.grad_sample, torch.stack(rows), msg=name)


class LearnedInitialState(nn.Module):
    """Untraceable (a loop over the sequence length), with a learned state expanded to the batch."""

    def __init__(self):
        super().__init__()
        self.h0 = nn.Parameter(torch.randn(1, 6))
        self.cell = nn.GRUCell(3, 6)

    def forward(self, x):
        h = self.h0.expand(x.shape[0], -1)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return h


class BranchWithBareParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent: the hooks engine, and vmap cannot follow it either
            h = h * 2
        return h * self.scale


@pytest.mark.parametrize("model, x, engine", [
    # torch.fx cannot trace the loop over x.shape[1]; torch.export (the second front end) captures it
    (LearnedInitialState, lambda: torch.randn(4, 3, 3), "fx"),
    (BranchWithBareParameter, lambda: torch.randn(4, 4).abs(), "hooks"),
], ids=["learned_initial_state", "branch_with_bare_parameter"])
def test_untraceable_models_where_vmap_cannot_run_are_computed_sample_by_sample(model, x, engine):
    torch.manual_seed(0)
    compiled = assert_grad_samples_match(model(), x())
    assert fxdp.report(compiled).mode == engine


class TwoNamesOneWeight(nn.Module):
    """A layer without submodules holding one parameter under two names, and a frozen one: the generic rule
    sees each trainable parameter once."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.alias = self.w
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x):
        return torch.tanh(x @ self.w + self.frozen) @ self.alias.t()


class WithLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.odd = TwoNamesOneWeight()
        self.fc = nn.Linear(4, 3)
        self.fc.bias.requires_grad_(False)

    def forward(self, x):
        return self.fc(self.odd(x))


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_a_parameter_under_two_names_and_frozen_ones_in_one_layer(mode):
    torch.manual_seed(0)
    assert_grad_samples_match(WithLayers(), torch.randn(5, 4), mode=mode)


def test_trainable_parameters_lists_what_named_parameters_lists():
    from fxdp.grad_sample.accumulate import trainable_parameters

    torch.manual_seed(0)
    for module in (TwoNamesOneWeight(), WithLayers(), WithLayers().fc, nn.LSTM(3, 4), nn.Sequential()):
        expected = {name: p for name, p in module.named_parameters() if p.requires_grad}
        got = trainable_parameters(module)
        assert list(got) == list(expected) and all(got[k] is expected[k] for k in expected)


class ReturnsWhatFeedsItsOtherOutput(nn.Module):
    """``h = f(x); return h, g(h)``: the loss reaches ``f`` through ``h`` and through ``g(h)``, each path once.
    A weight shared through a layer (``self.keep(self.w)``) is a parametrised op the graph cannot serve."""

    def __init__(self, shared_weight_through_a_layer: bool):
        super().__init__()
        self.f, self.g = nn.Linear(4, 5), nn.Linear(5, 3)
        self.w, self.keep = nn.Parameter(torch.randn(5, 4)), nn.Identity()
        self.through_a_layer = shared_weight_through_a_layer

    def forward(self, x):
        h = torch.tanh(self.f(x))
        if self.through_a_layer:
            h = h + x @ self.keep(self.w).t()
        return h, self.g(h)


def _two_output_loss(h, y, R_h, R_y, in_place=False):
    if in_place:  # the second output changed after the model returned it (its own gradient is then doubled)
        y.mul_(2)
    return (h * R_h).sum() + (y * R_y).sum()


@pytest.mark.parametrize("in_place", [False, True], ids=["", "output_changed_in_place"])
@pytest.mark.parametrize("sent_by", ["a_forward_hook_of_yours", "a_parameter_the_graph_cannot_serve"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_whole_model_engine_counts_a_returned_tensor_that_feeds_another_once(sent_by, reduction, in_place):
    torch.manual_seed(0)
    model = ReturnsWhatFeedsItsOtherOutput(shared_weight_through_a_layer=sent_by != "a_forward_hook_of_yours")
    recorded = []
    if sent_by == "a_forward_hook_of_yours":
        model.f.register_forward_hook(lambda module, args, out: recorded.append(out.shape))
    x, R_h, R_y = torch.randn(4, 4), torch.randn(1, 5), torch.randn(1, 3)
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,), loss_reduction=reduction)
    rep = fxdp.report(compiled)
    assert rep.engine == "fx+whole-model", str(rep)
    recorded.clear()
    loss = _two_output_loss(*compiled(x), R_h, R_y, in_place)
    if sent_by == "a_forward_hook_of_yours":
        assert recorded == [(4, 5)]  # the hook runs with the model, on the batch
    (loss / 4 if reduction == "mean" else loss).backward()
    for name, p in model.named_parameters():
        rows = [torch.autograd.grad(_two_output_loss(*model(x[i:i + 1]), R_h, R_y, in_place), p, allow_unused=True)[0]
                for i in range(4)]
        expected = torch.stack([torch.zeros_like(p) if g is None else g for g in rows])
        torch.testing.assert_close(p.grad_sample, expected, msg=name)
