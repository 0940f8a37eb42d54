"""Per-sample gradients of ``nn.Linear`` (and its subclasses), for inputs of any rank ``(N, *, in)``.

For sample ``n`` the weight gradient is ``sum_t g[n, t]^T a[n, t]`` over all middle positions ``t``:
one batched matrix product once the middle dimensions are flattened.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from fxdp.grad_sample.registry import register_grad_sampler


@register_grad_sampler(nn.Linear)
def linear_grad_sample(
    module: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    x = activations[0]
    n = x.shape[0]
    ret: Dict[nn.Parameter, torch.Tensor] = {}
    if module.weight.requires_grad:
        if x.dim() == 2:
            ret[module.weight] = backprops.unsqueeze(2) * x.unsqueeze(1)
        else:
            a = x.reshape(n, -1, x.shape[-1])
            g = backprops.reshape(n, -1, backprops.shape[-1])
            ret[module.weight] = torch.bmm(g.transpose(1, 2), a)
    if module.bias is not None and module.bias.requires_grad:
        ret[module.bias] = backprops.reshape(n, -1, backprops.shape[-1]).sum(1)
    return ret
