"""Models no front end captures (tests/support/untraceable_zoo.py): their untraceable submodules run as one op on the
hooks engine (fxdp/engines/blocks.py). Per-sample gradients against batches of one in float64, and the refusals
of the blocks that mix samples, on the first batch and on a later one."""

import pytest
import torch
import torch.nn.functional as F

import fxdp
from fxdp.diagnostics import BatchMixingError, LayerBatchError, SampleMixingError
from fxdp.engines import GradSampleModule
from fxdp.engines.blocks import BlockGradSampleModule
from tests.support.untraceable_zoo import ZOO, BatchBranchNet


def _grads_alone(model, inputs, targets):
    rows = []
    for i in range(len(targets)):
        model.zero_grad()
        F.cross_entropy(model(*[t[i:i + 1] for t in inputs]), targets[i:i + 1]).backward()
        rows.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                     for n, p in model.named_parameters()})
    return rows


@pytest.mark.parametrize("name, engine_type, blocks", [
    ("chunked_encoder", BlockGradSampleModule, ("block",)),
    ("adaptive_depth", BlockGradSampleModule, ("depth",)),
    ("root_item", GradSampleModule, ()),
])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_per_sample_gradients_equal_batches_of_one(name, engine_type, blocks, loss_reduction):
    model, inputs, targets = ZOO[name]()
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction=loss_reduction)
    assert type(compiled) is engine_type
    assert getattr(compiled, "blocks", ()) == blocks
    assert fxdp.report(compiled).engine == "hooks"
    F.cross_entropy(compiled(*inputs), targets, reduction=loss_reduction).backward()
    assert compiled.verification == "verified on a batch of 4: outputs independent across samples, per-sample " \
                                    "gradients equal to batches of one"
    got = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
    assert all(g.shape[0] == len(targets) for g in got.values())
    for i, alone in enumerate(_grads_alone(model, inputs, targets)):
        for n, g in alone.items():
            torch.testing.assert_close(got[n][i], g, rtol=1e-9, atol=1e-12, msg=f"{name}: {n}, sample {i}")


def test_the_block_is_one_layer_and_its_inner_layers_are_not_hooked():
    model, inputs, targets = ZOO["chunked_encoder"]()
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs)
    assert compiled.grad_sample_layers == {
        "embed": "rule for Embedding",
        "head": "rule for Linear",
        "block": "block: generic (its whole subtree), checked against each sample alone",
    }


def test_a_second_batch_of_another_length_trains_too():
    model, inputs, targets = ZOO["chunked_encoder"]()
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs)
    F.cross_entropy(compiled(*inputs), targets).backward()
    compiled.zero_grad()
    ids = torch.tensor([[4, 4, 4, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8], [9, 0, 0, 0, 0, 0, 0, 0]])
    y = torch.tensor([2, 0, 1])
    F.cross_entropy(compiled(ids), y).backward()
    got = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
    for i, alone in enumerate(_grads_alone(model, (ids,), y)):
        for n, g in alone.items():
            torch.testing.assert_close(got[n][i], g, rtol=1e-9, atol=1e-12)


MIXING = {
    "batch_branch": ("branch", "BatchBranch", 3, "outputs up to 1.01"),
    "batch_loop": ("loop", "BatchLoopCount", 2, "outputs up to 0.861"),
}


@pytest.mark.parametrize("name", sorted(MIXING))
def test_a_block_that_mixes_samples_is_refused_with_its_name(name):
    path, kind, sample, found = MIXING[name]
    model, inputs, targets = ZOO[name]()
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs)
    assert (compiled.blocks, compiled.candidates) == ((), (path,))  # its layers see the batch: per-layer rules
    with pytest.raises(SampleMixingError) as info:
        compiled(*inputs)
    text = str(info.value)
    assert text.startswith(
        f"fxdp (hooks engine): untraceable part '{path}' ({kind}), which no front end captures, mixes samples: on a "
        "batch of 4 samples its output differs from each sample's alone, so per-sample gradients would be wrong; it "
        "is refused (on this batch and every later one):")
    (finding,) = info.value.findings
    assert (finding.node, finding.op) == (path, kind)
    assert finding.message == (
        f"sample {sample} alone through the part gives {found} other than its rows of the batch's output (4 "
        "samples): what the part computes for a sample depends on the other samples (control flow on a value of "
        "the whole batch: its sum, its largest value, its longest sequence)")
    assert finding.location is not None and finding.location.file.endswith("untraceable_zoo.py")
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    with pytest.raises(SampleMixingError, match="was refused on an earlier batch"):
        compiled(*inputs)


