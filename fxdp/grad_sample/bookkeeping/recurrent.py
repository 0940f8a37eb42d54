"""The plan of a stock recurrent layer: each of its projections is a Linear layer on a sequence of T steps
(:mod:`fxdp.grad_sample.recurrent`), planned as such from static shapes."""

from __future__ import annotations

from typing import List, Sequence

from torch import nn

from fxdp.grad_sample.recurrent import projections


def plan_recurrent(module: nn.Module, input_shape: Sequence[int], prefer, plan_layer):
    """One plan for an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` whose batch-first input has ``input_shape``
    ``(N, T, d)``: its method is the projections' (``ghost`` or ``per_sample``; ``mixed`` when they differ),
    its reason lists each projection's choice, its costs are their sums (per direction)."""
    from fxdp.grad_sample.bookkeeping.plans import LayerPlan  # plans imports this module lazily

    name = type(module).__name__
    if len(input_shape) != 3:
        return LayerPlan(name, "materialise", f"input {tuple(input_shape)} is not a batch of sequences (N, T, d)")
    n, t = input_shape[0], input_shape[1]
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
