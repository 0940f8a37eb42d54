"""The hooks engine never trains on a model its self-check could not verify (issue 33, item 4).

It used to warn ("could not verify ...") and train unless ``strict``. A batch of graphs (every layer sees one
row per node, the output sums each graph's nodes) then got one "per-sample" gradient per node: each node
clipped to C and the sum divided by the number of graphs. Now every unverified finding is refused with
:class:`fxdp.errors.UnverifiedModelError` (naming the model, the reason and what to do) before any gradient
exists; a batch of one is checked against its own gradient; a verifiable model trains as before.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fxdp
from fxdp.engines import GradSampleModule
from fxdp.errors import LayerBatchError, SampleMixingError, SelfCheckError, UnverifiedModelError
from tests.support.per_sample_reference import batch_loss, expected_grad_samples

GRAPH_SIZES = (5, 6, 4, 7)  # 4 graphs, 22 nodes


def graph_batch(sizes=GRAPH_SIZES, seed=0):
    nodes = torch.randn(sum(sizes), 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    batch = torch.cat([torch.full((k,), g) for g, k in enumerate(sizes)] + [torch.zeros(0, dtype=torch.long)])
    return nodes, batch


class GraphSum(nn.Module):
    """A graph per sample: Linear layers on node rows, each graph's nodes summed by its batch vector."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, nodes, batch):
        h = self.l2(torch.relu(self.l1(nodes)))
        graphs = int(batch.max()) + 1 if batch.numel() else 0  # data-dependent: torch.fx cannot trace it
        return torch.zeros(graphs, h.shape[1], dtype=h.dtype).index_add(0, batch, h)


class TraceableGraphSum(GraphSum):
    def forward(self, nodes, batch):
        h = self.l2(torch.relu(self.l1(nodes)))
        return torch.zeros(len(GRAPH_SIZES), h.shape[1], dtype=h.dtype).index_add(0, batch, h)


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        if x.sum() > -1e9:  # data-dependent control flow: the hooks engine
            x = torch.tanh(self.fc(x))
        return self.head(x)


def x_of(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_untouched(model, before):
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
        assert p.grad is None and getattr(p, "grad_sample", None) is None


# -- the batch of graphs ----------------------------------------------------------------------------------


def test_a_batch_of_graphs_that_falls_back_to_hooks_is_refused_before_any_gradient():
    torch.manual_seed(0)
    model = GraphSum().double()
    before = params_of(model)
    compiled = fxdp.compile_for_dp(model)
    assert fxdp.report(compiled).engine == "hooks"
    with pytest.raises(UnverifiedModelError) as info:
        compiled(*graph_batch())
    text = str(info.value)
    assert text.startswith("fxdp (hooks engine): could not verify GraphSum on its first batch of 22 samples "
                           "(output #0 has shape (4, 3), without the batch (22 samples) in dimension 0)")
    assert "it is not trained (strict or not)" in text
    finding = info.value.findings[0]
    assert finding.op == "GraphSum" and finding.kind is fxdp.diagnostics.Kind.UNVERIFIED
    assert "a batch of graphs" in finding.fix and "pad each graph to a fixed number of nodes" in finding.fix
    assert finding.location is not None and finding.location.file == __file__  # GraphSum.forward
    assert finding.location.code == "def forward(self, nodes, batch):"
    assert_untouched(model, before)


def test_a_batch_of_graphs_on_the_hooks_engine_asked_for_is_refused():
    torch.manual_seed(0)
    model = TraceableGraphSum().double()
    compiled = fxdp.compile_for_dp(model, grad_sample_mode="hooks")
    with pytest.raises(UnverifiedModelError, match="could not verify TraceableGraphSum on its first batch of 22"):
        compiled(*graph_batch())
    assert model.l1.weight.grad is None and getattr(model.l1.weight, "grad_sample", None) is None


def test_the_refusal_is_repeated_at_every_later_forward():
    """A training loop that catches the error and goes on never trains: the next batch is tested again."""
    torch.manual_seed(0)
    model = GraphSum().double()
    before = params_of(model)
    compiled = fxdp.compile_for_dp(model)
    for seed in range(3):
        with pytest.raises(UnverifiedModelError):
            compiled(*graph_batch(seed=seed)).sum().backward()
    assert compiled.verification.startswith("unverified: output #0 has shape (4, 3)")
    assert_untouched(model, before)


def test_one_graph_of_several_nodes_is_refused_too():
    torch.manual_seed(0)
    compiled = fxdp.compile_for_dp(GraphSum().double())
    with pytest.raises(UnverifiedModelError, match="output #0 has shape \\(1, 3\\), without the batch \\(6 samples\\)"):
        compiled(*graph_batch(sizes=(6,)))


def test_an_empty_batch_still_works_before_the_refusal():
    torch.manual_seed(0)
    model = GraphSum().double()
    compiled = fxdp.compile_for_dp(model)
    compiled(*graph_batch(sizes=())).sum().backward()  # Poisson sampling draws empty batches
    assert model.l1.weight.grad_sample.shape == (0, 16, 8)
    with pytest.raises(UnverifiedModelError):
        compiled(*graph_batch())


class Graphs(Dataset):
    def __init__(self, count=8):
        self.graphs = [graph_batch(sizes=(3 + i % 4,), seed=i)[0].float() for i in range(count)]

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i], torch.tensor(i % 3)


