"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) as Linear-like projections over time steps: the
input projection of all steps as one sequence matmul, the recurrent projection as one layer used at every
step, and one tensor of gate gradients per layer and direction that serves both (see
:mod:`~fxdp.grad_sample.recurrent.layers`; the recurrence itself is in
:mod:`~fxdp.grad_sample.recurrent.cells`)."""

from fxdp.grad_sample.recurrent.layers import (
    RECURRENT, GRUProjection, LSTMProjection, RecurrentProjection, RNNProjection, projections, recurrent_forward,
    recurrent_rule_applies,
)

__all__ = ["RECURRENT", "RecurrentProjection", "LSTMProjection", "GRUProjection", "RNNProjection", "projections",
           "recurrent_forward", "recurrent_rule_applies"]
