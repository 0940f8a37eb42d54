"""The parameters after each of a few private steps, for the tests comparing compiled steps with eager ones; the
noise of steps on zero gradients, for the tests of noise mechanisms; one noise-free step through a sink and its
reference from batches of one, for the tests of book-keeping registrations."""

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


def noise_free_private_step(model, x, R, sink, loss_reduction: str, clip: float) -> dict:
    """The per-sample squared norms ``sink`` gives (by parameter name) and the gradients of one DP-SGD step (noise
    off, lr 0, bound ``clip``) of ``model`` compiled with ``sink`` on ``x`` and the loss ``batch_loss(.., R)``."""
    import fxdp
    from fxdp.optim import DPOptimizer
    from tests.support.per_sample_reference import batch_loss

    dp = fxdp.compile_for_dp(model, example_inputs=x, loss_reduction=loss_reduction, sink=sink)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=clip,
                      expected_batch_size=len(x), loss_reduction=loss_reduction, sink=sink)
    opt.zero_grad()
    batch_loss(dp(x), R, loss_reduction).backward()
    names = dict(model.named_parameters())
    norms = sink.squared_norms(names.values())  # (of the summed loss's per-sample gradients, as batches of one)
    norms = {k: norms[p] for k, p in names.items() if p in norms}
    opt.step()
    return {"norms": norms, "grads": {k: p.grad.clone() for k, p in names.items()}, "dp": dp}


def clipped_reference(expected: dict, loss_reduction: str, n: int, clip: float) -> dict:
    """DP-SGD's clipped sum (flat clipping at ``clip``) from per-sample gradients of batches of one (``expected``:
    name -> (n, *shape)); asserts every sample is clipped, so that the comparison tests the clipping."""
    total = torch.stack([g.flatten(1).pow(2).sum(1) for g in expected.values()]).sum(0).sqrt()
    factors = (clip / (total + 1e-6)).clamp(max=1.0)
    assert bool((factors < 1).all()), "every sample must be clipped"
    scale = 1.0 / n if loss_reduction == "mean" else 1.0
    return {k: torch.tensordot(factors, g, dims=1) * scale for k, g in expected.items()}