def collate_graphs(samples):
    nodes = torch.cat([g for g, _ in samples]) if samples else torch.zeros(0, 8)
    batch = torch.cat([torch.full((g.shape[0],), k) for k, (g, _) in enumerate(samples)]) if samples else \
        torch.zeros(0, dtype=torch.long)
    labels = torch.stack([y for _, y in samples]) if samples else torch.zeros(0, dtype=torch.long)
    return nodes, batch, labels


def private_graph_sum(**make_private_kwargs):
    """GraphSum made private as a user does, with its parameters as they were: (model, before, what make_private
    returned)."""
    torch.manual_seed(0)
    model = GraphSum()
    before = params_of(model)
    loader = DataLoader(Graphs(), batch_size=4, collate_fn=collate_graphs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, before, fxdp.PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=1.0,
        **make_private_kwargs)


@pytest.mark.parametrize("poisson_sampling", [True, False])
def test_make_private_refuses_a_batch_of_graphs_before_the_optimizer_changes_a_parameter(poisson_sampling):
    model, before, (private, optimizer, loader) = private_graph_sum(poisson_sampling=poisson_sampling,
                                                                    loss_reduction="sum")
    refused = graphs = 0
    for _ in range(3):
        for nodes, batch, labels in loader:
            optimizer.zero_grad()
            graphs += len(labels)
            try:
                loss = nn.functional.cross_entropy(private(nodes, batch), labels, reduction="sum")
            except UnverifiedModelError as exc:
                assert "could not verify GraphSum" in str(exc) and "without the batch" in str(exc)
                refused += 1
                continue
            assert len(labels) == 0  # an empty Poisson batch runs (and changes nothing)
            loss.backward()
            optimizer.step()
    assert refused > 0 and graphs > 0
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


# -- every other reason the test cannot run ---------------------------------------------------------------


class SeedlessNoise(Untraceable):
    def __init__(self):
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x):  # its own generator: the same torch seed gives other numbers
        return super().forward(x) + torch.randn(x.shape[0], 2, generator=self.generator, dtype=x.dtype)


class ReturnsAnObject(Untraceable):
    def forward(self, x):
        return types.SimpleNamespace(logits=super().forward(x))


class RefusesRepeatedRows(Untraceable):
    def forward(self, x):
        if bool((x[0] == x[1:]).all(-1).any()):
            raise ValueError("two samples are the same")
        return super().forward(x)


class TakesAList(Untraceable):
    def forward(self, rows):
        return super().forward(torch.tensor(rows, dtype=torch.float64))


