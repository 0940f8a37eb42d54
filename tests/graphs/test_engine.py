"""The graphs engine (fxdp/graphs/engine.py): per-graph gradients of PyG models against each graph run alone, in
float64, and the refusals (a cross-graph edge, an unsupported layer, a model that mixes graphs)."""

import pytest
import torch
from torch import nn

pytest.importorskip("torch_geometric")
from torch_geometric.data import Batch, Data  # noqa: E402
from torch_geometric.nn import (GATConv, GCNConv, GINConv, GraphConv, SAGEConv, global_add_pool,  # noqa: E402
                                global_max_pool, global_mean_pool)

import fxdp  # noqa: E402
from fxdp.sinks.bookkeeping import BookkeepingSink  # noqa: E402
from fxdp.errors import PerSampleError, SampleMixingError, UnsupportedModuleError  # noqa: E402

POOLS = {"mean": global_mean_pool, "add": global_add_pool, "max": global_max_pool}
CONVS = {
    "gcn": lambda i, o: GCNConv(i, o),
    "gin": lambda i, o: GINConv(nn.Sequential(nn.Linear(i, o), nn.Tanh(), nn.Linear(o, o)), train_eps=True),
    "gat": lambda i, o: GATConv(i, o // 2, heads=2),
    "sage": lambda i, o: SAGEConv(i, o),
    "graphconv": lambda i, o: GraphConv(i, o),
}


class Net(nn.Module):
    def __init__(self, conv: str, pool: str, features: int = 3, hidden: int = 6, classes: int = 3):
        super().__init__()
        self.conv1, self.conv2 = CONVS[conv](features, hidden), CONVS[conv](hidden, hidden)
        self.pool = POOLS[pool]
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, edge_index, batch):
        h = torch.tanh(self.conv1(x, edge_index))
        h = torch.tanh(self.conv2(h, edge_index))
        return self.head(self.pool(h, batch))


def graph(nodes: int, edges: int, label: int, features: int = 3) -> Data:
    edge_index = torch.randint(0, nodes, (2, edges)) if edges else torch.zeros(2, 0, dtype=torch.long)
    return Data(x=torch.randn(nodes, features, dtype=torch.float64), edge_index=edge_index, y=torch.tensor([label]))


def graphs():
    # different sizes, an empty-edge graph, a one-node graph
    return [graph(5, 9, 0), graph(8, 4, 1), graph(3, 0, 2), graph(1, 0, 0), graph(11, 25, 1)]


