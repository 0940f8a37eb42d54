"""Test helpers: per-sample gradients from a rule vs. from a loop over batches of one.

The loss is ``sum_i (out_i * R).sum()`` ("sum") or its mean over samples ("mean"), with ``R`` a fixed
random tensor shaped like one sample's output. The reference for sample ``i`` is the gradient of
``(out(sample i as a batch of one) * R).sum()``, whichever reduction the batch used.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from fxdp.engines.selfcheck import batch_of_one_gradients
from fxdp.grad_sample import compute_grad_samples


def trainable(module: nn.Module) -> List[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def fixed_cotangent(output: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """R: one sample's output shape with a leading 1, so it broadcasts over the batch."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((1, *output.shape[1:]), generator=gen, dtype=output.dtype)


def loop_grad_samples(
    params: Sequence[torch.Tensor], sample_output: Callable[[int], torch.Tensor], n: int, R: torch.Tensor
) -> List[torch.Tensor]:
    """Per-sample gradients by brute force: ``sample_output(i)`` runs sample i as a batch of one."""
    named = [(str(k), p) for k, p in enumerate(params)]
    alone = batch_of_one_gradients(lambda i: (sample_output(i) * R).sum(), named, n)
    return [torch.zeros((n, *p.shape), dtype=p.dtype, device=p.device) if alone[k] is None else alone[k]
            for k, p in named]


def loss_backprops(output: torch.Tensor, R: torch.Tensor, loss_reduction: str) -> torch.Tensor:
    """dL/d(output); detached first, so it also works for an output without a graph (a frozen layer)."""
    output = output.detach().requires_grad_()
    loss = (output * R).sum()
    if loss_reduction == "mean":
        loss = loss / output.shape[0]
    (backprops,) = torch.autograd.grad(loss, output)
    return backprops


def rule_grad_samples(
    module: nn.Module,
    activations: List[torch.Tensor],
    loss_reduction: str,
    *,
    forward: Optional[Callable[[], torch.Tensor]] = None,
    seed: int = 0,
) -> tuple:
    """(rule's {param: grad_sample}, R): runs the batch, backprops the loss, applies the rule."""
    output = forward() if forward is not None else module(*activations)
    R = fixed_cotangent(output, seed)
    backprops = loss_backprops(output, R, loss_reduction)
    grad_samples = compute_grad_samples(
        module, activations, backprops, loss_reduction=loss_reduction, batch_size=output.shape[0]
    )
    return grad_samples, R


def assert_rule_matches_loop(
    module: nn.Module,
    activations: List[torch.Tensor],
    loss_reduction: str,
    *,
    forward: Optional[Callable[[], torch.Tensor]] = None,
    sample_output: Optional[Callable[[int], torch.Tensor]] = None,
    atol: float = 1e-9,
    rtol: float = 1e-7,
) -> Dict[nn.Parameter, torch.Tensor]:
    """The rule's per-sample gradients equal the loop's, for exactly the trainable parameters.

    By default sample i is ``module(*(a[i:i+1] for a in activations))``; pass ``forward`` /
    ``sample_output`` for modules whose samples are not rows of the activations (EmbeddingBag bags).
    """
    grad_samples, R = rule_grad_samples(module, activations, loss_reduction, forward=forward)
    if sample_output is None:

        def sample_output(i: int) -> torch.Tensor:
            return module(*(a[i : i + 1] for a in activations))

    params = trainable(module)
    assert {id(p) for p in grad_samples} == {id(p) for p in params}, "rule must cover exactly the trainable params"
    n = next(iter(grad_samples.values())).shape[0] if grad_samples else 0
    expected = loop_grad_samples(params, sample_output, n, R) if params else []
    for p, want in zip(params, expected):
        got = grad_samples[p]
        assert got.shape == (n, *p.shape)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return grad_samples
