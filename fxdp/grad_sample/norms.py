"""Per-sample gradients of the normalisation layers with per-sample statistics.

Every rule recomputes the normalised input ``x_hat`` (the layer without its affine part) from the
activations, then: weight gradient = ``sum(g * x_hat)``, bias gradient = ``sum(g)``, summed over
every dimension that shares a parameter entry (the middle dimensions for LayerNorm / RMSNorm, the
spatial dimensions for GroupNorm / InstanceNorm).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


def _affine_grad_samples(
    weight: Optional[nn.Parameter],
    bias: Optional[nn.Parameter],
    x_hat: torch.Tensor,
    backprops: torch.Tensor,
    param_ndim: int,
    channels_first: bool,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Sum ``g * x_hat`` and ``g`` to each parameter's shape.

    ``channels_first``: the parameter indexes dim 1 (GroupNorm / InstanceNorm); otherwise it indexes
    the last ``param_ndim`` dims (LayerNorm / RMSNorm).
    """
    n = backprops.shape[0]

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if channels_first:
            return t.reshape(n, t.shape[1], -1).sum(-1)
        trailing = t.shape[t.dim() - param_ndim :]
        return t.reshape(n, -1, *trailing).sum(1)

    ret: Dict[nn.Parameter, torch.Tensor] = {}
    if weight is not None and weight.requires_grad:
        ret[weight] = reduce(backprops * x_hat)
    if bias is not None and bias.requires_grad:
        ret[bias] = reduce(backprops)
    return ret


def _needs_grad(*params: Optional[nn.Parameter]) -> bool:
    return any(p is not None and p.requires_grad for p in params)


def layer_norm_grad_sample(
    module: nn.LayerNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    if not _needs_grad(module.weight, module.bias):
        return {}
    x = activations[0].to(backprops.dtype)
    # with a unit weight and zero bias the result is the same to the bit, and torch's CPU kernel takes a
    # faster path than with none
    ones = torch.ones(module.normalized_shape, dtype=x.dtype, device=x.device)
    x_hat = F.layer_norm(x, module.normalized_shape, ones, torch.zeros_like(ones), eps=module.eps)
    return _affine_grad_samples(
        module.weight, module.bias, x_hat, backprops, len(module.normalized_shape), channels_first=False
    )


def rms_norm_grad_sample(
    module: nn.RMSNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    if not _needs_grad(module.weight):
        return {}
    x = activations[0].to(backprops.dtype)
    x_hat = F.rms_norm(x, module.normalized_shape, eps=module.eps)  # eps=None: finfo(dtype).eps
    return _affine_grad_samples(
        module.weight, None, x_hat, backprops, len(module.normalized_shape), channels_first=False
    )


def group_norm_grad_sample(
    module: nn.GroupNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    if not _needs_grad(module.weight, module.bias):
        return {}
    x = activations[0].to(backprops.dtype)
    x_hat = F.group_norm(x, module.num_groups, eps=module.eps)
    return _affine_grad_samples(module.weight, module.bias, x_hat, backprops, 1, channels_first=True)


_InstanceNorm = Union[nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d]


def instance_norm_grad_sample(
    module: _InstanceNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    if not _needs_grad(module.weight, module.bias):
        return {}
    x = activations[0].to(backprops.dtype)
    use_input_stats = module.training or not module.track_running_stats
    # with input statistics the running buffers are not passed: recomputing must not update them again
    x_hat = F.instance_norm(
        x,
        None if use_input_stats else module.running_mean,
        None if use_input_stats else module.running_var,
        use_input_stats=use_input_stats,
        eps=module.eps,
    )
    return _affine_grad_samples(module.weight, module.bias, x_hat, backprops, 1, channels_first=True)
