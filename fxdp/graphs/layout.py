"""Where the samples are in a batch of graphs: segments of dimension 0, given by an index vector.

A PyTorch Geometric batch concatenates its graphs' nodes along dimension 0; ``batch[r]`` says which graph node row
``r`` belongs to, and ``edge_index`` (shape ``(2, E)``) is offset so that it indexes the concatenated nodes. One
sample is one graph. :class:`GraphBatch` holds that description for one forward call, found in the model's inputs
(:func:`graph_batch_of`), and checks, on every call, what the per-graph rules assume:

- ``batch`` is a vector of ``N`` graph indices, sorted, each in ``[0, num_graphs)`` (segments are contiguous);
- every edge joins two nodes of the same graph (no message crosses graphs);
- the model's output holds one row per graph (pooling is per graph: :meth:`GraphBatch.check_output`).

It also cuts one graph out of the call's inputs (:meth:`GraphBatch.inputs_of_graph`), as a batch of one graph, for
the self-check against graphs run alone. Nothing here imports torch_geometric at module level: fxdp imports
without it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from fxdp.diagnostics import PerSampleError, UnsupportedInputError

# forward() arguments read as edge rows (one row per edge, cut with the edges), by PyG's names
EDGE_ROW_NAMES = ("edge_attr", "edge_weight")


def _is_pyg_data(value: Any) -> bool:
    """A ``torch_geometric.data.Batch`` (or ``Data``), without importing torch_geometric."""
    return any(c.__module__.startswith("torch_geometric.data") and c.__name__ in ("Data", "Batch", "BaseData")
               for c in type(value).__mro__)


@dataclass
class GraphBatch:
    """One forward call's batch of graphs. ``graph_of_node``: the ``batch`` vector; ``ptr[k]:ptr[k + 1]`` are graph
    ``k``'s node rows. ``args``/``kwargs``: the call's inputs, ``data_at``: where a PyG ``Batch`` object sits in them
    (or None when the tensors were passed one by one, found by name: ``edge_index`` and ``batch``)."""

    graph_of_node: torch.Tensor
    edge_index: torch.Tensor
    num_graphs: int
    ptr: torch.Tensor
    args: tuple
    kwargs: Dict[str, Any]
    data_at: Optional[Tuple[str, Any]] = None  # ("arg", index) or ("kwarg", name)
    names: Optional[Dict[str, Tuple[str, Any]]] = None  # forward parameter name -> ("arg", i) / ("kwarg", name)

    @property
    def num_nodes(self) -> int:
        return int(self.graph_of_node.numel())

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])

    def rows_to_graphs(self, rows: int, where: str, expected: Optional[str] = None) -> Tuple[torch.Tensor, str]:
        """The graph of each of ``rows`` rows of a tensor a row-wise layer sees, and their kind: ``"node"`` rows
        (``batch``) or ``"graph"`` rows (one per graph, after pooling). ``expected``: the kind the layer's rows had on
        the verified batch (the engine records it), which must fit this batch too. Without it, rows that could be
        read two ways with different graphs (as many rows as nodes and as graphs, or as nodes and as edges) are
        refused, as are rows that are neither."""
        kinds = [k for k, n in (("node", self.num_nodes), ("graph", self.num_graphs)) if rows == n]
        arange = torch.arange(self.num_graphs, device=self.graph_of_node.device)
        maps = {"node": self.graph_of_node, "graph": arange}
        if expected is not None:
            if expected not in kinds:
                raise PerSampleError(
                    f"fxdp (graphs engine): {where} saw {rows} rows, but {expected} rows on the batch the engine "
                    f"verified, and this batch has {self.num_nodes} nodes and {self.num_graphs} graphs: which graph "
                    "each row belongs to is not known; give every layer the same kind of rows on every batch")
            return maps[expected], expected
        if not kinds:
            raise PerSampleError(
                f"fxdp (graphs engine): {where} saw {rows} rows, but the batch has {self.num_nodes} nodes and "
                f"{self.num_graphs} graphs ({self.num_edges} edges): its rows are neither node rows nor graph rows, so "
                "which graph each row belongs to is not known (edge-feature layers, e.g. GATConv(edge_dim=...), are "
                "not supported yet); compute it from node or graph rows")
        readings = [maps[k] for k in kinds]
        if kinds[0] == "node" and rows == self.num_edges:
            readings.append(self.graph_of_node[self.edge_index[0]])
        if any(not torch.equal(r, readings[0]) for r in readings[1:]):
            raise PerSampleError(
                f"fxdp (graphs engine): {where} saw {rows} rows, which is the batch's number of nodes and also of "
                f"{'graphs' if len(kinds) > 1 else 'edges'}, with different graphs at some rows, so which graph each "
                "row belongs to cannot be told on this batch, the one the engine verifies the model on (its first "
                "of two graphs or more); start training on a batch where the counts differ")
        return readings[0], kinds[0]

    def check_output(self, output: Any, model_name: str) -> None:
        """Pooling is per graph: the model's (first) output has one row per graph."""
        first = output if isinstance(output, torch.Tensor) else next(
            (t for t in (output if isinstance(output, (tuple, list)) else ()) if isinstance(t, torch.Tensor)), None)
        if first is None or first.dim() == 0 or first.shape[0] != self.num_graphs:
            shape = None if first is None else tuple(first.shape)
            raise PerSampleError(
                f"fxdp (graphs engine): {model_name}'s output has shape {shape}, not one row per graph of the batch "
                f"({self.num_graphs} graphs, {self.num_nodes} nodes): a graph's loss must come from its own rows. "
                "Pool per graph (global_mean_pool(h, batch, size=num_graphs)) and return the pooled rows (node-level "
                "tasks, one sample per node, are not what the graphs engine trains)")

    # -- one graph alone ---------------------------------------------------------------------------------------

    def node_slice(self, k: int) -> slice:
        return slice(int(self.ptr[k]), int(self.ptr[k + 1]))

    def edges_of_graph(self, k: int) -> torch.Tensor:
        if not self.num_edges:
            return self.edge_index.new_zeros(0, dtype=torch.bool)
        return self.graph_of_node[self.edge_index[0]] == k

    def cut(self, value: Any, k: int, edge_rows: bool = False) -> Any:
        """Graph ``k``'s rows of an input: node rows, the edges (re-indexed), or edge rows; others as they are."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        if value is self.edge_index:
            return value[:, self.edges_of_graph(k)] - self.ptr[k]
        if value is self.graph_of_node:
            return torch.zeros_like(value[self.node_slice(k)])
        if edge_rows and value.shape[0] == self.num_edges:
            return value[self.edges_of_graph(k)]
        if value.shape[0] == self.num_nodes:
            return value[self.node_slice(k)]
        return value

    def inputs_of_graph(self, k: int) -> Tuple[tuple, Dict[str, Any]]:
        """The call's inputs for graph ``k`` alone (a batch of one graph)."""
        if self.data_at is not None:
            data = (self.args[self.data_at[1]] if self.data_at[0] == "arg" else self.kwargs[self.data_at[1]])
            from torch_geometric.data import Batch  # lazy: only a PyG model gets here
            one = Batch.from_data_list([data.get_example(k)])
            args, kwargs = list(self.args), dict(self.kwargs)
            if self.data_at[0] == "arg":
                args[self.data_at[1]] = one
            else:
                kwargs[self.data_at[1]] = one
            return tuple(args), kwargs
        edge_names = {self.names[n] for n in EDGE_ROW_NAMES if n in self.names}
        args = tuple(self.cut(a, k, ("arg", i) in edge_names) for i, a in enumerate(self.args))
        kwargs = {n: self.cut(v, k, ("kwarg", n) in edge_names) for n, v in self.kwargs.items()}
        return args, kwargs


