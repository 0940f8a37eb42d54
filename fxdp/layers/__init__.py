"""Opacus's DP layers (``opacus.layers``), for code written for Opacus: ``DPLSTM``, ``DPGRU``, ``DPRNN``,
``DPMultiheadAttention`` and ``SequenceBias``.

Opacus needs its own recurrent and attention layers because its hooks see only Linear-like layers. fxdp
computes per-sample gradients of the stock ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` / ``nn.MultiheadAttention``
itself, so the DP layers here *are* the stock modules: subclasses that keep torch's ``forward``, its
parameters and its ``state_dict`` keys (those of Opacus's layers too), trained by the same per-sample rules
as the stock modules in every engine. Nothing needs replacing: they exist so that imports and
``ModuleValidator.fix`` behave as in Opacus. ``SequenceBias`` (a learned step appended to a sequence) is a
layer of its own, without a hand-written rule: the generic rule gives its per-sample gradients.

This package imports nothing from fxdp.
"""

from fxdp.layers.attention import DPMultiheadAttention, SequenceBias
from fxdp.layers.recurrent import DPGRU, DPLSTM, DPRNN

__all__ = ["DPLSTM", "DPGRU", "DPRNN", "DPMultiheadAttention", "SequenceBias"]
