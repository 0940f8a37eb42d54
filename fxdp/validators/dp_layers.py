"""Stock recurrent and attention layers: valid as they are, turned into ``fxdp.layers`` by ``fix``.

fxdp computes per-sample gradients of ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and ``nn.MultiheadAttention``
itself, so no validator reports them (Opacus asks to replace them). The fixer is there for code written for
Opacus, which expects ``ModuleValidator.fix`` to return ``DPLSTM`` & co.: fxdp's DP layers are the stock
modules under another name (:mod:`fxdp.layers`), so the replacement changes only the type, never the
computation, the parameters or the state_dict. Only the exact stock types are replaced: a user's subclass
keeps its own ``forward``.
"""

from __future__ import annotations

import copy

from torch import nn

from fxdp.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from fxdp.validators.module_validator import register_module_fixer

DP_LAYER_FOR = {nn.LSTM: DPLSTM, nn.GRU: DPGRU, nn.RNN: DPRNN, nn.MultiheadAttention: DPMultiheadAttention}


@register_module_fixer(list(DP_LAYER_FOR))
def to_dp_layer(module: nn.Module, **kwargs) -> nn.Module:
    """A copy of a stock layer as its ``fxdp.layers`` type (same parameters, flags and mode); anything else
    (a DP layer already, a subclass of the user's) is returned as it is."""
    dp_type = DP_LAYER_FOR.get(type(module))
    if dp_type is None:
        return module
    replacement = copy.deepcopy(module)
    replacement.__class__ = dp_type  # a subclass adding no state: the same module under the DP layer's type
    return replacement
