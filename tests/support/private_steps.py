"""The parameters after each of a few private steps, for the tests comparing compiled steps with eager ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def parameters_after_steps(run, optimizer, loader, model, steps: int, seed: int = 2):
    """``steps`` private steps of cross-entropy on ``run(x)`` over the loader's Poisson batches (drawn after
    ``torch.manual_seed(seed)``); the model's parameters after each."""
    after = []
    torch.manual_seed(seed)  # the Poisson batches
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        F.cross_entropy(run(x), y).backward()
        optimizer.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after