def graph_batch_of(model: torch.nn.Module, args: tuple, kwargs: Dict[str, Any],
                   model_name: Optional[str] = None) -> GraphBatch:
    """The batch of graphs in a forward call's inputs: a PyG ``Batch`` passed whole, or tensors passed by the names
    PyG's models use (``edge_index`` and ``batch``); checked (:func:`check_graph_batch`)."""
    model_name = model_name or type(model).__name__  # (the engine adds where forward is defined)
    inputs = [*((("arg", i), a) for i, a in enumerate(args)), *((("kwarg", n), v) for n, v in kwargs.items())]
    for where, value in inputs:
        if _is_pyg_data(value):
            batch = getattr(value, "batch", None)
            if batch is None:  # a single Data: one graph
                batch = torch.zeros(value.num_nodes or 0, dtype=torch.long, device=value.edge_index.device)
            num_graphs = int(getattr(value, "num_graphs", 1))
            return check_graph_batch(GraphBatch(batch, value.edge_index, num_graphs, _ptr(batch, num_graphs),
                                                tuple(args), dict(kwargs), data_at=where), model_name)
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise UnsupportedInputError(f"fxdp (graphs engine): the inputs do not match {model_name}.forward: {e}") from e
    names: Dict[str, Tuple[str, Any]] = {}
    positional = list(bound.signature.parameters)
    for i in range(len(args)):
        names[positional[i]] = ("arg", i)
    for n in kwargs:
        names[n] = ("kwarg", n)
    found = {n: bound.arguments.get(n) for n in ("edge_index", "batch")}
    missing = [n for n, v in found.items() if not isinstance(v, torch.Tensor)]
    if missing:
        raise UnsupportedInputError(
            f"fxdp (graphs engine): {model_name}.forward got no tensor named {' nor '.join(map(repr, missing))}, so "
            "where each graph's nodes and edges are is not known; pass the batch's tensors under PyG's names "
            "(forward(x, edge_index, batch)) or the torch_geometric.data.Batch itself (forward(data))")
    batch, edge_index = found["batch"], found["edge_index"]
    num_graphs = int(batch.max()) + 1 if batch.numel() else 0
    return check_graph_batch(GraphBatch(batch, edge_index, num_graphs, _ptr(batch, num_graphs), tuple(args),
                                        dict(kwargs), names=names), model_name)