def _rows(model, sign, count, seed):
    """``count`` inputs whose hidden row (model.inp) sums to a value of ``sign``."""
    g = torch.Generator().manual_seed(seed)
    found = []
    while len(found) < count:
        x = torch.randn(1, 4, generator=g, dtype=torch.float64)
        with torch.no_grad():
            if (model.inp(x).sum() > 0) == (sign > 0):
                found.append(x)
    return torch.cat(found)


def test_a_later_batch_that_mixes_samples_is_refused_at_its_forward():
    torch.manual_seed(0)
    model = BatchBranchNet().double()
    first = _rows(model, +1, 4, 1)  # every sample alone takes the batch's branch: nothing mixes
    compiled = fxdp.compile_for_dp(model, example_inputs=(first,))
    y = torch.tensor([0, 1, 1, 0])
    F.cross_entropy(compiled(first), y).backward()
    assert model.branch.b.weight.grad_sample is None  # the branch not taken: no per-sample gradient, none alone
    got = {n: p.grad_sample.clone() if p.grad_sample is not None else torch.zeros(4, *p.shape, dtype=p.dtype)
           for n, p in model.named_parameters()}
    for i, alone in enumerate(_grads_alone(model, (first,), y)):
        for n, g in alone.items():
            torch.testing.assert_close(got[n][i], g, rtol=1e-9, atol=1e-12)
    compiled.zero_grad()
    later = torch.cat([_rows(model, +1, 3, 2) * 3, _rows(model, -1, 1, 3)])  # sample 3 alone takes the other branch
    with torch.no_grad():
        assert model.inp(later).sum() > 0 and model.inp(later[3:]).sum() < 0
    with pytest.raises(SampleMixingError, match=r"untraceable part 'branch' \(BatchBranch\)") as info:
        compiled(later)
    assert info.value.findings[0].message.startswith("sample 3 alone through the part gives outputs up to")
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_the_hooks_engine_asked_for_is_unchanged():
    model, inputs, targets = ZOO["chunked_encoder"]()
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, grad_sample_mode="hooks")
    assert type(compiled) is GradSampleModule
    with pytest.raises(LayerBatchError, match=r"layer 'block.mix' \(Linear\) does not see the batch"):
        compiled(*inputs)


def test_a_row_loop_torch_export_captures_is_refused_by_the_batch_analysis():
    """torch.fx rejects the loop over the rows, torch.export captures it as an unbind of the batch dimension,
    which the batch_dim pass refuses (it cannot tell that the rows are stacked back in order)."""
    model, inputs, _ = ZOO["row_loop"]()
    with pytest.raises(BatchMixingError) as info:
        fxdp.compile_for_dp(model, example_inputs=inputs)
    (finding,) = [f for f in info.value.findings if f.node == "unbind"]
    assert finding.message == ("splits the batch dimension (dim 0) into groups of samples by position: what follows "
                               "can combine them")


