"""The parameters after each of a few private steps, for the tests comparing compiled steps with eager ones; the
noise of steps on zero gradients, for the tests of noise mechanisms."""

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


def noise_of_zero_gradient_steps(model, optimizer, loader) -> torch.Tensor:
    """One private step per batch of ``loader`` on a loss of zero gradient: each step's ``p.grad`` is its noise
    alone. Returns the noise of every step, a row each (the parameters' noise flattened, in order)."""
    noise = []
    for x, _ in loader:
        optimizer.zero_grad()
        (0.0 * model(x).sum()).backward()  # zero gradients: p.grad is the noise
        optimizer.step()
        noise.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(noise)
