"""Book-keeping of a trainable parameter added to per-sample data (``x + self.pos``: a learned position table),
a function using a parameter rather than a layer: its per-sample gradient is the output gradient summed over
the dimensions the parameter is broadcast along, negated where it is subtracted (:mod:`fxdp.grad_sample.broadcast`).
The runtime forms it in backward, as small as G, and the sink reads it as materialised; this registration
plans it for the compile report."""

from __future__ import annotations

import torch
import torch.fx

from fxdp.grad_sample.broadcast import ADDITIONS, added_parameter_sign, summed_dims
from fxdp.layout import BATCHED
from fxdp.sinks.bookkeeping.plans import fake_shape
from fxdp.sinks.bookkeeping.registry import LayerBookkeeping, LayerPlan, register_bookkeeping


def _trainable_operands(gm: torch.fx.GraphModule, operands) -> list:
    """``(position, parameter)`` of the operands that are trainable parameters of ``gm``."""
    params = []
    for i, a in enumerate(operands):
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            try:
                params.append((i, gm.get_parameter(a.target)))
            except AttributeError:
                pass
    return [(i, p) for i, p in params if p.requires_grad]


@register_bookkeeping(functions=ADDITIONS)
class AddedParameterBookkeeping(LayerBookkeeping):
    def graph_plans(self, module, gm, node, site, n, prefer):
        """``x + p`` / ``x - p`` for one trainable parameter ``p`` broadcast against per-sample data (else None:
        the generic rule)."""
        operands = node.args[2:]
        params = _trainable_operands(gm, operands)
        out, lay = fake_shape(node), site.out_layouts[0] if getattr(site, "out_layouts", None) else None
        if len(params) != 1 or out is None or lay is None or lay.kind != BATCHED or out[lay.dim] != n:
            return None
        position, param = params[0]
        sign = added_parameter_sign(site.fn, position, len(operands), bool(node.kwargs))
        if sign is None or fake_shape(operands[1 - position]) is None or summed_dims(out, lay.dim, param.shape) is None:
            return None
        what = "subtracted from" if sign < 0 else "added to"
        return [("", LayerPlan("parameter", "summed", f"{what} per-sample data: its per-sample gradient is the output "
                                                     "gradient summed over the dimensions it is broadcast along"))]