@pytest.mark.parametrize("name", ["chunked_encoder", "adaptive_depth"])
def test_make_private_steps_by_the_clipped_per_sample_gradients(name):
    """A noise-free private step (book-kept, the default) on a model with a block: the update is the clipped
    per-sample gradients (each sample alone) averaged, as DP-SGD defines it."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.support.opacus_examples import clipped_mean_update

    model, inputs, targets = ZOO[name]()
    loader = DataLoader(TensorDataset(*inputs, targets), batch_size=len(targets))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    private, optimizer, loader = fxdp.PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=0.05)
    assert isinstance(private, BlockGradSampleModule) and private.blocks == (ZOO_BLOCKS[name],)
    *batch, y = next(iter(loader))  # sampling rate 1: every sample
    assert len(y) == len(targets)

    def loss_of_sample(m, i):
        return F.cross_entropy(m(*[t[i:i + 1] for t in batch]), y[i:i + 1])

    expected = clipped_mean_update(model, loss_of_sample, len(y), 0.05, optimizer.expected_batch_size)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    optimizer.zero_grad()
    F.cross_entropy(private(*batch), y).backward()
    optimizer.step()
    for k, p in model.named_parameters():
        torch.testing.assert_close(before[k] - p.detach(), expected[k], rtol=1e-7, atol=1e-10, msg=k)


ZOO_BLOCKS = {"chunked_encoder": "block", "adaptive_depth": "depth"}


class _TwoOutputs(torch.nn.Module):
    """Untraceable (a step count from each sample's own value); its second output is the batch's mean (``mix``)."""

    def __init__(self, dropout: float = 0.0, mix: bool = True):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(dropout)
        self.mix = mix

    def forward(self, h):
        rows = []
        for row in h.split(1):
            for _ in range(1 + int(row.abs().sum().item()) % 2):
                row = torch.tanh(self.drop(self.fc(row)))
            rows.append(row)
        out = torch.cat(rows)
        return out, (out.mean(0, keepdim=True).expand_as(out) if self.mix else out.detach().clone())


class _TwoOutputsNet(torch.nn.Module):
    def __init__(self, dropout: float = 0.0, mix: bool = True):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.block = _TwoOutputs(dropout, mix)
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        h, mean = self.block(self.inp(x))
        return self.out(h + mean.detach())


def test_a_block_output_that_mixes_samples_is_found_whichever_output_it_is():
    torch.manual_seed(0)
    model = _TwoOutputsNet().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,))
    assert compiled.blocks + compiled.candidates == ("block",)
    with pytest.raises(SampleMixingError, match=r"untraceable part 'block' \(_TwoOutputs\)") as info:
        compiled(x)
    assert info.value.findings[0].message.startswith("sample 0 alone through the part gives outputs up to")


def test_a_block_with_dropout_in_training_is_refused():
    from fxdp.diagnostics.errors import PerSampleError

    torch.manual_seed(0)
    model = _TwoOutputsNet(dropout=0.1, mix=False).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,))
    with pytest.raises(PerSampleError) as info:
        compiled(x)
    assert str(info.value) == (
        "fxdp (hooks engine): block 'block' (_TwoOutputs), which no front end captures, runs as one op with each "
        "sample re-run alone, but its dropout layer(s) 'block.drop' draw new numbers when a sample is re-run, so its "
        "per-sample gradients would not be this step's; set their p to 0 (or put them in eval mode), or make the "
        "block traceable by torch.fx")


@pytest.mark.parametrize("first_rows", [4, 1])
def test_without_example_inputs_the_block_is_chosen_on_the_first_batch(first_rows):
    """No example inputs: the part keeps the per-layer rules until the engine's test (a batch of one, or the first
    batch of two or more) finds one of its layers not seeing the batch; then it runs as one op."""
    model, inputs, targets = ZOO["chunked_encoder"]()
    compiled = fxdp.compile_for_dp(model)
    assert (compiled.blocks, compiled.candidates) == ((), ("block",))
    (line,) = [n for n in fxdp.report(compiled).notes if n.startswith("untraceable part 'block'")]
    assert line.endswith("engine: hooks (its layers' per-layer rules; every forward checks that its output for each "
                         "sample equals that sample's alone; it runs as one op instead if one of its layers does not "
                         "see the batch on the first batch)")
    ids, y = inputs[0][:first_rows], targets[:first_rows]
    F.cross_entropy(compiled(ids), y).backward()
    assert (compiled.blocks, compiled.candidates) == (("block",), ())
    assert fxdp.report(compiled).notes[-1] == (
        "block chosen on the first batch: 'block' runs as one op (layer 'block.mix' does not see the batch where the "
        "per-layer rules need it)")
    got = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
    for i, alone in enumerate(_grads_alone(model, (ids,), y)):
        for n, g in alone.items():
            torch.testing.assert_close(got[n][i], g, rtol=1e-9, atol=1e-12)
