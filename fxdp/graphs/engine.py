"""The graphs engine: per-graph gradients of a PyTorch Geometric model trained on batches of graphs.

One sample is one graph; a batch concatenates the graphs' nodes along dimension 0 (:mod:`fxdp.graphs.layout`).
:class:`GraphGradSampleModule` wraps the model (sharing its parameters) and, like the hooks engine, captures each
layer's input in forward and its output gradient in backward; what differs is where the samples are: segments of
dimension 0 given by the ``batch`` vector, not rows. Which rule covers which parameter (decided once):

- a row-wise linear layer (``nn.Linear``; PyG's ``Linear``, inside GCNConv, GATConv, SAGEConv, GraphConv, and
  GINConv's MLP): per-graph sums of per-row contributions, its rows being node rows or graph rows (after pooling),
  handed to the sink padded per graph as a batch of sequences (a book-keeping sink forms norms and clipped sums
  from them as for a sequence ``nn.Linear``, without forming the per-graph gradients where that costs less);
- GCNConv's own ``bias`` (added to each node row last): the per-graph sum of the output gradient's rows;
- any other parameter of a message-passing layer itself (GATConv's attention vectors and bias, GINConv's trainable
  ``eps``), and the parameters of a row-wise torch.nn layer (:data:`ROW_WISE`: LayerNorm, GroupNorm, Embedding, ...,
  on node or graph rows): the layer re-run on each graph's nodes and edges (rows) alone, in backward, with that
  graph's rows of the output gradient (exact, as no edge crosses graphs; costs one small forward and backward per
  graph);
- a trainable parameter anywhere else is refused when the wrapper is built, naming its module.

Checked on every forward call: the batch vector, that no edge of the input nor of any message-passing layer's
``edge_index`` crosses graphs, that every layer's rows are node or graph rows, and that the output has one row per
graph (:mod:`fxdp.graphs.layout`). Checked once, on the first batch of two graphs or more (``verify=True``): every
parameter's per-graph gradient against the graph run alone (float64 where the model is), in eval mode, for a random
linear loss of the output; a model that fails (an op that mixes graphs, nodes reordered, a normaliser over the
batch) is refused with :class:`~fxdp.errors.SampleMixingError`.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from fxdp.diagnostics import SampleMixingError, UnsupportedModuleError
from fxdp.diagnostics.findings import Finding, Kind, Severity
from fxdp.diagnostics.report import GRAPHS, REPORT_ATTR, CompileReport
from fxdp.engines.base import GradSampleModuleBase, trainable_own_params
from fxdp.engines.selfcheck import forward_location
from fxdp.graphs.layout import EDGE_ROW_NAMES, GraphBatch, check_graph_batch, graph_batch_of
from fxdp.graphs.rules import padded_by_segment, segment_sum
from fxdp.sinks.contract import SINK_ATTR, GradientSink, LayerCapture

VERIFY_GRAPHS = 8  # graphs of the first batch compared with each run alone


def _from_pyg(module: nn.Module, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("torch_geometric") for c in type(module).__mro__)


def is_message_passing(module: nn.Module) -> bool:
    return _from_pyg(module, "MessagePassing")


def is_graph_model(model: nn.Module) -> bool:
    """Whether ``model`` holds a PyTorch Geometric message-passing layer (without importing torch_geometric)."""
    return any(is_message_passing(m) for m in model.modules())


def is_row_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or PyG's ``Linear`` (a subclass that keeps their forward): ``x Wᵀ + b`` row by row."""
    for base in type(module).__mro__:
        if base is nn.Linear or (base.__name__ == "Linear" and base.__module__ == "torch_geometric.nn.dense.linear"):
            return type(module).forward is base.forward
    return False


#: torch.nn layers that compute each row of their output from the same row of their input alone (on (rows, features)
#: inputs): their per-graph gradients come from the rule that re-runs a layer on each graph's rows
ROW_WISE = tuple(getattr(nn, n) for n in ("LayerNorm", "GroupNorm", "Embedding", "PReLU", "RMSNorm") if hasattr(nn, n))


def is_row_wise(module: nn.Module) -> bool:
    """One of :data:`ROW_WISE`, or a subclass that keeps its forward."""
    return any(isinstance(module, t) and type(module).forward is t.forward for t in ROW_WISE)


