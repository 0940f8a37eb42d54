"""InstanceNorm with running statistics: the buffers average every sample of every batch.

The normalisation itself is per sample, but the running mean and variance are released with the
model without noise, so they leak the training data. The fix stops tracking them.
"""

from __future__ import annotations

from typing import List

from torch import nn
from torch.nn.modules.instancenorm import _InstanceNorm

from fxdp.diagnostics import IllegalModuleConfigurationError, UnsupportedError
from fxdp.validators.module_validator import register_module_fixer, register_module_validator


@register_module_validator(_InstanceNorm)
def validate_instance_norm(module: _InstanceNorm, **kwargs) -> List[UnsupportedError]:
    if not module.track_running_stats:
        return []
    return [
        IllegalModuleConfigurationError(
            f"{type(module).__name__} tracks running statistics: its running_mean/running_var buffers "
            f"average the training samples and would be released without noise.",
            fix="build it with track_running_stats=False, or run "
            "`model = fxdp.validators.ModuleValidator.fix(model)`.",
        )
    ]


@register_module_fixer(_InstanceNorm)
def stop_tracking_running_stats(module: _InstanceNorm, **kwargs) -> nn.Module:
    """The same module, with ``track_running_stats=False`` and no running buffers (as if built so)."""
    module.track_running_stats = False
    # None, not deleted: forward reads self.running_mean, as for a module built without them.
    module.running_mean = None
    module.running_var = None
    module.num_batches_tracked = None
    return module
