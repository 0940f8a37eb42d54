"""make_private on a PyG model and loader (fxdp/graphs/loader.py, the graphs engine): Poisson-sampled batches of
graphs, and one DP step equal to the clipped per-graph gradients computed with each graph alone."""

import pytest
import torch
from torch import nn

pytest.importorskip("torch_geometric")
from torch_geometric.data import Batch, Data  # noqa: E402
from torch_geometric.loader import DataLoader  # noqa: E402
from torch_geometric.nn import GINConv, global_add_pool  # noqa: E402

import fxdp  # noqa: E402
from fxdp.graphs import DPGraphDataLoader  # noqa: E402


class GIN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = GINConv(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8)))
        self.head = nn.Linear(8, 2)

    def forward(self, x, edge_index, batch):
        return self.head(global_add_pool(torch.tanh(self.conv(x, edge_index)), batch))


def dataset(n=40):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        nodes = int(torch.randint(1, 9, (), generator=g))
        edges = int(torch.randint(0, 2 * nodes, (), generator=g))
        out.append(Data(x=torch.randn(nodes, 3, generator=g, dtype=torch.float64),
                        edge_index=torch.randint(0, nodes, (2, edges), generator=g), y=torch.tensor([i % 2])))
    return out


def test_one_dp_step_equals_the_clipped_sum_of_each_graph_alone():
    torch.manual_seed(0)
    model, data, clip, lr = GIN().double(), dataset(), 0.05, 0.5
    reference = {n: p.detach().clone() for n, p in model.state_dict().items()}
    dp_model, optimizer, loader = fxdp.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=clip)
    assert isinstance(loader, DPGraphDataLoader) and fxdp.report(dp_model).engine == "graphs"
    assert "engine: graphs" in str(fxdp.report(dp_model)) and "'conv.nn.0': per-graph sum of rows" in str(
        fxdp.report(dp_model))
    batch = next(b for b in loader if b.num_graphs >= 2)
    optimizer.zero_grad()
    nn.functional.cross_entropy(dp_model(batch.x, batch.edge_index, batch.batch), batch.y).backward()
    optimizer.step()

    plain = GIN().double()
    plain.load_state_dict(reference)
    total = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    for k in range(batch.num_graphs):
        one = Batch.from_data_list([batch.get_example(k)])
        grads = torch.autograd.grad(nn.functional.cross_entropy(plain(one.x, one.edge_index, one.batch), one.y),
                                    list(plain.parameters()))
        norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
        factor = min(1.0, clip / (norm + 1e-6))  # the optimizer's clip factor (Opacus's: C / (norm + 1e-6))
        for (n, _), g in zip(plain.named_parameters(), grads):
            total[n] += factor * g
    for n, p in model.named_parameters():  # a mean loss: the clipped sum over the expected batch size (8)
        torch.testing.assert_close(p.detach(), reference[n] - lr * total[n] / 8, rtol=1e-9, atol=1e-12)


def test_poisson_batches_of_graphs_and_an_empty_one():
    data = dataset(30)
    loader = DPGraphDataLoader(data, sample_rate=0.02, steps=60, generator=torch.Generator().manual_seed(3))
    seen = []
    loader.batch_observer = lambda empty, new_epoch: seen.append(empty)
    sizes = []
    for batch in loader:
        sizes.append(batch.num_graphs)
        assert batch.batch.numel() == batch.x.shape[0] and batch.y.shape[0] == batch.num_graphs
        assert batch.edge_index.shape[0] == 2
    assert len(sizes) == 60 and 0 in sizes and max(sizes) >= 1
    assert seen == [s == 0 for s in sizes]
    empty = loader.collate_fn([])
    assert empty.num_graphs == 0 and empty.x.shape == (0, 3) and empty.edge_index.shape == (2, 0)


@pytest.mark.parametrize("forward", [False, True])
def test_a_step_on_an_empty_batch_adds_noise_only(forward):
    torch.manual_seed(0)
    model = GIN().double()
    before = [p.detach().clone() for p in model.parameters()]
    dp_model, optimizer, loader = fxdp.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(dataset(), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0)
    batch = loader.collate_fn([])  # the empty draw, as the loader hands it out
    assert batch.num_graphs == 0
    optimizer.observe_batch(empty=True, new_epoch=True)
    optimizer.zero_grad()
    if forward:  # the model runs on it too: no graph, no row out, no per-graph gradient
        out = dp_model(batch.x, batch.edge_index, batch.batch)
        assert out.shape == (0, 2)
        nn.functional.cross_entropy(out, batch.y, reduction="sum").backward()
    optimizer.step()
    after = list(model.parameters())
    assert all(not torch.equal(a, p) and torch.isfinite(p).all() for a, p in zip(before, after))
