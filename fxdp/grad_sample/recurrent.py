"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) as Linear-like projections over time steps.

Each layer and direction has two projections: the input projection ``W_ih`` (with ``b_ih``), applied to
every time step's input at once, ``(N, T, d) -> (N, T, gates)``, and the recurrent projection ``W_hh``
(with ``b_hh``), one layer used at every step on the previous state, ``(N, T, h) -> (N, T, gates)``. A
projection's per-sample gradient is that of a Linear layer on a sequence, summed over the steps, so it is
delivered as a :class:`RecurrentProjection` (an ``nn.Linear`` sharing the recurrent layer's weight and
bias): the materialising sink writes ``p.grad_sample`` with the Linear rule, and the book-keeping sink
chooses ghost norms or per-sample gradients from ``T``, ``d`` and ``gates`` as for any Linear layer on a
sequence. The layer itself is run step by step by :mod:`fxdp.runtime.recurrent`, whose backward delivers
one capture per projection.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

from torch import nn

from fxdp.grad_sample.registry import find_grad_sampler

RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def recurrent_rule_applies(module: nn.Module) -> bool:
    """A stock recurrent layer this rule reproduces exactly: LSTM (without ``proj_size``), GRU or RNN,
    whose ``forward`` is torch's, with no per-sample rule registered for it by the user."""
    return (
        isinstance(module, RECURRENT)
        and any(type(module).forward is base.forward for base in RECURRENT)
        and find_grad_sampler(module) is None  # a user's rule (or a parametrization) decides instead
        and getattr(module, "proj_size", 0) == 0
        and module.mode in _GATES
    )


class RecurrentProjection(nn.Linear):
    """One projection of a recurrent layer (``weight_ih_l0`` with ``bias_ih_l0``, ...) seen as a Linear layer
    applied at every time step. It shares the recurrent layer's parameters and is no submodule of it."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], name: str):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.name = name  # the recurrent layer's parameter name, "weight_ih_l0"

    def extra_repr(self) -> str:
        return f"{self.name}: {super().extra_repr()}"


class LSTMProjection(RecurrentProjection):
    pass


class GRUProjection(RecurrentProjection):
    pass


class RNNProjection(RecurrentProjection):
    pass


_KINDS = {"LSTM": LSTMProjection, "GRU": GRUProjection, "RNN_TANH": RNNProjection, "RNN_RELU": RNNProjection}
_VIEWS: "weakref.WeakKeyDictionary[nn.Module, Dict[str, RecurrentProjection]]" = weakref.WeakKeyDictionary()


def projections(module: nn.Module, suffix: str) -> Tuple[RecurrentProjection, RecurrentProjection]:
    """The input and recurrent projections of one layer and direction (``suffix``: ``"_l0"``,
    ``"_l1_reverse"``), the same objects at every call while the module keeps its parameters (sinks key
    their plans by layer)."""
    views = _VIEWS.setdefault(module, {})
    out = []
    for kind in ("ih", "hh"):
        name = f"weight_{kind}{suffix}"
        weight, bias = getattr(module, name), getattr(module, f"bias_{kind}{suffix}", None)
        view = views.get(name)
        if view is None or view.weight is not weight or view.bias is not bias:
            view = views[name] = _KINDS[module.mode](weight, bias, name)
        out.append(view)
    return out[0], out[1]


__all__ = ["RECURRENT", "RecurrentProjection", "LSTMProjection", "GRUProjection", "RNNProjection", "projections",
           "recurrent_rule_applies"]