@pytest.mark.parametrize("model_class, inputs, reason", [
    (SeedlessNoise, (x_of(5, 4),), "the model's output differs between two runs on the same batch with the same seed"),
    (ReturnsAnObject, (x_of(5, 4),), "the model returned no floating-point tensor"),
    (Untraceable, (x_of(1, 4).expand(5, 4),), "no input with the batch (5 samples) in dimension 0 differs"),
    (RefusesRepeatedRows, (x_of(5, 4),), "the model failed on the batch with sample 0's input changed (ValueError"),
    (TakesAList, (x_of(5, 4).tolist(),), "no input is a tensor with the batch in dimension 0"),
])
@pytest.mark.parametrize("strict", [False, True])
def test_every_reason_the_model_cannot_be_verified_is_refused(model_class, inputs, reason, strict):
    torch.manual_seed(0)
    model = model_class().double()
    before = params_of(model)
    compiled = fxdp.compile_for_dp(model, strict=strict)
    assert fxdp.report(compiled).engine == "hooks"
    with pytest.raises(UnverifiedModelError) as info:
        compiled(*inputs)
    assert f"could not verify {model_class.__name__} on " in str(info.value)
    assert info.value.findings[0].message.startswith(reason), info.value.findings[0].message
    assert info.value.findings[0].fix
    assert_untouched(model, before)


def test_a_batch_that_could_not_verify_is_followed_by_one_that_can():
    """Copies of one sample cannot be perturbed: refused; the next batch, of samples that differ, is tested."""
    torch.manual_seed(0)
    model = Untraceable().double()
    compiled = fxdp.compile_for_dp(model)
    with pytest.raises(UnverifiedModelError, match="draw the first batch from your data"):
        compiled(x_of(1, 4).expand(5, 4))
    x = x_of(5, 4)
    expected, R = expected_grad_samples(copy.deepcopy(model), x)
    batch_loss(compiled(x), R, "mean").backward()
    assert compiled.verification.startswith("verified on a batch of 5")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-10, rtol=1e-8)


def test_a_model_that_mixes_samples_is_refused_at_every_later_forward():
    class Centers(Untraceable):
        def forward(self, x):
            return super().forward(x - x.mean(0))

    model = Centers().double()
    compiled = fxdp.compile_for_dp(model)
    with pytest.raises(SampleMixingError, match="Centers mixes samples"):
        compiled(x_of(5, 4))
    with pytest.raises(SampleMixingError, match="Centers was refused on an earlier batch"):
        compiled(x_of(5, 4, seed=2))
    assert model.fc.weight.grad is None


# -- a batch of one ---------------------------------------------------------------------------------------


def test_a_batch_of_one_trains_with_its_own_gradient_and_the_test_waits_for_two_samples():
    torch.manual_seed(0)
    model = Untraceable().double()
    compiled = fxdp.compile_for_dp(model)
    x = x_of(1, 4)
    expected, R = expected_grad_samples(copy.deepcopy(model), x)
    batch_loss(compiled(x), R, "mean").backward()
    for name, p in model.named_parameters():
        assert p.grad_sample.shape == (1, *p.shape)
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-10, rtol=1e-8)
        torch.testing.assert_close(p.grad_sample[0], p.grad, atol=1e-10, rtol=1e-8)
    assert compiled.verification == "not yet run"
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad_sample = None
    compiled(x_of(3, 4)).sum().backward()
    assert compiled.verification.startswith("verified on a batch of 3")


def test_a_batch_of_one_with_wrong_per_sample_gradients_is_refused():
    """The layer check cannot see a parameter used outside its layer; the batch's own gradient does."""
    class UsesAWeightBeside(Untraceable):
        def forward(self, x):
            if x.sum() > -1e9:
                x = torch.tanh(self.fc(x)) + nn.functional.linear(x, self.fc.weight)  # no hook sees this use
            return self.head(x)

    model = UsesAWeightBeside().double()
    compiled = fxdp.compile_for_dp(model)
    with pytest.raises(SelfCheckError, match="per-sample gradients of UsesAWeightBeside are wrong on a batch of one"):
        compiled(x_of(1, 4))
    assert model.fc.weight.grad is None
    with pytest.raises(SelfCheckError, match="refused on an earlier batch"):
        compiled(x_of(4, 4))


