"""Stock recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) run step by step with their own parameters, so
that backward hands one Linear-like capture per projection to the model's sink
(:mod:`~fxdp.runtime.recurrent.layers`; the recurrence itself, one autograd Function per cell type, is in
:mod:`~fxdp.runtime.recurrent.cells`; which layers this reproduces, and their projections as Linear layers,
is :mod:`fxdp.grad_sample.recurrent`)."""

from fxdp.runtime.recurrent.layers import recurrent_forward

__all__ = ["recurrent_forward"]
