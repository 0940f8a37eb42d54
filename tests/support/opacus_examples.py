"""What tests/opacus_compat/test_opacus_examples*.py share: independent ε, and the DP-SGD update a step must
make, computed from each sample run alone.

Nothing here imports Opacus's code paths that fxdp replaces: ε comes from Opacus's RDP analysis functions or
from ``dp_accounting``'s PLD, called directly on the (σ, q, steps) history, and the expected update from
batches of one of a plain copy of the model.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn


def independent_epsilon(history: Sequence[Tuple[float, float, int]], delta: float, accountant: str) -> float:
    """ε of a history of (noise multiplier, sample rate, steps), computed without fxdp."""
    if accountant == "rdp":
        from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
        from opacus.accountants.rdp import RDPAccountant as OpacusRDP
        orders = OpacusRDP.DEFAULT_ALPHAS
        rdp = sum(compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
                  for sigma, q, steps in history)
        return float(get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0])
    if accountant in ("pld", "prv"):
        import dp_accounting
        pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        for sigma, q, steps in history:
            pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        return float(pld.get_epsilon(delta))
    raise ValueError(accountant)


def collapse(history) -> List[Tuple[float, float, int]]:
    """An accountant's history with equal consecutive entries merged, to compare with the steps taken."""
    merged: List[List] = []
    for sigma, q, steps in history:
        if merged and merged[-1][:2] == [sigma, q]:
            merged[-1][2] += steps
        else:
            merged.append([sigma, q, steps])
    return [tuple(entry) for entry in merged]


def clipped_mean_update(model: nn.Module, loss_of_sample: Callable[[nn.Module, int], torch.Tensor], n: int,
                        max_grad_norm: float, expected_batch_size: float) -> Dict[str, torch.Tensor]:
    """Σᵢ clip(∇ lossᵢ) / expected_batch_size for each trainable parameter of ``model`` (by name), each sample
    run alone through a copy of the model: what DP-SGD adds to -p / lr for a noise-free plain-SGD step with
    flat clipping (per-sample norm over all parameters) and a mean loss."""
    model = copy.deepcopy(model)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    total = {k: torch.zeros_like(p) for k, p in named}
    for i in range(n):
        grads = torch.autograd.grad(loss_of_sample(model, i), [p for _, p in named], allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, named)]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        factor = min(1.0, max_grad_norm / (float(norm) + 1e-6))
        for (k, _), g in zip(named, grads):
            total[k] += factor * g
    return {k: v / expected_batch_size for k, v in total.items()}
