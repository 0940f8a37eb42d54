"""Book-keeping of stock recurrent layers (``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``): backward delivers one capture
per projection (:mod:`fxdp.runtime.recurrent`), each a Linear layer on a sequence of T steps
(:class:`~fxdp.grad_sample.recurrent.RecurrentProjection`), book-kept as one. A layer and direction's two
projections get one tensor of gate gradients as G (LSTM, RNN): they form its Gram matrix once for both
(:mod:`~fxdp.sinks.bookkeeping.shared`), not each as it is delivered. The recurrent layer itself is planned, for
the report, as its projections."""

from __future__ import annotations

from typing import List

from fxdp.grad_sample.recurrent import projections, recurrent_rule_applies
from fxdp.sinks.bookkeeping.linear import LinearBookkeeping
from fxdp.sinks.bookkeeping.plans import plan_layer
from fxdp.sinks.bookkeeping.registry import LayerBookkeeping, LayerPlan


class RecurrentProjectionBookkeeping(LinearBookkeeping):
    gram_on_delivery = False  # the two projections' one G: its Gram is formed once for both (shared_ghost_norms)


class RecurrentLayerBookkeeping(LayerBookkeeping):
    def applies(self, module):
        return recurrent_rule_applies(module)

    def plan(self, module, a, g, prefer):
        """The method of the projections (``ghost`` or ``per_sample``; ``mixed`` when they differ) of a layer
        whose batch-first input is ``(N, T, d)``, each planned as a Linear layer; the reason lists each
        projection's choice, the costs are their sums (per direction)."""
        name = type(module).__name__
        if len(a) != 3:
            return LayerPlan(name, "materialise", f"input {tuple(a)} is not a batch of sequences (N, T, d)")
        n, t = a[0], a[1]
        parts: List[str] = []
        methods, ghost, per_sample = set(), 0, 0
        for layer in range(module.num_layers):
            for view in projections(module, f"_l{layer}"):
                plan = plan_layer(view, [(n, t, view.in_features)], (n, t, view.out_features), prefer)
                methods.add(plan.method)
                ghost += plan.ghost_cost or 0
                per_sample += plan.per_sample_cost or 0
                both = " (and _reverse)" if module.bidirectional else ""
                parts.append(f"{view.name}{both} {plan.method} (d={view.in_features}, p={view.out_features}: ghost "
                             f"{plan.ghost_cost or 0:,} vs per-sample {plan.per_sample_cost or 0:,})")
        method = methods.pop() if len(methods) == 1 else "mixed"
        reason = f"projections over T={t} steps as Linear layers on sequences: " + "; ".join(parts)
        return LayerPlan(name, method, reason, ghost, per_sample)
