"""The plan of a stock recurrent layer: each of its projections is a Linear layer on a sequence of T steps
(:mod:`fxdp.grad_sample.recurrent`), planned as such from static shapes."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torch import nn

from fxdp.grad_sample.recurrent import projections


def plan_recurrent(module: nn.Module, input_shape: Sequence[int], prefer,
                   plan_layer) -> Tuple[str, str, Optional[int], Optional[int]]:
    """``(method, reason, ghost cost, per-sample cost)`` of an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` whose
    batch-first input has ``input_shape`` ``(N, T, d)``, each projection planned by ``plan_layer`` as a Linear
    layer: the method is the projections' (``ghost`` or ``per_sample``; ``mixed`` when they differ), the reason
    lists each projection's choice, the costs are their sums (per direction)."""
    if len(input_shape) != 3:
        return "materialise", f"input {tuple(input_shape)} is not a batch of sequences (N, T, d)", None, None
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
    return method, reason, ghost, per_sample
