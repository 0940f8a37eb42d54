"""The book-keeping sink: keeps each layer's uses during backward, computes norms when a backward pass
ends, and answers the optimizer's squared_norms / clipped_sums / clear."""

from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from fxdp.diagnostics.errors import PerSampleError
from fxdp.grad_sample.bookkeeping.plans import _CONVS, LayerPlan, plan_layer
from fxdp.grad_sample.bookkeeping.uses import (
    _ConvWeight, _EmbeddingWeight, _LinearWeight, _Materialised, _Segment, _Summed, _Use, _same_batch,
    _tied_squared_norms,
)
from fxdp.grad_sample.linear import is_transformers_conv1d
from fxdp.grad_sample.sink import GradientSink, LayerCapture, check_grad_sample, pending_of_this_backward


class BookkeepingSink(GradientSink):
    """Per-sample norms and clipped sums from (A, G), with per-sample gradients only where they are small.

    ``method``: ``None`` picks per layer from shapes (:func:`plan_layer`); ``"ghost"`` or ``"per_sample"``
    forces that method for every Linear layer on sequences and every Conv layer (tests, benchmarks).
    """

    def __init__(self, method: Optional[str] = None):
        if method not in (None, "ghost", "per_sample"):
            raise ValueError(f"method must be None, 'ghost' or 'per_sample', got {method!r}")
        self.method = method
        self.plans: Dict[nn.Module, LayerPlan] = {}  # the last plan of every layer seen, for reports
        self.tied: Dict[nn.Parameter, int] = {}  # parameters with several uses in one backward -> how many
        self._lock = threading.Lock()
        self._pending: Dict[int, Dict[nn.Parameter, List[_Use]]] = {}  # graph task -> uses in that pass
        self._segments: Dict[nn.Parameter, List[_Segment]] = {}  # published backward passes, in call order

    # Layers it can book-keep run without their weight gradient in backward (only input gradients
    # flow, see :func:`call_without_param_grads`): the optimizer writes ``p.grad`` from the clipped sums.
    skips_param_grads = True

    # A copied or pickled model (copy.deepcopy, torch.save) gets a fresh sink: what is recorded belongs
    # to backward passes of the original, and a lock cannot be copied.
    def __getstate__(self):
        return {"method": self.method}

    def __setstate__(self, state):
        self.__init__(state["method"])

    # -- write side ------------------------------------------------------------------------------------

    def add(self, capture: LayerCapture) -> None:
        uses = self._uses(capture)
        with self._lock:
            pending = pending_of_this_backward(self)
            for p, use in uses.items():
                pending.setdefault(p, []).append(use)

    def _uses(self, capture: LayerCapture) -> Dict[nn.Parameter, _Use]:
        # G as delivered and the factor that makes it the summed loss's (folded into norms and clip factors
        # below, not multiplied into a copy of G); capture.backprops would form the product
        module, unscaled, scale = capture.module, capture.backprops_unscaled, capture.backprops_scale
        acts = [a for a in capture.activations if isinstance(a, torch.Tensor)]
        shape = None if unscaled is None else unscaled.shape
        plan = plan_layer(module, [a.shape for a in acts], shape, self.method)
        if module is not None:
            self.plans[module] = plan
        params = [p for p in capture.params if p.requires_grad]
        bias = getattr(module, "bias", None)
        if plan.method == "materialise" or any(p is not module.weight and p is not bias for p in params):
            out = {}
            for p, gs in capture.grad_samples().items():
                if p.requires_grad:
                    check_grad_sample(p, gs, capture.batch_size, module)
                    out[p] = _Materialised(gs.detach())
            return out
        a, g_raw = acts[0].detach(), unscaled.detach()
        if a.shape[0] != capture.batch_size or g_raw.shape[0] != capture.batch_size:
            raise PerSampleError(
                f"fxdp: {plan.layer} delivered input {tuple(a.shape)} and output gradient {tuple(g_raw.shape)} for "
                f"a batch of {capture.batch_size}; where the batch sits was recorded wrongly"
            )
        out: Dict[nn.Parameter, _Use] = {}
        conv1d = is_transformers_conv1d(module)
        for p in params:
            if p is bias and (isinstance(module, nn.Linear) or conv1d):  # summed over the middle positions
                n, width = g_raw.shape[0], g_raw.shape[-1]  # (G itself on (N, p))
                out[p] = _Summed(g_raw if g_raw.dim() == 2 else g_raw.reshape(n, -1, width).sum(1), scale)
            elif p is bias:  # a Conv: summed over the spatial positions
                out[p] = _Summed(g_raw.flatten(2).sum(2), scale)
            elif isinstance(module, nn.Linear):
                out[p] = _LinearWeight(a, g_raw, plan.method, scale)
            elif conv1d:  # weight (in, out): its per-sample gradient A_i^T G_i is a Linear one with A and G
                out[p] = _LinearWeight(g_raw, a.to(g_raw.dtype), plan.method, scale)  # swapped (norms unchanged)
            elif isinstance(module, _CONVS):
                out[p] = _ConvWeight(module, a, g_raw, plan.method, scale)
            else:  # an Embedding's G is (N, T, D), small next to its table: scaled once here
                out[p] = _EmbeddingWeight(module, a, g_raw * scale if scale != 1.0 else g_raw)
            if plan.method == "per_sample" and p.numel() <= a[0].numel() + g_raw[0].numel():
                # its per-sample gradient is formed for the norm anyway and is smaller than A and G: keep it
                # now (A and G are freed as backward goes on) and clip by a weighted sum, not a product
                out[p] = _Materialised(out[p].grad_samples())
        return out

    def _publish(self, task: int) -> None:
        with self._lock:
            pending = self._pending.pop(task, {})
        segments = {}
        with torch.no_grad():
            for p, uses in pending.items():
                _same_batch(p, uses)
                if len(uses) == 1:
                    norms = uses[0].squared_norms()
                else:
                    self.tied[p] = len(uses)
                    norms = _tied_squared_norms(uses, self.method)
                segments[p] = _Segment(norms, uses)
        with self._lock:
            for p, segment in segments.items():
                self._segments.setdefault(p, []).append(segment)

    # -- read side -------------------------------------------------------------------------------------

    def squared_norms(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        return {p: torch.cat([s.norms for s in self._segments[p]]) for p in params if self._segments.get(p)}

    def clipped_sums(self, params, factors):
        out = {}
        with torch.no_grad():
            for p in params:
                segments = self._segments.get(p)
                if p not in factors or not segments:
                    continue
                sizes = [s.norms.shape[0] for s in segments]
                c = factors[p]
                if c.shape != (sum(sizes),):
                    raise ValueError(
                        f"fxdp: clip factors of shape {tuple(c.shape)} for a parameter of shape {tuple(p.shape)} "
                        f"with {sum(sizes)} per-sample rows; pass one factor per sample"
                    )
                total = None
                for segment, c_seg in zip(segments, c.split(sizes)):
                    for use in segment.uses:
                        part = use.clipped_sum(c_seg)
                        total = part if total is None else total + part
                out[p] = total.reshape(p.shape)
        return out

    def clear(self, params: Iterable[nn.Parameter]) -> None:
        with self._lock:
            for p in params:
                self._segments.pop(p, None)

    def grad_samples(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        """Materialise ``(N, *p.shape)`` per-sample gradients (debugging, checks; never on the fast path)."""
        out = {}
        with torch.no_grad():
            for p in params:
                segments = self._segments.get(p)
                if segments:
                    out[p] = torch.cat([sum(u.grad_samples() for u in s.uses) for s in segments]).reshape(-1, *p.shape)
        return out