def _ptr(batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
    counts = torch.bincount(batch, minlength=num_graphs) if batch.numel() else batch.new_zeros(num_graphs)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def check_graph_batch(g: GraphBatch, model_name: str) -> GraphBatch:
    """What the per-graph rules assume of the batch, checked on every forward call."""
    b, e = g.graph_of_node, g.edge_index
    where = f"fxdp (graphs engine), {model_name}'s input"
    if b.dim() != 1 or b.dtype not in (torch.long, torch.int32, torch.int64):
        raise UnsupportedInputError(f"{where}: `batch` must be a vector of graph indices (one per node), got "
                                    f"{b.dtype} of shape {tuple(b.shape)}")
    if e.dim() != 2 or e.shape[0] != 2 or e.is_floating_point():
        raise UnsupportedInputError(f"{where}: `edge_index` must be an integer tensor of shape (2, E), got "
                                    f"{e.dtype} of shape {tuple(e.shape)} (sparse adjacency is not supported)")
    if b.numel():
        if bool((b[1:] < b[:-1]).any()) or int(b.min()) < 0 or int(b.max()) >= g.num_graphs:
            raise PerSampleError(
                f"{where}: `batch` must be sorted with values in [0, {g.num_graphs}) (each graph's nodes together, "
                "as torch_geometric.data.Batch.from_data_list makes them); it is not, so which rows are which graph's "
                "is not known")
    if e.numel():
        if int(e.min()) < 0 or int(e.max()) >= g.num_nodes:
            raise PerSampleError(f"{where}: `edge_index` refers to nodes outside the batch's {g.num_nodes} nodes")
        src, dst = b[e[0]], b[e[1]]
        crossing = (src != dst).nonzero()
        if crossing.numel():
            i = int(crossing[0, 0])
            raise PerSampleError(
                f"{where}: edge {i} ({int(e[0, i])} -> {int(e[1, i])}) joins graph {int(src[i])} to graph "
                f"{int(dst[i])} ({crossing.shape[0]} edge(s) cross graphs): a message would carry one graph's data "
                "into another's gradient, so no per-graph gradient exists. Batch graphs whose edges stay inside "
                "them (torch_geometric.data.Batch.from_data_list does), or make each connected set one sample")
    return g