def alone(model: nn.Module, data: Data, reduction: str):
    one = Batch.from_data_list([data])
    loss = nn.functional.cross_entropy(model(one.x, one.edge_index, one.batch), one.y, reduction="sum")
    return torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("conv", sorted(CONVS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_graph_gradients_equal_each_graph_alone(conv, pool, reduction):
    torch.manual_seed(0)
    model = Net(conv, pool).double()
    data = graphs()
    batch = Batch.from_data_list(data)
    dp = fxdp.compile_for_dp(model, loss_reduction=reduction)
    assert fxdp.report(dp).engine == "graphs"
    out = dp(batch.x, batch.edge_index, batch.batch)
    assert out.shape == (len(data), 3)
    nn.functional.cross_entropy(out, batch.y, reduction=reduction).backward()
    assert dp.verification is not None
    params = list(model.parameters())
    for k, d in enumerate(data):
        for p, expected in zip(params, alone(model, d, reduction)):
            expected = torch.zeros_like(p) if expected is None else expected
            assert p.grad_sample.shape == (len(data), *p.shape)
            torch.testing.assert_close(p.grad_sample[k], expected, rtol=1e-9, atol=1e-12)


def test_the_batch_object_passed_whole():
    class WholeBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = GCNConv(3, 4), nn.Linear(4, 2)

        def forward(self, data):
            return self.head(global_mean_pool(self.conv(data.x, data.edge_index).relu(), data.batch))

    torch.manual_seed(1)
    model, data = WholeBatch().double(), graphs()
    dp = fxdp.compile_for_dp(model, loss_reduction="sum")
    batch = Batch.from_data_list(data)
    nn.functional.cross_entropy(dp(batch), batch.y % 2, reduction="sum").backward()
    for k, d in enumerate(data):
        one = Batch.from_data_list([d])
        expected = torch.autograd.grad(nn.functional.cross_entropy(model(one), one.y % 2, reduction="sum"),
                                       list(model.parameters()))
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad_sample[k], e, rtol=1e-9, atol=1e-12)


def test_an_edge_across_graphs_is_refused_naming_the_graphs():
    model = Net("gcn", "mean").double()
    batch = Batch.from_data_list(graphs())
    edge_index = torch.cat([batch.edge_index, torch.tensor([[0], [6]])], 1)  # node 0 (graph 0) -> node 6 (graph 1)
    dp = fxdp.compile_for_dp(model)
    added = batch.edge_index.shape[1]  # the index of the edge added last
    with pytest.raises(PerSampleError, match=rf"Net \(forward at .*test_engine.py:\d+.*\)'s input: edge {added} "
                                             r"\(0 -> 6\) joins graph 0 to graph 1 \(1 edge\(s\) cross graphs\)"):
        dp(batch.x, edge_index, batch.batch)


def test_an_edge_a_layer_adds_across_graphs_is_refused_naming_the_layer():
    class Rewires(Net):
        def forward(self, x, edge_index, batch):
            h = torch.tanh(self.conv1(x, torch.cat([edge_index, torch.tensor([[0], [x.shape[0] - 1]])], 1)))
            return self.head(self.pool(torch.tanh(self.conv2(h, edge_index)), batch))

    batch = Batch.from_data_list(graphs())
    with pytest.raises(PerSampleError, match=r"layer 'conv1' \(GCNConv\).*joins graph 0 to graph 4"):
        fxdp.compile_for_dp(Rewires("gcn", "mean").double())(batch.x, batch.edge_index, batch.batch)


def test_an_unsorted_batch_vector_is_refused():
    batch = Batch.from_data_list(graphs())
    with pytest.raises(PerSampleError, match="`batch` must be sorted"):
        fxdp.compile_for_dp(Net("gcn", "mean").double())(batch.x, batch.edge_index, batch.batch.flip(0))


def test_row_wise_layers_on_node_and_graph_rows():
    class Normed(Net):
        def __init__(self):
            super().__init__("gin", "mean")
            self.types = nn.Embedding(4, 3)
            self.node_norm, self.group_norm = nn.LayerNorm(6), nn.GroupNorm(2, 6)
            self.graph_norm = nn.LayerNorm(6)

        def forward(self, x, edge_index, batch):
            h = x + self.types((x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())  # a node type from its features
            h = torch.tanh(self.conv2(torch.tanh(self.conv1(h, edge_index)), edge_index))
            h = self.group_norm(self.node_norm(h))
            return self.head(self.graph_norm(self.pool(h, batch)))

    torch.manual_seed(2)
    model, data = Normed().double(), graphs()
    batch = Batch.from_data_list(data)
    dp = fxdp.compile_for_dp(model, loss_reduction="sum")
    nn.functional.cross_entropy(dp(batch.x, batch.edge_index, batch.batch), batch.y, reduction="sum").backward()
    assert {dp.rules[n] for n in ("types", "node_norm", "group_norm", "graph_norm")} == {
        "the layer re-run on each graph alone"}
    for k, d in enumerate(data):
        for p, e in zip(model.parameters(), alone(model, d, "sum")):
            e = torch.zeros_like(p) if e is None else e
            torch.testing.assert_close(p.grad_sample[k], e, rtol=1e-9, atol=1e-12)


def test_a_parameter_without_a_rule_is_refused_naming_its_module():
    class Scaled(Net):
        def __init__(self):
            super().__init__("gcn", "mean")
            self.temperature = nn.Parameter(torch.ones(()))

        def forward(self, x, edge_index, batch):
            return super().forward(x, edge_index, batch) / self.temperature

    with pytest.raises(UnsupportedModuleError, match=r"`<model>` \(Scaled\).*no per-graph rule.*How to fix: freeze"):
        fxdp.compile_for_dp(Scaled())


def test_attention_dropout_is_refused():
    class Dropped(Net):
        def __init__(self):
            super().__init__("gat", "mean")
            self.conv2 = GATConv(6, 3, heads=2, dropout=0.5)

    with pytest.raises(UnsupportedModuleError, match=r"`conv2` \(GATConv\).*dropout=0.5"):
        fxdp.compile_for_dp(Dropped())


def test_a_model_that_mixes_graphs_is_refused_on_its_first_batch():
    class Centres(Net):
        def forward(self, x, edge_index, batch):
            h = torch.tanh(self.conv1(x, edge_index))
            h = h - h.mean(0)  # over every node of the batch: each graph's output depends on the others
            return self.head(self.pool(h, batch))

    batch = Batch.from_data_list(graphs())
    with pytest.raises(SampleMixingError, match="mixes graphs"):
        fxdp.compile_for_dp(Centres("gcn", "mean").double())(batch.x, batch.edge_index, batch.batch)


def test_an_output_without_one_row_per_graph_is_refused():
    class NodeOutput(Net):
        def forward(self, x, edge_index, batch):
            return self.head(torch.tanh(self.conv1(x, edge_index)))

    batch = Batch.from_data_list(graphs())
    with pytest.raises(PerSampleError, match=r"output has shape \(28, 3\), not one row per graph"):
        fxdp.compile_for_dp(NodeOutput("gcn", "mean").double())(batch.x, batch.edge_index, batch.batch)


def test_inputs_without_the_batch_vector_are_refused():
    class NoBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = GCNConv(3, 2)

        def forward(self, x, edges):
            return self.conv(x, edges).sum(0, keepdim=True)

    batch = Batch.from_data_list(graphs())
    with pytest.raises(fxdp.errors.UnsupportedInputError, match="no tensor named 'edge_index' nor 'batch'"):
        fxdp.compile_for_dp(NoBatch())(batch.x, batch.edge_index)


def test_the_hooks_leave_with_the_wrapper():
    import gc
    import weakref

    model = Net("gcn", "mean").double()
    dp = fxdp.compile_for_dp(model)
    gone = weakref.ref(dp)
    del dp
    gc.collect()
    assert gone() is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_rows_that_could_be_nodes_or_edges_are_refused():
    # 2 + 3 nodes, 3 + 2 edges: 5 rows could be nodes or edges, and row 2 would be graph 0's edge but graph 1's node
    data = [Data(x=torch.randn(2, 3, dtype=torch.float64), edge_index=torch.tensor([[0, 1, 0], [1, 0, 0]]),
                 y=torch.tensor([0])),
            Data(x=torch.randn(3, 3, dtype=torch.float64), edge_index=torch.tensor([[0, 1], [1, 2]]),
                 y=torch.tensor([1]))]
    batch = Batch.from_data_list(data)
    with pytest.raises(PerSampleError, match="number of nodes and also of edges, with different graphs"):
        fxdp.compile_for_dp(Net("gcn", "mean").double())(batch.x, batch.edge_index, batch.batch)


def test_after_the_verified_batch_each_layer_keeps_its_kind_of_rows():
    torch.manual_seed(3)
    model = Net("gcn", "mean").double()
    dp = fxdp.compile_for_dp(model, loss_reduction="sum")
    first = Batch.from_data_list(graphs())
    dp(first.x, first.edge_index, first.batch)  # verified: conv layers on node rows, the head on graph rows
    # as many edges as nodes now: node rows still, known from the verified batch
    data = [Data(x=torch.randn(2, 3, dtype=torch.float64), edge_index=torch.tensor([[0, 1, 0], [1, 0, 0]]),
                 y=torch.tensor([0])),
            Data(x=torch.randn(3, 3, dtype=torch.float64), edge_index=torch.tensor([[0, 1], [1, 2]]),
                 y=torch.tensor([1]))]
    batch = Batch.from_data_list(data)
    model.zero_grad()
    nn.functional.cross_entropy(dp(batch.x, batch.edge_index, batch.batch), batch.y, reduction="sum").backward()
    for k, d in enumerate(data):
        for p, e in zip(model.parameters(), alone(model, d, "sum")):
            torch.testing.assert_close(p.grad_sample[k], e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["ghost", "per_sample"])
@pytest.mark.parametrize("conv", sorted(CONVS))
def test_book_keeping_by_graph_gives_each_graphs_norm_and_clipped_sum(conv, method):
    """With a book-keeping sink, a row-wise linear layer (nn.Linear, and PyG's Linear inside the convolutions) is
    book-kept with each graph's rows as one sample's sequence: its per-graph squared norms and clipped sums, by
    Gram matrices (ghost) or formed gradients, equal those of each graph run alone, in float64."""
    torch.manual_seed(0)
    model = Net(conv, "mean").double()
    data = graphs()
    batch = Batch.from_data_list(data)
    sink = BookkeepingSink(method=method)
    dp = fxdp.compile_for_dp(model, loss_reduction="sum", sink=sink)
    nn.functional.cross_entropy(dp(batch.x, batch.edge_index, batch.batch), batch.y, reduction="sum").backward()
    params = [p for p in model.parameters()]
    linear_weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Linear"]
    assert linear_weights and all(sink.plans[m].method in ("outer", method) for m in sink.plans)
    assert any(plan.method == method for plan in sink.plans.values())  # graphs of several rows: the forced method
    expected = [alone(model, d, "sum") for d in data]
    norms = sink.squared_norms(params)
    factors = torch.linspace(0.2, 1.0, len(data), dtype=torch.float64)
    sums = sink.clipped_sums(params, {p: factors for p in params})
    for i, p in enumerate(params):
        rows = torch.stack([torch.zeros_like(p) if e[i] is None else e[i] for e in expected])
        torch.testing.assert_close(norms[p], rows.flatten(1).pow(2).sum(1), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(sums[p], (factors.view(-1, *[1] * p.dim()) * rows).sum(0), rtol=1e-9, atol=1e-12)