def _as_linear(module: nn.Module) -> nn.Linear:
    """``module`` itself if it is an ``nn.Linear``; for PyG's ``Linear`` (the same ``x Wᵀ + b`` with the same
    parameter shapes, not a subclass) an ``nn.Linear`` holding the same parameters, made once per layer, so that the
    book-keeping sink's Linear registration describes it."""
    if isinstance(module, nn.Linear):
        return module
    shell = module.__dict__.get("_fxdp_as_linear")
    if shell is None or shell.weight is not module.weight or shell.bias is not module.bias:
        shell = nn.Linear(0, 0, bias=False, device="meta")
        shell.in_features, shell.out_features = module.weight.shape[1], module.weight.shape[0]
        shell.weight, shell.bias = module.weight, module.bias
        module.__dict__["_fxdp_as_linear"] = shell  # (not a submodule: not in the model's modules or state)
    return shell


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    return None


class GraphGradSampleModule(GradSampleModuleBase):
    """Wraps a PyG model so that ``loss.backward()`` gives each graph's own gradient (``p.grad_sample[k]``, or the
    norms and clipped sums a sink reads): see :mod:`fxdp.graphs.engine`. ``loss_reduction``: how the loss reduces
    over the batch's graphs (``"mean"``: divided by the number of graphs)."""

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", *, sink: Optional[GradientSink] = None,
                 verify: bool = True):
        super().__init__(model, batch_first=True, loss_reduction=loss_reduction, sink=sink)
        self.verify = verify
        self.verification: Optional[str] = None  # what the first-batch check compared
        self._layout: Optional[GraphBatch] = None
        self._collected: Optional[Dict[nn.Parameter, torch.Tensor]] = None  # the self-check's rows, not the sink's
        self._handles: List[Any] = []
        self.rules: Dict[str, str] = {}  # module name -> the rule that covers its parameters
        self._row_kinds: Dict[str, str] = {}  # layer -> "node" or "graph": its rows on the verified batch
        self._location = forward_location(model)
        self._named = type(model).__name__ + (f" (forward at {self._location})" if self._location else "")
        self._plan()

    # -- which rule covers which parameter ------------------------------------------------------------------------

    def _plan(self) -> None:
        covered, refused = set(), []
        for name, module in self._module.named_modules():
            if is_message_passing(module):
                self._handles.append(module.register_forward_pre_hook(self._edges_hook(name), with_kwargs=True))
            own = trainable_own_params(module)
            if is_row_linear(module):
                self._hook(name, module, GraphGradSampleModule._linear_capture, "per-graph sum of rows (linear)")
                covered.update(own)
            elif not own:
                continue
            elif _from_pyg(module, "GCNConv") and [p is module.bias for p in own] == [True]:
                self._refuse_cached(name, module)
                self._hook(name, module, GraphGradSampleModule._bias_capture, "per-graph sum of rows (bias)")
                covered.update(own)
            elif is_message_passing(module) or is_row_wise(module):
                problem = self._alone_problem(module) if is_message_passing(module) else None
                if problem:
                    refused.append(UnsupportedModuleError(problem[0], module_name=name, module_type=type(module),
                                                          fix=problem[1]))
                    continue
                self._hook(name, module, GraphGradSampleModule._alone_capture, "the layer re-run on each graph alone")
                covered.update(own)
        for name, p in self._module.named_parameters():
            if p.requires_grad and p not in covered and not refused:
                owner = name.rpartition(".")[0]
                module = self._module.get_submodule(owner) if owner else self._module
                refused.append(UnsupportedModuleError(
                    "the graphs engine has no per-graph rule for this layer's parameters (it knows row-wise linear "
                    "layers, PyG's message-passing layers and row-wise torch.nn layers such as LayerNorm)",
                    module_name=owner or "<model>", module_type=type(module),
                    fix="freeze it (requires_grad_(False)), or use nn.Linear layers or PyG convolutions (GCNConv, "
                        "GINConv, GATConv, SAGEConv, GraphConv) and nn.LayerNorm in its place"))
                covered.update(trainable_own_params(module))
        if refused:
            self.remove_hooks()
            raise UnsupportedModuleError.aggregate(refused, (
                f"fxdp (graphs engine): cannot compute per-graph gradients of {type(self._module).__name__}: "
                f"{len(refused)} layer(s) it has no rule for:"))

    @staticmethod
    def _alone_problem(module: nn.Module) -> Optional[Tuple[str, str]]:
        if getattr(module, "cached", False):
            return ("cached=True keeps one batch's normalised edges for every later batch, so re-running the "
                    "layer on one graph would use the whole batch's", "build it with cached=False")
        dropout = getattr(module, "dropout", 0.0)
        if isinstance(dropout, float) and dropout > 0:
            return (f"dropout={dropout} on attention coefficients draws a new mask when the layer is re-run on each "
                    "graph alone (to find its own parameters' per-graph gradients), so they would not be the "
                    "batch's", "build it with dropout=0.0 (use dropout on node features, outside the layer)")
        return None

    def _refuse_cached(self, name: str, module: nn.Module) -> None:
        if getattr(module, "cached", False):
            raise UnsupportedModuleError("cached=True keeps the first batch's normalised edges for every batch",
                                         module_name=name, module_type=type(module), fix="build it with cached=False")

    def _hook(self, name: str, module: nn.Module, capture, rule: str) -> None:
        """A forward hook on ``module`` that calls ``capture(self, ...)`` while this wrapper runs the model. The hooks
        hold the wrapper weakly: the model does not keep a wrapper alive, and a hook whose wrapper is gone (or that
        is not running the model) does nothing."""
        self.rules[name or "<model>"] = rule
        owner = weakref.ref(self)

        def forward_hook(mod, args, kwargs, output):
            me = owner()
            if me is None or me._recomputing or me._layout is None or not torch.is_grad_enabled():
                return
            out = _first_tensor(output)
            if out is None or not out.requires_grad:
                return
            capture(me, name, mod, args, kwargs, out)

        self._handles.append(module.register_forward_hook(forward_hook, with_kwargs=True))

    def _edges_hook(self, name: str):
        owner = weakref.ref(self)

        def pre_hook(mod, args, kwargs):
            me = owner()
            if me is None or me._layout is None or me._recomputing:
                return
            edge_index, layout = _bound(mod, args, kwargs).get("edge_index"), me._layout
            if isinstance(edge_index, torch.Tensor) and edge_index is not layout.edge_index:
                check_graph_batch(GraphBatch(layout.graph_of_node, edge_index, layout.num_graphs, layout.ptr, (), {}),
                                  f"layer '{name}' ({type(mod).__name__}) of {me._named}")
        return pre_hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __del__(self):
        try:
            self.remove_hooks()
        except Exception:  # (interpreter shutdown)
            pass

    # -- forward ----------------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        layout = graph_batch_of(self._module, args, kwargs, self._named)
        if self.verify and self.verification is None and layout.num_graphs >= 2 and torch.is_grad_enabled():
            self._self_check(layout)
        self.forward_calls += 1
        self._layout = layout
        try:
            output = self._module(*args, **kwargs)
        finally:
            self._layout = None
        layout.check_output(output, self._named)
        return output

    # -- captures -----------------------------------------------------------------------------------------------

    def _rows(self, name: str, layout: GraphBatch, rows: int, where: str) -> torch.Tensor:
        """The graph of each row a layer sees; their kind (node or graph rows) is recorded on the verified batch
        and held to on every later one (a batch of one graph needs neither: all its rows are its own)."""
        graph_of_row, kind = layout.rows_to_graphs(rows, where, self._row_kinds.get(name))
        if self._collected is not None:
            self._row_kinds[name] = kind
        return graph_of_row

    def _scaled(self, grad: torch.Tensor, layout: GraphBatch) -> torch.Tensor:
        """The output gradient of the summed loss (a mean over graphs carries 1/G)."""
        if self._collected is None and self.loss_reduction == "mean":
            return grad * layout.num_graphs
        return grad

    def _linear_capture(self, name, mod, args, kwargs, out) -> None:
        x, layout = args[0], self._layout
        where = f"layer '{name}' ({type(mod).__name__})"
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise UnsupportedModuleError(f"saw an input of shape {getattr(x, 'shape', None)}; the graphs engine "
                                         "takes (rows, features) inputs", module_name=name, module_type=type(mod))
        graph_of_row, a = self._rows(name, layout, x.shape[0], where), x.detach()
        params = [p for p in (mod.weight, mod.bias) if p is not None and p.requires_grad]

        def on_grad(grad):
            # each graph's rows as one sample's sequence, zero rows after them: (G, L, in) and (G, L, out)
            a_k = padded_by_segment(a, graph_of_row, layout.num_graphs)
            g_k = padded_by_segment(self._scaled(grad, layout).detach(), graph_of_row, layout.num_graphs)

            def grad_samples():
                w, b = torch.bmm(g_k.transpose(1, 2), a_k), g_k.sum(1)
                return {p: v for p, v in ((mod.weight, w), (mod.bias, b)) if p is not None and p.requires_grad}
            if self._collected is not None:  # the self-check's backward
                self._deliver_rows(grad_samples, params, layout)
                return
            # a book-keeping sink's Linear registration forms each graph's norm from these as for a sequence (ghost,
            # from Gram matrices, or the formed gradient, whichever costs less) and the clipped sum as G^T diag(c) A;
            # a sink that keeps per-sample gradients forms them. The zero rows add nothing to either.
            getattr(self, SINK_ATTR).add(LayerCapture(
                batch_size=layout.num_graphs, grad_samples=grad_samples, module=_as_linear(mod), activations=(a_k,),
                backprops=g_k, params=tuple(params), call=self.forward_calls))

        out.register_hook(on_grad)

    def _bias_capture(self, name, mod, args, kwargs, out) -> None:
        layout = self._layout
        graph_of_row = self._rows(name, layout, out.shape[0], f"layer '{name}' ({type(mod).__name__})")

        def on_grad(grad):
            g = self._scaled(grad, layout).detach()
            self._deliver_rows(lambda: {mod.bias: segment_sum(g, graph_of_row, layout.num_graphs)}, [mod.bias],
                               layout)

        out.register_hook(on_grad)

    def _alone_capture(self, name, mod, args, kwargs, out) -> None:
        layout, where = self._layout, f"layer '{name}' ({type(mod).__name__})"
        graph_of_row = self._rows(name, layout, out.shape[0], where)  # node rows or graph rows (or refused)
        node_rows = graph_of_row is layout.graph_of_node
        if not node_rows and is_message_passing(mod):
            raise UnsupportedModuleError("ran on graph rows; a message-passing layer takes node rows",
                                         module_name=name, module_type=type(mod))
        if is_message_passing(mod):
            bound = _bound(mod, args, kwargs)
            if isinstance(bound.get("x"), (tuple, list)):
                raise UnsupportedModuleError("got a pair of node tensors (a bipartite graph); the graphs engine takes "
                                             "one node tensor", module_name=name, module_type=type(mod))
        else:  # a row-wise layer: its tensor arguments with the output's rows are cut like them
            bound = _bound(mod, args, kwargs)
            if any(isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != out.shape[0])
                   for v in bound.values()):
                raise UnsupportedModuleError(f"got an input without the output's {out.shape[0]} rows; the graphs "
                                             "engine cuts a row-wise layer's inputs by rows", module_name=name,
                                             module_type=type(mod))
        params = trainable_own_params(mod)
        detached = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in bound.items()}

        def rows_of(k: int) -> slice:
            return layout.node_slice(k) if node_rows else slice(k, k + 1)

        def call_of(k: int) -> Dict[str, Any]:
            if is_message_passing(mod):
                return _cut_call(layout, detached, k)
            return {n: v[rows_of(k)] if isinstance(v, torch.Tensor) else v for n, v in detached.items()}

        def on_grad(grad):
            g = self._scaled(grad, layout).detach()

            def grad_samples():
                rows = []
                for k in range(layout.num_graphs):
                    inputs = call_of(k)
                    with torch.enable_grad(), self._recompute():
                        out_k = _first_tensor(mod(**inputs))
                        grads = torch.autograd.grad(out_k, params, g[rows_of(k)], allow_unused=True)
                    rows.append([torch.zeros_like(p) if d is None else d for p, d in zip(params, grads)])
                return {p: (torch.stack([r[i] for r in rows]) if rows else p.new_zeros((0, *p.shape)))
                        for i, p in enumerate(params)}
            self._deliver_rows(grad_samples, params, layout)

        out.register_hook(on_grad)

    def _deliver_rows(self, grad_samples, params, layout: GraphBatch) -> None:
        if self._collected is not None:  # the self-check's backward: its rows stay out of the sink
            for p, v in grad_samples().items():
                self._collected[p] = self._collected[p] + v if p in self._collected else v
            return
        capture = LayerCapture(batch_size=layout.num_graphs, grad_samples=grad_samples, params=tuple(params),
                               call=self.forward_calls)
        getattr(self, SINK_ATTR).add(capture)

    # -- the self-check on the first batch ------------------------------------------------------------------------

    def _self_check(self, layout: GraphBatch) -> None:
        named = [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]
        was_training = self._module.training
        self._module.eval()  # dropout off: the batch and each graph alone see the same function
        self._collected, self._layout = {}, layout
        try:
            out = _first_tensor(self._module(*layout.args, **layout.kwargs))
            layout.check_output(out, self._named)
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1234), dtype=out.dtype)
            torch.autograd.grad((out * weights.to(out.device)).sum(), [p for _, p in named], allow_unused=True)
            rows, self._collected, self._layout = self._collected, None, None
            checked = list(range(min(layout.num_graphs, VERIFY_GRAPHS)))
            for k in checked:
                args, kwargs = layout.inputs_of_graph(k)
                with self._recompute():
                    out_k = _first_tensor(self._module(*args, **kwargs))
                loss_k = (out_k * weights[k:k + 1].to(out_k.device)).sum()
                alone = torch.autograd.grad(loss_k, [p for _, p in named], allow_unused=True)
                for (n, p), a in zip(named, alone):
                    a = torch.zeros_like(p) if a is None else a
                    mine = rows.get(p)
                    tol = dict(rtol=1e-6, atol=1e-9) if p.dtype == torch.float64 else dict(rtol=1e-3, atol=1e-5)
                    if mine is None and not a.any():  # a parameter this output does not use
                        continue
                    if mine is None or not torch.allclose(mine[k], a, **tol):
                        self._refuse_mixing(n, k, mine, a)
        finally:
            self._collected, self._layout = None, None
            self._module.train(was_training)
        self.verification = (f"{len(named)} parameter(s): per-graph gradients of graphs {checked} of the first "
                             f"batch ({layout.num_graphs} graphs) equal each graph's alone")

    def _refuse_mixing(self, name: str, k: int, mine: Optional[torch.Tensor], alone: torch.Tensor) -> None:
        diff = "no per-graph gradient" if mine is None else f"max difference {(mine[k] - alone).abs().max():.3g}"
        finding = Finding("self-check", name, "parameter", Kind.MIXES_SAMPLES, Severity.ERROR,
                          f"graph {k}'s gradient in the batch differs from its gradient run alone ({diff})",
                          "keep every op per graph: no normalisation or pooling over the whole batch, no reordering "
                          "of nodes, edges inside graphs; pool with the batch vector", self._location)
        raise SampleMixingError([finding], f"fxdp (graphs engine): {type(self._module).__name__} mixes graphs: "
                                           "a graph's gradient depends on the other graphs of its batch")


