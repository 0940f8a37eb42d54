"""The ``no_op`` engine: computes no per-sample gradients, for users who set ``p.grad_sample`` themselves
(their own functorch code, say). Its sink's read side reads what they set."""

from __future__ import annotations

from fxdp.engines.base import GradSampleModuleBase


class NoOpGradSampleModule(GradSampleModuleBase):
    """Computes no per-sample gradients: for users who set ``p.grad_sample`` themselves."""
