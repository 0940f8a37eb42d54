"""Reference per-sample gradients for whole models: one backward over the batch vs. batches of one.

Sample i's loss is ``(out_i * R).sum()`` with a fixed random R; the batch loss is the sum or the mean
of the samples' losses. ``p.grad_sample[i]`` must equal the gradient of sample i's loss when sample i
is run alone, as a batch of one (fxdp's own definition, :func:`fxdp.engines.selfcheck.batch_of_one_gradients`,
which the engines' self-check and fxdp.checker compare with too).
"""

from __future__ import annotations

import copy

import torch

import fxdp
from fxdp.engines.selfcheck import batch_of_one_gradients


def _take(x, i, dim, n):
    """Sample i of a batched input; inputs without the batch (position ids (1, T), masks) stay whole."""
    batched = isinstance(x, torch.Tensor) and x.dim() > dim and x.shape[dim] == n
    return x.narrow(dim, i, 1) if batched else x


def expected_grad_samples(model, inputs, batch_dim=0, out_dim=None, seed=0):
    """{name: (N, *shape)} per-sample gradients of ``model`` by brute force, and R."""
    out_dim = batch_dim if out_dim is None else out_dim
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    n = inputs[0].shape[batch_dim]
    with torch.no_grad():
        sample_out = model(*(_take(x, 0, batch_dim, n) for x in inputs))
    R = torch.randn(sample_out.shape, generator=torch.Generator().manual_seed(seed), dtype=sample_out.dtype)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    alone = batch_of_one_gradients(lambda i: (model(*(_take(x, i, batch_dim, n) for x in inputs)) * R).sum(), named, n)
    return {k: torch.zeros((n, *p.shape), dtype=p.dtype, device=p.device) if alone[k] is None else alone[k]
            for k, p in named}, R


def batch_loss(out, R, reduction, out_dim=0):
    loss = (out * R).sum()
    return loss / out.shape[out_dim] if reduction == "mean" else loss


def assert_grad_samples_match(model, inputs, *, loss_reduction="mean", batch_dim=0, out_dim=None,
                              example_inputs=True, mode="fx", atol=1e-5, rtol=1e-4):
    """Compile a copy of ``model`` and check every trainable parameter's grad_sample against the loop."""
    out_dim = batch_dim if out_dim is None else out_dim
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    model = copy.deepcopy(model)
    expected, R = expected_grad_samples(model, inputs, batch_dim, out_dim)
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs if example_inputs else None,
                                   batch_dim=batch_dim, loss_reduction=loss_reduction, grad_sample_mode=mode)
    batch_loss(compiled(*inputs), R, loss_reduction, out_dim).backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert getattr(p, "grad_sample", None) is None, f"frozen {name} got a grad_sample"
            continue
        assert getattr(p, "grad_sample", None) is not None, f"{name} has no grad_sample"
        torch.testing.assert_close(p.grad_sample, expected[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    return compiled
