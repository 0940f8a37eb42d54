"""``DPLSTM``, ``DPGRU``, ``DPRNN``: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` under Opacus's names and constructor
signatures (``proj_size`` before ``nonlinearity``; ``device``/``dtype`` as keywords, as torch's).

They do not override ``forward``: fxdp's recurrent rule (:mod:`fxdp.grad_sample.recurrent`) and every
engine treat them exactly as the stock module, ``PackedSequence`` inputs included, and a state_dict moves
between a DP layer and its stock module either way.
"""

from __future__ import annotations

from torch import nn


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