def test_a_batch_of_one_whose_layers_see_several_rows_is_refused():
    """One graph of three nodes whose first input is the graph id: one sample, three rows per layer (the
    layer check, which runs at every forward, refuses it in the test of the batch of one)."""
    class GraphIdFirst(GraphSum):
        def forward(self, graph_id, nodes, batch):
            return super().forward(nodes, batch) + 0 * graph_id.unsqueeze(1)

    model = GraphIdFirst().double()
    nodes, batch = graph_batch(sizes=(3,))
    compiled = GradSampleModule(model)
    with pytest.raises(LayerBatchError, match="layer 'l1' \\(Linear\\) does not see the batch"):
        compiled(torch.zeros(1, dtype=torch.float64), nodes, batch)
    assert model.l1.weight.grad is None


# -- a verifiable model is unchanged ----------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_verifiable_untraceable_model_trains_with_per_sample_gradients_of_batches_of_one(reduction):
    torch.manual_seed(0)
    model = Untraceable().double()
    compiled = fxdp.compile_for_dp(model, loss_reduction=reduction, strict=True)
    x = x_of(6, 4)
    expected, R = expected_grad_samples(copy.deepcopy(model), x)
    batch_loss(compiled(x), R, reduction).backward()
    assert compiled.verification == ("verified on a batch of 6: outputs independent across samples, per-sample "
                                     "gradients equal to batches of one")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-10, rtol=1e-8)


def test_inspect_reports_the_batch_of_graphs_as_an_error():
    report = fxdp.inspect(GraphSum().double(), graph_batch())
    finding = report.pass_report("self-check").findings[0]
    assert finding.severity is fxdp.diagnostics.Severity.ERROR and finding.kind is fxdp.diagnostics.Kind.UNVERIFIED
    with pytest.raises(UnverifiedModelError):
        fxdp.inspect(GraphSum().double(), graph_batch(), strict=True)


def test_inspect_on_one_example_sample_says_the_test_is_still_to_come():
    report = fxdp.inspect(Untraceable().double(), (x_of(1, 4),))
    finding = report.pass_report("self-check").findings[0]
    assert finding.severity is fxdp.diagnostics.Severity.WARNING and "fewer than two samples" in finding.message


# -- packed sequences: the test splits and perturbs them (they used to leave the model unverified) --------


class LastStateOfPacked(nn.Module):
    def __init__(self, mixes=False):
        super().__init__()
        self.rnn, self.out, self.mixes = nn.GRU(3, 5), nn.Linear(5, 2), mixes

    def forward(self, packed):
        _, h = self.rnn(packed)
        h = h[-1] - h[-1].mean(0) if self.mixes else h[-1]
        return self.out(h)


class PackedOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 5)

    def forward(self, packed):
        return self.rnn(packed)[0]


def packed_batch(lengths=(4, 6, 2)):
    x = torch.randn(max(lengths), len(lengths), 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)


def test_a_packed_sequence_input_is_verified_and_trains():
    torch.manual_seed(0)
    model = LastStateOfPacked().double()
    reference = copy.deepcopy(model)
    compiled = GradSampleModule(model, loss_reduction="sum")
    packed = packed_batch()
    compiled(packed).pow(2).sum().backward()
    assert compiled.verification.startswith("verified on a batch of 3")
    padded, lengths = nn.utils.rnn.pad_packed_sequence(packed)
    for i, length in enumerate(lengths.tolist()):
        alone = copy.deepcopy(reference)
        alone(nn.utils.rnn.pack_padded_sequence(padded[:length, i:i + 1], [length])).pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), alone.parameters()):
            torch.testing.assert_close(p.grad_sample[i], q.grad, atol=1e-10, rtol=1e-8, msg=name)


