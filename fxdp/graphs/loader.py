"""Poisson sampling of graphs: :class:`DPGraphDataLoader`, each batch a PyG ``Batch`` of the graphs drawn.

Every graph of the dataset joins each batch independently with probability ``sample_rate`` (the sampling the
accountant assumes; :class:`fxdp.data.DPDataLoader` draws the indices); the graphs drawn are collated by PyG's
collater (``Batch.from_data_list``: nodes concatenated, edges offset, the ``batch`` vector built). An empty draw is
an empty ``Batch`` (``num_graphs == 0``, every node, edge and graph attribute with no row), and the DP optimizer is
told so: a step on it adds noise only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from fxdp.data.loader import DPDataLoader, random_state_kept


def is_graph_loader(data_loader: DataLoader) -> bool:
    """A loader whose collate function is PyG's (``torch_geometric.loader.DataLoader``), without importing PyG."""
    collate = getattr(data_loader, "collate_fn", None)
    return any(c.__module__.startswith("torch_geometric.loader") for c in type(collate).__mro__) or any(
        c.__module__.startswith("torch_geometric.loader") for c in type(data_loader).__mro__)


class GraphCollate:
    """PyG's collater, and an empty ``Batch`` shaped like a batch of ``dataset[0]`` for an empty draw."""

    def __init__(self, dataset, collate_fn=None):
        if collate_fn is None or not any(c.__module__.startswith("torch_geometric") for c in type(collate_fn).__mro__):
            from torch_geometric.loader.dataloader import Collater  # lazy: the optional extra "graphs"
            collate_fn = Collater(dataset)
        self.collate_fn = collate_fn
        with random_state_kept():
            self.template = collate_fn([dataset[0]])

    def __call__(self, graphs: list) -> Any:
        return self.collate_fn(graphs) if graphs else empty_batch_like(self.template)


def empty_batch_like(template) -> Any:
    """A ``Batch`` of no graph with ``template``'s attributes (node, edge and graph ones cut to no row)."""
    empty = template.clone()
    for key in list(template.keys()):
        value = template[key]
        if not isinstance(value, torch.Tensor) or key == "ptr":
            continue
        dim = template.__cat_dim__(key, value) if key != "batch" else 0
        dim = dim if isinstance(dim, int) and value.dim() else 0
        empty[key] = value.narrow(dim, 0, 0).clone() if value.dim() else value.new_zeros(0)
    empty.ptr = torch.zeros(1, dtype=torch.long)
    empty._num_graphs = 0
    return empty


class DPGraphDataLoader(DPDataLoader):
    """:class:`~fxdp.data.DPDataLoader` over a dataset of PyG graphs (``Data`` objects): Poisson-sampled graphs
    collated into a ``torch_geometric.data.Batch``; :meth:`from_data_loader` takes a
    ``torch_geometric.loader.DataLoader`` (its collater kept). ``make_private`` builds one for such a loader.
    An empty draw is an empty ``Batch`` (``batch.num_graphs == 0``). Not with padded batches nor across processes."""

    def __init__(self, dataset, *, sample_rate: float, steps: Optional[int] = None, collate_fn=None,
                 generator: Optional[torch.Generator] = None, distributed: bool = False, padded_batches=False,
                 batch_first: bool = True, **loader_kwargs: Any):
        if padded_batches or distributed:
            raise ValueError("fxdp: DPGraphDataLoader does not pad batches nor share them across processes yet; "
                             "pass padded_batches=False and use one process")
        collate = GraphCollate(dataset, collate_fn)
        super().__init__(dataset, sample_rate=sample_rate, steps=steps, collate_fn=collate, generator=generator,
                         **loader_kwargs)
        self.collate_fn = collate  # PyG's batches are not tensors: their empty form is the empty Batch above

    def _observed(self, batches, observer):
        first = True
        for batch in batches:
            observer(empty=int(batch.num_graphs) == 0, new_epoch=first)
            first = False
            yield batch
