"""Graph classification with differential privacy: one sample is one graph (PyTorch Geometric, fxdp.graphs).

    pip install -e ".[graphs]" && python examples/train_graphs.py

The data set is generated here (nothing is downloaded): graphs of 10 to 30 nodes, half of them rings (every node
of degree 2), half random graphs with twice as many edges (degrees vary around 4); node features are noise. A GIN
(two GINConv layers, mean pooling, a linear head) tells the two apart. ``make_private_with_epsilon`` chooses the
graphs engine for the model (its report says so) and a Poisson sampler of graphs for the loader; each graph's
gradient is clipped alone, as DP-SGD needs for graph-level privacy. Prints the test accuracy and the ε spent after every epoch.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINConv, global_mean_pool

import fxdp


def ring_or_random(label: int, nodes: int, generator: torch.Generator) -> Data:
    """A ring of ``nodes`` nodes (label 0) or a random graph with twice as many edges (label 1), edges both ways."""
    if label == 0:
        src = torch.arange(nodes)
        dst = (src + 1) % nodes
    else:
        src = torch.randint(0, nodes, (2 * nodes,), generator=generator)
        dst = (src + torch.randint(1, nodes, (2 * nodes,), generator=generator)) % nodes  # no self-loop
    edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])
    x = 0.1 * torch.randn(nodes, 4, generator=generator) + 1.0
    return Data(x=x, edge_index=edge_index, y=torch.tensor([label]))


def make_dataset(count: int, seed: int) -> List[Data]:
    g = torch.Generator().manual_seed(seed)
    return [ring_or_random(i % 2, int(torch.randint(10, 31, (), generator=g)), g) for i in range(count)]


class GIN(nn.Module):
    def __init__(self, features: int = 4, hidden: int = 32, classes: int = 2):
        super().__init__()
        self.conv1 = GINConv(nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden)))
        self.conv2 = GINConv(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden)))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, edge_index, batch):
        h = self.conv1(x, edge_index).relu()
        h = self.conv2(h, edge_index).relu()
        return self.head(global_mean_pool(h, batch))


def accuracy(model: nn.Module, loader) -> float:
    model.eval()
    right = total = 0
    with torch.no_grad():
        for batch in loader:
            right += int((model(batch.x, batch.edge_index, batch.batch).argmax(1) == batch.y).sum())
            total += batch.num_graphs
    model.train()
    return right / total


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-graphs", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=80, help="expected graphs per Poisson batch")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train, test = make_dataset(args.train_graphs, seed=1), make_dataset(400, seed=2)
    model = GIN()
    engine = fxdp.PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        data_loader=DataLoader(train, batch_size=args.batch_size), target_epsilon=args.target_epsilon,
        target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm)
    print(fxdp.report(model))
    print(f"noise multiplier {optimizer.noise_multiplier:.3f}, {len(loader)} Poisson batches per epoch")
    test_loader = DataLoader(test, batch_size=200)
    for epoch in range(1, args.epochs + 1):
        for batch in loader:
            optimizer.zero_grad()
            if batch.num_graphs > 0:  # an empty Poisson batch: the step adds noise only
                F.cross_entropy(model(batch.x, batch.edge_index, batch.batch), batch.y).backward()
            optimizer.step()
        print(f"epoch {epoch}: test accuracy {accuracy(model, test_loader):.1%}, "
              f"ε = {engine.get_epsilon(args.delta):.2f} (δ = {args.delta:g})")


if __name__ == "__main__":
    main()