def test_a_model_that_mixes_packed_sequences_is_refused():
    compiled = GradSampleModule(LastStateOfPacked(mixes=True).double())
    with pytest.raises(SampleMixingError, match="LastStateOfPacked mixes samples"):
        compiled(packed_batch())


def test_a_packed_sequence_output_is_verified_as_its_padded_sequences():
    """A PackedSequence output is checked padded, one row per sample (tests/layers/test_dp_layers.py compares its
    per-sample gradients with each sequence alone)."""
    model = PackedOut().double()
    engine = GradSampleModule(model)
    engine(packed_batch())
    assert engine.verification.startswith("verified on a batch of 3")


# -- the hooks engine on the model itself (make_private(wrap_model=False)) checks the same ------------------


def test_the_hooks_on_the_model_itself_refuse_a_batch_of_graphs():
    """The model is called, not a wrapper: its own hooks read the batch size and test it (they used not to)."""
    model, before, (hooks, optimizer, loader) = private_graph_sum(poisson_sampling=False, wrap_model=False)
    assert isinstance(hooks, fxdp.engines.GradSampleHooks)
    for nodes, batch, labels in loader:
        with pytest.raises(UnverifiedModelError, match="could not verify GraphSum on its first batch"):
            model(nodes, batch)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q) and p.grad is None


def test_the_hooks_on_the_model_itself_check_each_layer_and_verify_a_model_that_is_right():
    class TimeMajor(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):  # the batch moves to dimension 1 before the layer
            return self.fc(x.transpose(0, 1)).transpose(0, 1)

    moved = TimeMajor().double()
    hooks = fxdp.engines.GradSampleHooks(moved)
    with pytest.raises(LayerBatchError, match="layer 'fc' \\(Linear\\) does not see the batch"):
        moved(x_of(5, 2, 4))
    assert moved.fc.weight.grad is None

    torch.manual_seed(0)
    model = Untraceable().double()
    expected, R = expected_grad_samples(copy.deepcopy(model), x_of(5, 4))
    hooks = fxdp.engines.GradSampleHooks(model)
    batch_loss(model(x_of(5, 4)), R, "mean").backward()
    assert hooks.verification.startswith("verified on a batch of 5")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], atol=1e-10, rtol=1e-8)
    hooks.cleanup()


def test_the_ew_engine_refuses_a_batch_of_graphs_before_backward():
    """ExpandedWeights takes each row of the first input as a sample: it used to train one row per node."""
    model = TraceableGraphSum().double()
    compiled = fxdp.compile_for_dp(model, grad_sample_mode="ew")
    with pytest.raises(UnverifiedModelError, match="fxdp \\(ew engine\\): TraceableGraphSum cannot be trained: output "
                                                   "#0 has shape \\(4, 3\\), without the batch \\(22 samples\\)"):
        compiled(*graph_batch())
    assert model.l1.weight.grad is None and getattr(model.l1.weight, "grad_sample", None) is None


def test_a_time_major_model_with_a_batch_first_output_is_verified():
    """Tokens (T, N) in, one row per sample out ((N, C), as a classifier pools over time): the output holds the
    batch at dimension 0, not at the engine's batch_first=False dimension 1, and is verified there."""
    class PooledOverTime(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(20, 6), nn.Linear(6, 3)

        def forward(self, tokens):
            return self.fc(self.emb(tokens)).mean(0)

    torch.manual_seed(0)
    model = PooledOverTime().double()
    tokens = torch.randint(0, 20, (7, 4))
    engine = GradSampleModule(model, batch_first=False, loss_reduction="sum")
    engine(tokens).sum().backward()
    assert engine.verification.startswith("verified on a batch of 4")
    rows = model.fc.weight.grad_sample.clone()
    for i in range(4):
        model.zero_grad()
        model(tokens[:, i:i + 1]).sum().backward()
        torch.testing.assert_close(rows[i], model.fc.weight.grad)
