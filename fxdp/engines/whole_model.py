"""The ``fx+whole-model`` engine: a traced model whose graph has a parametrised op the per_sample pass
cannot handle (a parameter transposed before use, a layer fed only broadcast data, ...) runs as ONE
DP-aware op, the generic rule over all its parameters, each sample re-run alone.

Unlike ``grad_sample_mode="functorch"`` it knows, from the batch_dim pass, where the batch sits in
every input (positional or keyword, batched, broadcast or unbatched) and every output (tuples too).
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxdp import meta
from fxdp.engines.base import ParameterWatch
from fxdp.sinks.model_methods import OpacusModelMethods
from fxdp.sinks.contract import SINK_ATTR, GradientSink, GradSampleSink
from fxdp.layout import UNBATCHED_LAYOUT, UNKNOWN, BatchLayout
from fxdp.runtime.ops import PerSampleSite, dp_aware_layer


class PerSampleModel(OpacusModelMethods, nn.Module):
    """The whole model as one DP-aware op, for models whose graph has a parametrised op the per_sample
    pass cannot handle: the generic rule over all parameters, each sample re-run alone, with the layouts
    the batch_dim pass found for every input (batched, broadcast or unbatched, positional or keyword)
    and every output (tuples included)."""

    def __init__(self, model: nn.Module, site: PerSampleSite, input_layouts: Dict[str, List[BatchLayout]],
                 batch_input: Tuple[str, int]):
        super().__init__()
        self.module = model
        self.fxdp_site = site
        setattr(self, SINK_ATTR, site.sink)  # sink_of(model) finds the sink the site delivers to
        self._input_layouts = input_layouts  # forward's parameter name -> layouts of its tensors
        self._batch_input = batch_input  # (name, dim) of the input that carries the batch
        self._signature = inspect.signature(model.forward)
        self._parameter_watch = ParameterWatch(model)

    def _standard_module(self) -> nn.Module:
        return self.module

    @property
    def _module(self) -> nn.Module:  # Opacus's name for the wrapped model
        return self.module

    def forward(self, *args, **kwargs):
        self._parameter_watch.check(self.fxdp_site.sink)
        bound = self._signature.bind(*args, **kwargs)
        name, dim = self._batch_input
        n = bound.arguments[name].shape[dim]
        layouts = []
        for arg_name, value in [*zip(self._signature.parameters, args), *kwargs.items()]:
            tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
            recorded = self._input_layouts.get(arg_name, [])
            layouts += [recorded[i] if i < len(recorded) else UNBATCHED_LAYOUT for i in range(len(tensors))]
        self.fxdp_site.layouts = layouts
        return dp_aware_layer(self.module, self.fxdp_site, n, *args, **kwargs)


def whole_model_op(model: nn.Module, gm: torch.fx.GraphModule, *, loss_reduction: str, batch_dim: int,
                   sink: Optional[GradientSink] = None) -> PerSampleModel:
    """The whole model as one DP-aware op (the generic rule), with the layouts the batch_dim pass found
    for its inputs and outputs on ``gm`` (the analysed graph)."""
    default = BatchLayout.at(batch_dim)

    def layouts(value) -> List[BatchLayout]:
        return [lay if lay.kind != UNKNOWN else default
                for lay in pytree.tree_leaves(value) if isinstance(lay, BatchLayout)]

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    out_nodes = [a for a in pytree.tree_leaves(output.args[0]) if isinstance(a, torch.fx.Node)]
    site = PerSampleSite(
        "<model>", type(model).__name__, "generic", loss_reduction,
        out_layouts=[lay for node in out_nodes for lay in layouts(node.meta.get(meta.BATCH_LAYOUT, default))],
        description=f"the whole model ({type(model).__name__})",
        sink=sink if sink is not None else GradSampleSink(),
    )
    index, dim = meta.batch_source(placeholders, batch_dim)
    inputs = {ph.target: layouts(ph.meta.get(meta.BATCH_LAYOUT, default)) for ph in placeholders}
    return PerSampleModel(model, site, inputs, (placeholders[index].target, dim))

