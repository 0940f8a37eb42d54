"""Graphs as samples: PyTorch Geometric models trained privately on batches of graphs, one graph one sample.

- :mod:`fxdp.graphs.layout`: where each graph's rows are in a batch (segments of dimension 0, given by the
  ``batch`` vector), and the run-time checks of what the per-graph rules assume;
- :mod:`fxdp.graphs.rules`: per-graph gradients by segment;
- :mod:`fxdp.graphs.engine`: :class:`GraphGradSampleModule`, the engine ``compile_for_dp`` and ``make_private``
  choose for a model with PyG message-passing layers;
- :mod:`fxdp.graphs.loader`: :class:`DPGraphDataLoader`, Poisson sampling of graphs collated into PyG batches.

torch_geometric is imported lazily (the optional extra ``graphs``): fxdp imports without it.
"""

from fxdp.graphs.engine import GraphGradSampleModule, is_graph_model
from fxdp.graphs.loader import DPGraphDataLoader, is_graph_loader

__all__ = ["DPGraphDataLoader", "GraphGradSampleModule", "is_graph_loader", "is_graph_model"]
