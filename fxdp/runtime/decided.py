"""What a DP-aware layer call decided at a site, kept for the site's next calls while it still holds.

A layer call (:func:`~fxdp.runtime.ops.dp_aware_layer`) decides the same things at every call of a training loop:
where the batch sits in its input, which of the layer's parameters are trainable, whether the recurrent or the
transformer rule applies, which per-sample rule the layer has. Looked up afresh they cost more Python than a small
layer's arithmetic (issue 34). A :class:`LayerDecision` keeps them for the usual call, a leaf layer on one plain
tensor with a hand-written rule, together with everything they were decided from: the site's layouts (the batch
guard replaces them, never mutates them), its sink, the layer's class and its class's ``forward`` and every
registry's state (:func:`~fxdp.registry.lookup_stamp`), the layer's parameters (the same objects, each as trainable
as it was). :meth:`LayerDecision.holds` checks all of it at every call; where any differs the call decides afresh.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from fxdp.layout import BROADCAST, BatchLayout
from fxdp.registry import lookup_stamp


class LayerDecision:
    """A site's decisions for a leaf layer called on one plain tensor (see the module)."""

    __slots__ = ("site_layouts", "site_out_layouts", "sink", "stamp", "parameters", "flags", "layouts", "trainable",
                 "params", "rule")

    def __init__(self, site, module: nn.Module, layout: BatchLayout, trainable: Dict[str, nn.Parameter], rule):
        self.site_layouts, self.site_out_layouts, self.sink = site.layouts, site.out_layouts, site.sink
        self.stamp = lookup_stamp(module)
        self.parameters = tuple(module._parameters.values())
        self.flags = tuple(p is not None and p.requires_grad for p in self.parameters)
        self.layouts: List[BatchLayout] = [layout]
        self.trainable = trainable
        self.params = tuple(trainable.values())
        self.rule = rule

    @staticmethod
    def make(site, module: nn.Module, args: tuple, kwargs: dict, layouts: List[BatchLayout], arg_params: list,
             trainable: Dict[str, nn.Parameter], rule, outputs: list) -> Optional["LayerDecision"]:
        """The decision of a call that took the hand-written rule's path, where it may be kept; else ``None``."""
        if (kwargs or len(args) != 1 or type(args[0]) is not torch.Tensor or arg_params or not trainable
                or len(outputs) != 1 or module._modules or isinstance(module, nn.RNNBase) or rule is None
                or layouts[0].kind == BROADCAST or lookup_stamp(module) is None):
            return None
        return LayerDecision(site, module, layouts[0], trainable, rule)

    def holds(self, module: nn.Module, site, x) -> bool:
        """Whether everything this decision was made from is as it was, for a call of ``module`` on ``x``."""
        if (type(x) is not torch.Tensor or site.layouts is not self.site_layouts
                or site.out_layouts is not self.site_out_layouts or site.sink is not self.sink or module._modules
                or lookup_stamp(module) != self.stamp):
            return False
        parameters = module._parameters
        if len(parameters) != len(self.parameters):
            return False
        for p, q, flag in zip(parameters.values(), self.parameters, self.flags):
            if p is not q or (p is not None and p.requires_grad != flag):
                return False
        return True
