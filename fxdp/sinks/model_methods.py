"""Opacus's ``GradSampleModule`` methods, on every model fxdp returns, whatever its engine (the compiled
graph, the hooks engine, ew, functorch, no_op, the whole-model op).

They act through the model's gradient sink (:mod:`fxdp.sinks.contract`), the one place every engine
delivers to, so each behaves the same under every engine:

- :meth:`disable_hooks` makes the sink drop what the engine delivers: backward then gives the ordinary
  ``p.grad`` and no per-sample gradient, and a DP optimizer refuses to step on such a gradient (it would
  be unclipped), so switching the hooks off never lets a non-private step through;
- :meth:`forbid_grad_accumulation` / :meth:`allow_grad_accumulation` are recorded: fxdp refuses, in
  either case, an optimizer step over the backward passes of two batches (see
  :class:`~fxdp.sinks.contract.StepCalls`); accumulate with the optimizer's skip steps instead.
"""

from __future__ import annotations

from torch import nn

from fxdp.grad_sample.accumulate import zero_grad_sample
from fxdp.sinks.contract import SINK_ATTR


class OpacusModelMethods:
    """Mixed into the class of every model fxdp returns; it provides ``_standard_module()``: the model the
    user gave (which shares its parameters)."""

    def _standard_module(self) -> nn.Module:
        raise NotImplementedError

    def to_standard_module(self) -> nn.Module:
        """The model as the user gave it (the same parameters), with no per-sample machinery: an engine's
        hooks are removed from it and ``p.grad_sample`` cleared."""
        remove = getattr(self, "remove_hooks", None)
        if remove is not None:
            remove()
        self.del_grad_sample()
        return self._standard_module()

    @property
    def hooks_enabled(self) -> bool:
        """Whether backward computes per-sample gradients (see :meth:`disable_hooks`)."""
        return getattr(self, SINK_ATTR).enabled

    def enable_hooks(self) -> None:
        """Compute per-sample gradients again in backward (the default)."""
        getattr(self, SINK_ATTR).enabled = True

    def disable_hooks(self) -> None:
        """Backward computes the ordinary ``p.grad`` only, no per-sample gradient (evaluation, a
        non-private step of your own); a DP optimizer refuses to step on such a gradient."""
        getattr(self, SINK_ATTR).enabled = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``p.grad`` zeroed (or set to None) and ``p.grad_sample`` set to None, for every parameter."""
        super().zero_grad(set_to_none=set_to_none)
        self.del_grad_sample()

    def del_grad_sample(self) -> None:
        """Set ``p.grad_sample`` of every parameter to None."""
        zero_grad_sample(self._standard_module())

    def forbid_grad_accumulation(self) -> None:
        """Recorded for Opacus code: fxdp always refuses an optimizer step over two batches' backward passes."""
        self.grad_accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        """Recorded for Opacus code: backward passes over one batch (two losses) always add up per sample; an
        optimizer step over two batches' backward passes is refused all the same (use skip steps)."""
        self.grad_accumulation_allowed = True
