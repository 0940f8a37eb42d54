"""Opacus's ``DPOptimizer`` extension points, for subclasses written for Opacus (a Laplace mechanism in
``add_noise``, say). :class:`~fxdp.optim.dp_optimizer.DPOptimizer`'s own step forms the clipped, noised gradient
in one pass and never calls them; a subclass overriding any of ``pre_step``, ``clip_and_accumulate``,
``add_noise`` or ``scale_grad`` steps through them instead::

    step():  every check of the default step (settings, batch bookkeeping, per-sample norms), then
             pre_step():  clip_and_accumulate()    p.summed_grad += sum_i c_i g_i
                          (a signalled skip: return False, nothing updated)
                          add_noise()              p.grad = p.summed_grad + N(0, noise_std^2)
                          scale_grad()             p.grad /= expected_batch_size   ("mean")
             the wrapped optimizer's step when pre_step returned True; the accountant's hook as always.

The clip factors ``clip_and_accumulate`` applies are those the checks computed (no second pass). The records
are cleared after ``pre_step`` whatever the override did, and ``p.summed_grad`` after the update.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from fxdp.optim.noise import add_gaussian_noise_all_


class OpacusExtensionPoints:
    """Mixed into :class:`~fxdp.optim.dp_optimizer.DPOptimizer` (which supplies the sink, the settings, the checks
    and the step's state ``step_state``: the clip factors ``clip_and_accumulate`` reads are its ``factors``)."""

    @property
    def params(self) -> List[nn.Parameter]:
        """The trainable parameters (those with ``requires_grad``), in the optimizer's order."""
        return self._trainable_params()

    @property
    def accumulated_iterations(self) -> int:
        """Backward passes in this physical batch: always 1 (fxdp refuses several backward passes per
        step; a logical batch in several physical ones goes through ``signal_skip_step``)."""
        return 1

    def _step_through_overrides(self, params: List[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor]) -> bool:
        """The step of a subclass overriding an extension point: ``pre_step`` (by default
        ``clip_and_accumulate``, then unless a skip was signalled ``add_noise`` and ``scale_grad``). Every check
        of the default step has run before (the settings, the batch bookkeeping, the per-sample norms, whose
        clip factors ``clip_and_accumulate`` reads); the records are cleared after, whatever the override did."""
        self.step_state.factors = factors
        try:
            stepped = self.pre_step()
        finally:
            self.step_state.factors = None
            self.sink.clear(params)
        if stepped:
            for p, grad in zip(params, self._reduce([torch.zeros_like(p) if p.grad is None else p.grad
                                                     for p in params])):
                p.grad = grad
                p.summed_grad = None
        return bool(stepped)

    def pre_step(self, closure: Optional[Callable[[], Any]] = None) -> bool:
        """Clip and accumulate this physical batch; unless a skip was signalled, add the noise and scale.
        Returns whether the wrapped optimizer should step."""
        self.clip_and_accumulate()
        if self.step_state.skip_next:
            self.step_state.skip_next = False
            for p in self.params:
                p.grad = None  # the plain (unclipped) gradient is not private: nothing reads it
            return False
        self.add_noise()
        self.scale_grad()
        return True

    def clip_and_accumulate(self) -> None:
        """Add this physical batch's clipped per-sample gradients (factors ``min(1, C / norm)``) to each
        parameter's ``p.summed_grad``."""
        factors = self.step_state.factors
        factors = factors if factors is not None else self._factors(self.params)
        sums = self.sink.take_clipped_sums(list(factors), factors) if factors else {}
        for p in self.params:
            s = sums.pop(p, None)
            s = torch.zeros_like(p) if s is None else s.to(p.dtype).reshape(p.shape)
            earlier = getattr(p, "summed_grad", None)
            p.summed_grad = s if earlier is None else earlier + s

    def add_noise(self) -> None:
        """``p.grad = p.summed_grad + N(0, noise_std^2)``."""
        std = self.noise_std if self._adds_noise() else 0.0
        grads = [p.summed_grad.clone().view_as(p) for p in self.params]
        if std > 0:
            add_gaussian_noise_all_(grads, std, secure_mode=self.secure_mode, generator=self.generator)
        for p, grad in zip(self.params, grads):
            p.grad = grad

    def scale_grad(self) -> None:
        """Divide ``p.grad`` by the expected batch size for ``loss_reduction="mean"``."""
        if self.loss_reduction == "mean":
            for p in self.params:
                p.grad /= self.expected_batch_size * self.accumulated_iterations
