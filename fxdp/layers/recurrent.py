"""Recurrent layers: the registrations of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` and the recurrent cells, and
``DPLSTM``, ``DPGRU``, ``DPRNN``: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` under Opacus's names and constructor
signatures (``proj_size`` before ``nonlinearity``; ``device``/``dtype`` as keywords, as torch's).

- per-sample rule: none of the layer's own. The graph engine runs a stock recurrent layer step by step
  (:mod:`fxdp.runtime.recurrent`), each projection (``weight_ih_l0`` with ``bias_ih_l0``, ...) a
  :class:`~fxdp.grad_sample.recurrent.RecurrentProjection` that takes ``nn.Linear``'s rule; the hooks engine gives
  the layer the generic rule;
- book-keeping: :class:`fxdp.sinks.bookkeeping.recurrent.RecurrentLayerBookkeeping` (the layer planned, for the
  report, as its projections) and :class:`~fxdp.sinks.bookkeeping.recurrent.RecurrentProjectionBookkeeping` (each
  projection a Linear layer on a sequence, the Gram matrix of the gate gradients formed once for both);
- batch rules: :data:`fxdp.passes.batch_rules.layers.rnn_rule` (the batch where ``batch_first`` says) and
  :data:`~fxdp.passes.batch_rules.layers.rnn_cell_rule` for the cells (batch rule only: the generic rule gives
  their per-sample gradients).

They do not override ``forward``: fxdp's recurrent rule (:mod:`fxdp.grad_sample.recurrent`) and every
engine treat them exactly as the stock module, ``PackedSequence`` inputs included, and a state_dict moves
between a DP layer and its stock module either way.
"""

from __future__ import annotations

from torch import nn

from fxdp.grad_sample.recurrent import RECURRENT, RecurrentProjection
from fxdp.layers.registration import register_layer
from fxdp.passes.batch_rules.core import nn_family
from fxdp.passes.batch_rules.layers import rnn_cell_rule, rnn_rule
from fxdp.sinks.bookkeeping.recurrent import RecurrentLayerBookkeeping, RecurrentProjectionBookkeeping

register_layer(list(RECURRENT), bookkeeping=RecurrentLayerBookkeeping, batch_rule=rnn_rule)
register_layer(nn_family(nn.RNNBase), batch_rule=rnn_rule)  # RNNBase and each torch subclass
register_layer(RecurrentProjection, bookkeeping=RecurrentProjectionBookkeeping)
register_layer(nn_family(nn.RNNCellBase), batch_rule=rnn_cell_rule)


def _projection_only_for_lstm(cls: type, proj_size: int) -> None:
    if proj_size:
        raise ValueError(f"{cls.__name__}: proj_size={proj_size}, but projections exist only in LSTM "
                         "(DPLSTM); leave proj_size=0")


class DPRNN(nn.RNN):
    """``nn.RNN`` (Elman, ``tanh`` or ``relu``) with Opacus's ``DPRNN`` signature."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, nonlinearity: str = "tanh", *, device=None, dtype=None) -> None:
        _projection_only_for_lstm(type(self), proj_size)
        super().__init__(input_size, hidden_size, num_layers=num_layers, nonlinearity=nonlinearity, bias=bias,
                         batch_first=batch_first, dropout=dropout, bidirectional=bidirectional,
                         device=device, dtype=dtype)


class DPGRU(nn.GRU):
    """``nn.GRU`` with Opacus's ``DPGRU`` signature."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, *, device=None, dtype=None) -> None:
        _projection_only_for_lstm(type(self), proj_size)
        super().__init__(input_size, hidden_size, num_layers=num_layers, bias=bias, batch_first=batch_first,
                         dropout=dropout, bidirectional=bidirectional, device=device, dtype=dtype)


class DPLSTM(nn.LSTM):
    """``nn.LSTM`` with Opacus's ``DPLSTM`` signature. ``proj_size > 0`` (which Opacus refuses) is torch's
    projected LSTM; fxdp trains it with the generic per-sample rule."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, *, device=None, dtype=None) -> None:
        super().__init__(input_size, hidden_size, num_layers=num_layers, bias=bias, batch_first=batch_first,
                         dropout=dropout, bidirectional=bidirectional, proj_size=proj_size,
                         device=device, dtype=dtype)
