"""Per-sample gradients of ``nn.Linear`` (and its subclasses), for inputs of any rank ``(N, *, in)``,
and of Hugging Face transformers' ``Conv1D`` (GPT-2's projections: a Linear layer whose weight is stored
transposed, ``(in, out)``), registered by class path so that fxdp never imports transformers.

For sample ``n`` the weight gradient is ``sum_t g[n, t]^T a[n, t]`` over all middle positions ``t``:
one batched matrix product once the middle dimensions are flattened (``a^T g`` for ``Conv1D``).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from fxdp.grad_sample.registry import find_grad_sampler


def _matmul_grad_samples(module: nn.Module, x: torch.Tensor, backprops: torch.Tensor,
                         weight_in_out: bool) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``x @ W^T + b`` (``W`` stored ``(out, in)``), or of ``x @ W + b`` when
    ``weight_in_out`` (``W`` stored ``(in, out)``)."""
    n = x.shape[0]
    ret: Dict[nn.Parameter, torch.Tensor] = {}
    if module.weight.requires_grad:
        if x.dim() == 2 and not weight_in_out:
            ret[module.weight] = backprops.unsqueeze(2) * x.unsqueeze(1)
        else:
            a = x.reshape(n, -1, x.shape[-1])
            g = backprops.reshape(n, -1, backprops.shape[-1])
            ret[module.weight] = torch.bmm(a.transpose(1, 2), g) if weight_in_out else torch.bmm(g.transpose(1, 2), a)
    if module.bias is not None and module.bias.requires_grad:
        ret[module.bias] = backprops.reshape(n, -1, backprops.shape[-1]).sum(1)
    return ret


def linear_grad_sample(
    module: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    return _matmul_grad_samples(module, activations[0], backprops, weight_in_out=False)


def transformers_conv1d_grad_sample(
    module: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """transformers' ``Conv1D``: ``x @ weight + bias`` with ``weight`` of shape ``(in, out)``."""
    return _matmul_grad_samples(module, activations[0], backprops, weight_in_out=True)


def is_transformers_conv1d(module) -> bool:
    """A transformers ``Conv1D`` served by :func:`transformers_conv1d_grad_sample` (its own forward, no other
    rule registered for its type), with the weight ``(in, out)`` and bias ``(out,)`` its forward uses."""
    return (isinstance(module, nn.Module) and find_grad_sampler(module) is transformers_conv1d_grad_sample
            and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2
            and isinstance(getattr(module, "bias", None), torch.Tensor)
            and tuple(module.bias.shape) == (module.weight.shape[1],))
