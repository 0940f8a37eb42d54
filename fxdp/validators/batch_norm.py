"""BatchNorm: in training it normalises each sample with the whole batch's statistics.

Samples then influence each other's outputs, so no per-sample gradient bounds one sample's influence:
it cannot be made private. The fix replaces it with GroupNorm, which normalises each sample on its
own (over groups of channels), keeping the affine parameters.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter

from fxdp.diagnostics import UnsupportedError, UnsupportedModuleError
from fxdp.validators.module_validator import register_module_fixer, register_module_validator

BATCH_NORM_FIX = (
    "replace it with GroupNorm: `model = fxdp.validators.ModuleValidator.fix(model)` does it for every "
    "BatchNorm (num_groups=... to choose the groups); or keep it frozen, in eval mode with running "
    "statistics from public data."
)


def uses_batch_statistics(module: _BatchNorm) -> bool:
    """Whether the forward normalises with the current batch's statistics (as ``_BatchNorm.forward``)."""
    return module.training or (module.running_mean is None and module.running_var is None)


@register_module_validator(_BatchNorm)
def validate_batch_norm(module: _BatchNorm, **kwargs) -> List[UnsupportedError]:
    if not uses_batch_statistics(module):
        return []
    return [
        UnsupportedModuleError(
            f"{type(module).__name__} normalises each sample with statistics of the whole batch, so "
            f"samples influence each other and their gradients cannot be bounded one by one.",
            fix=BATCH_NORM_FIX,
        )
    ]


def default_num_groups(num_channels: int) -> int:
    return math.gcd(32, num_channels)


def _check_groups(num_groups: int, num_channels: int) -> None:
    if num_groups <= 0 or num_channels % num_groups != 0:
        raise ValueError(
            f"GroupNorm needs num_groups to divide the number of channels: num_groups={num_groups}, "
            f"channels={num_channels}; pass num_groups=... to ModuleValidator.fix, a divisor of {num_channels}"
        )


@register_module_fixer(_BatchNorm)
def replace_batch_norm(module: _BatchNorm, *, num_groups: Optional[int] = None, **kwargs) -> nn.Module:
    """GroupNorm with the BatchNorm's channels, eps and affine parameters (copied)."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return LazyGroupNorm(num_groups, eps=module.eps, affine=module.affine)
    channels = module.num_features
    groups = default_num_groups(channels) if num_groups is None else num_groups
    _check_groups(groups, channels)
    ref = module.weight if module.affine else module.running_mean
    factory = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
    norm = nn.GroupNorm(groups, channels, eps=module.eps, affine=module.affine, **factory)
    if module.affine:
        with torch.no_grad():
            norm.weight.copy_(module.weight)
            norm.bias.copy_(module.bias)
        norm.weight.requires_grad_(module.weight.requires_grad)
        norm.bias.requires_grad_(module.bias.requires_grad)
    norm.train(module.training)
    return norm


class LazyGroupNorm(LazyModuleMixin, nn.GroupNorm):
    """GroupNorm whose channel count comes from the first input; it then becomes an ``nn.GroupNorm``.

    What an uninitialised ``nn.LazyBatchNorm*d`` is replaced with.
    """

    cls_to_become = nn.GroupNorm

    def __init__(self, num_groups: Optional[int] = None, eps: float = 1e-5, affine: bool = True):
        super().__init__(1, 0, eps=eps, affine=False)
        self.affine = affine
        self.requested_groups = num_groups
        if affine:
            self.weight = UninitializedParameter()
            self.bias = UninitializedParameter()

    def reset_parameters(self) -> None:
        if self.num_channels and not self.has_uninitialized_params():
            super().reset_parameters()

    def initialize_parameters(self, input) -> None:
        if self.num_channels:
            return
        channels = input.shape[1]
        groups = default_num_groups(channels) if self.requested_groups is None else self.requested_groups
        _check_groups(groups, channels)
        self.num_channels, self.num_groups = channels, groups
        if self.affine:
            with torch.no_grad():
                self.weight.materialize((channels,), device=input.device, dtype=input.dtype)
                self.bias.materialize((channels,), device=input.device, dtype=input.dtype)
        self.reset_parameters()