def _bound(module: nn.Module, args, kwargs) -> Dict[str, Any]:
    """A layer's call arguments by name (its defaults left out)."""
    try:
        return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    except TypeError:
        return {}


def _cut_call(layout: GraphBatch, bound: Dict[str, Any], k: int) -> Dict[str, Any]:
    """A message-passing layer's arguments for graph ``k`` alone: node rows, its edges (re-indexed) and edge rows."""
    edge_index = bound.get("edge_index")
    edges = layout.graph_of_node[edge_index[0]] == k if isinstance(edge_index, torch.Tensor) else None
    out = {}
    for name, value in bound.items():
        if name == "edge_index":
            out[name] = value[:, edges] - layout.ptr[k]
        elif name in EDGE_ROW_NAMES and isinstance(value, torch.Tensor) and edges is not None:
            out[name] = value[edges]
        elif isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == layout.num_nodes:
            out[name] = value[layout.node_slice(k)]
        elif name == "size" and value is not None:
            raise UnsupportedModuleError("got size=...; the graphs engine takes square adjacency (size=None)")
        else:
            out[name] = value
    return out


def compile_graph_model(model: nn.Module, *, batch_dim: int = 0, loss_reduction: str = "mean",
                        sink: Optional[GradientSink] = None) -> GraphGradSampleModule:
    """What ``compile_for_dp`` (modes ``"fx"`` and ``"hooks"``) returns for a model with PyG message-passing layers:
    the graphs engine around it, its report saying why (torch.fx cannot trace PyG's message passing, and the
    samples are segments of the node rows, not rows)."""
    if batch_dim != 0:
        raise ValueError("fxdp (graphs engine): a batch of graphs holds its nodes in dimension 0; pass batch_dim=0")
    wrapped = GraphGradSampleModule(model, loss_reduction=loss_reduction, sink=sink)
    reason = ("the model has PyTorch Geometric message-passing layers: one sample is one graph, its nodes a segment "
              "of dimension 0 given by the batch vector; the graphs engine computes per-graph gradients by segment "
              "(docs/graphs.md)")
    notes = tuple(f"'{name}': {rule}" for name, rule in wrapped.rules.items())
    setattr(wrapped, REPORT_ATTR, CompileReport(type(model).__name__, False, (), reason, None, GRAPHS, notes))
    return wrapped
