"""BatchNorm: in training it normalises each sample with the whole batch's statistics.

Samples then influence each other's outputs, so no per-sample gradient bounds one sample's influence:
it cannot be made private. The fix replaces it with a norm that normalises each sample on its own,
keeping the affine parameters, chosen by what the layer normalises:

- over positions (``(N, C, L)``, ``(N, C, H, W)``, ...): ``GroupNorm(gcd(32, C), C)``;
- over features (``(N, C)``): ``LayerNorm(C)``. GroupNorm with one channel per group would normalise
  single values: its output would be its bias whatever the input. Without example inputs a
  ``BatchNorm1d`` may see either shape, so it becomes ``GroupNorm(1, C)``, right for both;
- one value per sample (``(N, 1)``): no per-sample normalisation depends on it; refused.

``fix(model, replace_bn_with_in=True)`` asks for ``InstanceNorm1d/2d/3d`` instead (by the BatchNorm's
type), keeping the affine parameters and without running statistics; refused where each channel of a
sample holds one value (``(N, C)`` features, ``(N, C, 1, 1)``), where its output would be its bias.

Without example inputs a ``BatchNorm2d``/``3d`` is taken to see more than one position per channel
(a ``(N, C, 1, 1)`` input after global pooling is only recognised with example inputs).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter

from fxdp.diagnostics import BatchNormModuleError, UnsupportedError
from fxdp.grad_sample.mixing import BATCH_NORM_FIX, batch_norm_mixing_message, uses_batch_statistics  # noqa: F401
from fxdp.validators.module_validator import register_module_fixer, register_module_validator


@register_module_validator(_BatchNorm)
def validate_batch_norm(module: _BatchNorm, **kwargs) -> List[UnsupportedError]:
    if not uses_batch_statistics(module):
        return []
    # the rule (which BatchNorm mixes samples, and what to do) lives in fxdp.grad_sample.mixing: the
    # per-sample engines, which refuse such a model when they are built, read it there too
    return [BatchNormModuleError(batch_norm_mixing_message(module), fix=BATCH_NORM_FIX)]


def default_num_groups(num_channels: int) -> int:
    return math.gcd(32, num_channels)


def _check_groups(num_groups: int, num_channels: int) -> None:
    if num_groups <= 0 or num_channels % num_groups != 0:
        raise ValueError(
            f"GroupNorm needs num_groups to divide the number of channels: num_groups={num_groups}, "
            f"channels={num_channels}; pass num_groups=... to ModuleValidator.fix, a divisor of {num_channels}"
        )


# BatchNorm types whose input always has positions after the channels (their forward checks the rank).
_ALWAYS_SPATIAL = (nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)

ONE_VALUE_ADVICE = (
    "normalising a single value outputs the layer's bias whatever the input. Remove the layer, or register "
    "a fixer of your own (fxdp.validators.register_module_fixer)"
)


def values_per_channel(module: _BatchNorm, input_shapes: Optional[Sequence[Tuple[int, ...]]]) -> Optional[int]:
    """How many values of one channel of one sample the layer normalises over (the fewest, if it is
    called on several shapes); None when unknown (a layer that may see (N, C) features or more)."""
    if input_shapes:
        return min(math.prod(shape[2:]) for shape in input_shapes)
    return None if not isinstance(module, _ALWAYS_SPATIAL) else 2  # 2: "more than one", by its type


@register_module_fixer(_BatchNorm)
def replace_batch_norm(module: _BatchNorm, *, num_groups: Optional[int] = None,
                       input_shapes: Optional[Sequence[Tuple[int, ...]]] = None, replace_bn_with_in: bool = False,
                       **kwargs) -> nn.Module:
    """A per-sample norm with the BatchNorm's channels, eps and affine parameters (copied).

    ``input_shapes``: the shapes the layer's input had in the example forward of
    ``ModuleValidator.fix(model, example_inputs=...)`` (None without example inputs).
    ``replace_bn_with_in``: an InstanceNorm instead (not with ``num_groups``).
    """
    if replace_bn_with_in:
        if num_groups is not None:
            raise ValueError(f"replace_bn_with_in=True and num_groups={num_groups} ask for two different "
                             "replacements (InstanceNorm, GroupNorm); pass one of them")
        return _instance_norm(module, input_shapes)
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return LazyGroupNorm(num_groups, eps=module.eps, affine=module.affine)
    channels = module.num_features
    per_channel = values_per_channel(module, input_shapes)
    if per_channel is not None and per_channel > 1:  # normalises over positions
        groups = default_num_groups(channels) if num_groups is None else num_groups
        _check_groups(groups, channels)
        return _copy_affine(module, nn.GroupNorm(groups, channels, eps=module.eps, affine=module.affine,
                                                 **_factory(module)))
    # over features (or maybe: per_channel is None), so each group needs several channels
    known = per_channel is not None
    if channels == 1:
        if known:
            raise ValueError(f"its input {_shapes(input_shapes)} has one value per sample; {ONE_VALUE_ADVICE}")
        raise ValueError(
            "over (N, 1) inputs it has one value per sample, and no per-sample normalisation depends on it; "
            "over (N, 1, L) inputs GroupNorm(1, 1) replaces it. Pass example_inputs=... to "
            "ModuleValidator.fix so it can see which")
    if num_groups is not None:
        _check_groups(num_groups, channels)
        if channels // num_groups < 2:
            where = f"its input {_shapes(input_shapes)} has" if known else "over (N, C) inputs it would have"
            raise ValueError(
                f"num_groups={num_groups} leaves one channel per group, and {where} no positions: each group "
                f"would normalise a single value and output its bias whatever the input. Use fewer groups "
                f"(a divisor of {channels} below {channels})"
                + ("" if known else ", or pass example_inputs=... if the layer sees (N, C, L) inputs"))
        norm = nn.GroupNorm(num_groups, channels, eps=module.eps, affine=module.affine, **_factory(module))
    elif known and all(len(shape) == 2 for shape in input_shapes):
        norm = nn.LayerNorm(channels, eps=module.eps, elementwise_affine=module.affine, **_factory(module))
    else:
        norm = nn.GroupNorm(1, channels, eps=module.eps, affine=module.affine, **_factory(module))
    return _copy_affine(module, norm)


_INSTANCE_NORM_FOR = {
    nn.BatchNorm1d: nn.InstanceNorm1d, nn.BatchNorm2d: nn.InstanceNorm2d, nn.BatchNorm3d: nn.InstanceNorm3d,
    nn.LazyBatchNorm1d: nn.LazyInstanceNorm1d, nn.LazyBatchNorm2d: nn.LazyInstanceNorm2d,
    nn.LazyBatchNorm3d: nn.LazyInstanceNorm3d,
}


def _instance_norm(module: _BatchNorm, input_shapes) -> nn.Module:
    """``InstanceNorm{1,2,3}d`` for a ``BatchNorm{1,2,3}d``: each channel of each sample normalised over
    its positions, the affine parameters copied, no running statistics."""
    kind = next((v for k, v in _INSTANCE_NORM_FOR.items() if isinstance(module, k)), None)
    if kind is None:
        raise ValueError(f"replace_bn_with_in=True: no InstanceNorm matches {type(module).__name__}, whose "
                         "number of spatial dims its type does not fix; leave replace_bn_with_in out for GroupNorm")
    per_channel = values_per_channel(module, input_shapes) if input_shapes else None
    if per_channel == 1:
        raise ValueError(f"replace_bn_with_in=True: its input {_shapes(input_shapes)} has one value per channel "
                         f"and sample, and InstanceNorm normalises each over its positions: {ONE_VALUE_ADVICE}; "
                         "or leave replace_bn_with_in out (LayerNorm or GroupNorm)")
    options = dict(eps=module.eps, affine=module.affine, track_running_stats=False)
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return kind(**options)
    return _copy_affine(module, kind(module.num_features, **options, **_factory(module)))


def _shapes(input_shapes) -> str:
    return " and ".join(str(tuple(s)) for s in dict.fromkeys(tuple(s) for s in input_shapes))


def _factory(module: _BatchNorm) -> dict:
    ref = module.weight if module.affine else module.running_mean
    return {} if ref is None else {"device": ref.device, "dtype": ref.dtype}


def _copy_affine(module: _BatchNorm, norm: nn.Module) -> nn.Module:
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
        per_channel = math.prod(input.shape[2:])
        groups = self.requested_groups
        if groups is None:  # over features (N, C): one group, as LayerNorm(C)
            groups = default_num_groups(channels) if per_channel > 1 else 1
        _check_groups(groups, channels)
        if per_channel * (channels // groups) == 1:
            raise ValueError(
                f"LazyGroupNorm (what ModuleValidator.fix made of a LazyBatchNorm) got input of shape "
                f"{tuple(input.shape)} and {groups} group(s): each group would hold one value per sample, and "
                f"{ONE_VALUE_ADVICE}")
        self.num_channels, self.num_groups = channels, groups
        if self.affine:
            with torch.no_grad():
                self.weight.materialize((channels,), device=input.device, dtype=input.dtype)
                self.bias.materialize((channels,), device=input.device, dtype=input.dtype)
        self.reset_parameters()
