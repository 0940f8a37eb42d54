"""The gradient sink: the seam between the DP-aware ops, which write to it during backward, and the DP
optimizer, which reads from it after.

Write side. In backward, every DP-aware op (a layer in the compiled graph, a hooked layer, the
whole-model op) hands its model's sink one :class:`LayerCapture`: the layer's saved input ``A`` and
output gradient ``G``, both batch first and for a *summed* loss (the mean's ``1/N`` already undone),
and a function that materialises the layer's per-sample gradients from them. When the backward pass
ends the autograd engine calls :meth:`GradientSink.finish` (queued by the first ``add`` of that pass).

Read side. After ``loss.backward()`` the optimizer asks for each parameter's per-sample squared norms
and, given one clip factor per sample, each parameter's clipped sum ``sum_i c_i g_i``. It never reads
``p.grad_sample`` itself, so where the answers come from — materialised per-sample gradients
(:class:`GradSampleSink`, the default) or norms and re-weighted products from ``A`` and ``G``
(book-keeping) — is the sink's business.

Sink state lives on the model that owns the sink, never in a process-global: two models running
backward at the same time (two threads) each fill their own sink. Within one sink, captures are kept
per autograd graph task, so a backward pass that raised leaves nothing behind for the next one.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

# Re-exported: readers of this contract (the DP optimizer, which imports only this module) raise it too.
from fxdp.diagnostics.errors import PerSampleError


@dataclass
class LayerCapture:
    """What one DP-aware op saw in one backward pass.

    ``backprops`` always reads as G of the *summed* loss. A producer may hand the output gradient as it
    came (a mean loss's, carrying ``1/N``) with ``backprops_scale=N``: the first read of ``backprops`` then
    forms the product (once), while a reader that folds the factor into its own arithmetic reads
    ``backprops_unscaled`` and ``backprops_scale`` instead and saves a copy of G per layer."""

    batch_size: int
    grad_samples: Callable[[], Dict[nn.Parameter, torch.Tensor]]  # -> {p: (N, *p.shape)}, summed loss
    module: Optional[nn.Module] = None  # the layer, when a hand-written rule applies to it
    activations: Sequence[torch.Tensor] = ()  # A: the layer's tensor inputs, batch first
    backprops: Optional[torch.Tensor] = None  # G: gradient of the summed loss w.r.t. the output, batch first
    params: Sequence[nn.Parameter] = field(default_factory=tuple)  # the trainable parameters it covers
    call: int = 0  # the model's forward call it belongs to: two calls before one backward are different samples
    backprops_scale: float = 1.0  # G of the summed loss = backprops_unscaled * backprops_scale

    @property
    def backprops_unscaled(self) -> Optional[torch.Tensor]:
        return self._backprops


def _summed_loss_backprops(capture: LayerCapture) -> Optional[torch.Tensor]:
    if capture.backprops_scale != 1.0 and capture._backprops is not None:
        capture._backprops, capture.backprops_scale = capture._backprops * capture.backprops_scale, 1.0
    return capture._backprops


def _set_backprops(capture: LayerCapture, value: Optional[torch.Tensor]) -> None:
    capture._backprops = value


# ``backprops`` is a dataclass field (so the constructor takes it) read through this property.
LayerCapture.backprops = property(_summed_loss_backprops, _set_backprops)


class GradientSink(abc.ABC):
    """Where DP-aware ops deliver (A, G, layout-resolved) captures, and where the optimizer reads from."""

    # -- write side: called from backward -------------------------------------------------------------

    @abc.abstractmethod
    def add(self, capture: LayerCapture) -> None:
        """Take one layer's capture (called from a backward hook)."""

    # -- read side: called by the optimizer after backward ---------------------------------------------

    @abc.abstractmethod
    def squared_norms(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        """Per-sample squared gradient norms, shape ``(N,)``, of each of ``params`` that received
        per-sample gradients since :meth:`clear` (rows of successive backward passes concatenated)."""

    @abc.abstractmethod
    def clipped_sums(
        self, params: Iterable[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor]
    ) -> Dict[nn.Parameter, torch.Tensor]:
        """``sum_i factors[p][i] * g_i(p)`` for each parameter in ``factors``: the clipped sum."""

    def take_clipped_sums(
        self, params: Sequence[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor], alpha: float = 1.0
    ) -> Dict[nn.Parameter, torch.Tensor]:
        """``alpha`` times each clipped sum, then :meth:`clear` of ``params``: the optimizer's read of a
        physical batch. Each sum returned is the caller's to write to (it adds the noise in place).

        This default forms the sums with :meth:`clipped_sums`; a sink may instead forget each parameter's
        records as soon as its sum is formed, which keeps the step's peak memory down (book-keeping does:
        a layer's input and output gradient are freed once its sums exist, not after all of them)."""
        sums = self.clipped_sums(params, factors)
        self.clear(params)
        return {p: s * alpha for p, s in sums.items()}  # new tensors, whatever clipped_sums hands out

    @abc.abstractmethod
    def clear(self, params: Iterable[nn.Parameter]) -> None:
        """Forget everything recorded for ``params`` (the optimizer calls it after each step)."""

    # -- parameters the model no longer uses ------------------------------------------------------------

    def retire(self, gone: Iterable[nn.Parameter], why: str, current: Iterable[nn.Parameter] = ()) -> None:
        """The model no longer uses ``gone`` (``why``: a layer was replaced after it was compiled), and uses
        ``current``. An optimizer still holding a retired trainable parameter refuses to step: it would move
        it by noise alone."""
        retired = self.__dict__.setdefault("_retired", {})
        for p in current:
            retired.pop(p, None)
        for p in gone:
            retired[p] = why

    def retired_reason(self, p: nn.Parameter) -> Optional[str]:
        """Why the model no longer uses ``p`` (see :meth:`retire`), or None."""
        return self.__dict__.get("_retired", {}).get(p)


class GradSampleSink(GradientSink):
    """The materialising sink: per-sample gradients become ``p.grad_sample``.

    Within one forward call the uses of a parameter add up (tied weights, a layer called twice); the
    rows of several forward calls before one backward are concatenated in call order (zeros where a
    call did not use the parameter); successive backward passes append along dimension 0. The read side reads ``p.grad_sample``, so
    it also serves engines that write it themselves (PyTorch's ExpandedWeights).
    """

    def __init__(self):
        self._lock = threading.Lock()
        # graph task -> forward call -> (batch size, sums of that call's uses)
        self._pending: Dict[int, Dict[int, tuple]] = {}

    # A copied or pickled model (copy.deepcopy, torch.save) gets a fresh sink: what is pending belongs
    # to a backward pass of the original, and a lock cannot be copied.
    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def add(self, capture: LayerCapture) -> None:
        if capture.batch_size == 0:  # an empty batch (Poisson sampling): no rows, and no rule to run
            grad_samples = {p: p.new_zeros((0, *p.shape)) for p in capture.params}
        else:
            grad_samples = capture.grad_samples()
        with self._lock:
            pending = pending_of_this_backward(self)
            n, sums = pending.setdefault(capture.call, (capture.batch_size, {}))
            for p, g in grad_samples.items():
                check_grad_sample(p, g, n, capture.module)
                g = g.detach()
                sums[p] = sums[p] + g if p in sums else g

    def _publish(self, task: int) -> None:
        with self._lock:
            calls = self._pending.pop(task, {})
        params = list(dict.fromkeys(p for _, sums in calls.values() for p in sums))
        for p in params:
            parts = [sums[p] if p in sums else p.new_zeros((n, *p.shape)) for _, (n, sums) in sorted(calls.items())]
            g = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            previous = getattr(p, "grad_sample", None)
            p.grad_sample = g if previous is None else torch.cat([previous, g], dim=0)

    def squared_norms(self, params):
        return {
            p: p.grad_sample.reshape(p.grad_sample.shape[0], p.numel()).pow(2).sum(1)
            for p in params
            if getattr(p, "grad_sample", None) is not None
        }

    def clipped_sums(self, params, factors):
        out = {}
        for p in params:
            if p in factors and getattr(p, "grad_sample", None) is not None:
                gs = p.grad_sample
                out[p] = torch.tensordot(factors[p].to(gs.dtype), gs, dims=1)
        return out

    def clear(self, params):
        for p in params:
            if hasattr(p, "grad_sample"):
                p.grad_sample = None


def pending_of_this_backward(sink) -> dict:
    """The dict where ``sink`` keeps what the running backward pass delivered (``sink._pending[task]``).
    The first call of a pass queues ``sink._publish(task)`` for when the autograd engine finishes it.
    Call with ``sink._lock`` held."""
    task = torch._C._current_graph_task_id()
    pending = sink._pending.get(task)
    if pending is None:
        pending = sink._pending[task] = {}
        torch.autograd.Variable._execution_engine.queue_callback(lambda: sink._publish(task))
    return pending


def check_grad_sample(param: nn.Parameter, grad_sample: torch.Tensor, batch_size: Optional[int],
                      module: Optional[nn.Module] = None) -> None:
    """A per-sample gradient must have one row per sample and the parameter's shape after it.
    ``module``, the layer whose rule produced it when known, is named in the error."""
    of = f" of {type(module).__name__}" if module is not None else ""
    if batch_size is not None and grad_sample.shape[0] != batch_size:
        raise PerSampleError(
            f"fxdp: per-sample gradients with {grad_sample.shape[0]} rows for a batch of {batch_size} samples "
            f"(parameter{of} of shape {tuple(param.shape)}); where the batch sits was recorded wrongly. Pass "
            "example_inputs with more than one sample to compile_for_dp"
        )
    if grad_sample.shape[1:] != param.shape:
        fix = f" Check the per-sample rule for {type(module).__name__}." if module is not None else ""
        raise PerSampleError(
            f"fxdp: a per-sample rule returned shape {tuple(grad_sample.shape)} for a parameter{of} of "
            f"shape {tuple(param.shape)}; expected (N, *{tuple(param.shape)}).{fix}"
        )


SINK_ATTR = "fxdp_sink"


def sink_of(model: nn.Module) -> Optional[GradientSink]:
    """The sink a compiled or wrapped model delivers to (``None`` for a plain model)."""
    sink = getattr(model, SINK_ATTR, None)
    return sink if isinstance(sink, GradientSink) else None


__all__: List[str] = ["LayerCapture", "GradientSink", "GradSampleSink", "check_grad_sample", "sink_of", "SINK_ATTR",
                      "PerSampleError"]
