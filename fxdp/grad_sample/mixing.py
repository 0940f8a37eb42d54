"""Layers that mix samples in the mode they are in: no per-sample gradient exists for a model that holds one.

BatchNorm normalises each sample with statistics of the whole batch when it is in training mode (or in eval
mode without running statistics), so each sample's output, and every gradient after it, depends on the other
samples. This is the one place that says so: :mod:`fxdp.validators.batch_norm` (``ModuleValidator``, the
compiler's validate pass) and the per-sample engines, which refuse such a model when they are built
(:func:`fxdp.engines.base.refuse_sample_mixing_modules`), both read it. It lives here, below the validators,
because the engines may not import the validators (which use the compiler's passes).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

BATCH_NORM_FIX = (
    "replace it with GroupNorm: `model = fxdp.validators.ModuleValidator.fix(model)` does it for every "
    "BatchNorm (num_groups=... to choose the groups); or keep it frozen, in eval mode with running "
    "statistics from public data."
)


def uses_batch_statistics(module: _BatchNorm) -> bool:
    """Whether the forward normalises with the current batch's statistics (as ``_BatchNorm.forward``)."""
    return module.training or (module.running_mean is None and module.running_var is None)


def batch_norm_mixing_message(module: _BatchNorm) -> str:
    return (f"{type(module).__name__} normalises each sample with statistics of the whole batch, so samples "
            "influence each other and their gradients cannot be bounded one by one.")


def why_it_mixes_samples(module: nn.Module) -> Optional[Tuple[str, str]]:
    """``(what is wrong, how to fix it)`` when ``module`` itself (not its children) mixes samples in the mode
    it is in now; None otherwise."""
    if isinstance(module, _BatchNorm) and uses_batch_statistics(module):
        return batch_norm_mixing_message(module), BATCH_NORM_FIX
    return None


def sample_mixing_modules(model: nn.Module) -> List[Tuple[str, nn.Module, str, str]]:
    """Every submodule of ``model`` (itself included) that mixes samples now, as
    ``(qualified name, module, what is wrong, how to fix it)``; the root is named ``""``."""
    found = []
    for name, module in model.named_modules():
        why = why_it_mixes_samples(module)
        if why is not None:
            found.append((name, module, *why))
    return found
