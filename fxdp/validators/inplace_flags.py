"""In-place flags on modules (``nn.ReLU(inplace=True)``, ``nn.Dropout(inplace=True)``, ...).

An in-place activation overwrites its input, which per-sample gradient hooks still need, so
``ModuleValidator.fix`` always turns the flag off. It is a per-instance flag, not a module type, so
this is not a registered fixer: a user's fixer for their own type would otherwise shadow it.
"""

from __future__ import annotations

from typing import List

from torch import nn

from fxdp.passes.inplace import has_inplace_flag  # the inplace pass swaps such modules in a graph


def disable_inplace_flags(model: nn.Module) -> List[str]:
    """Turn ``inplace`` off on ``model`` and its submodules (in place); returns the modules changed."""
    changed = []
    for name, module in model.named_modules():
        if has_inplace_flag(module):
            module.inplace = False
            changed.append(name)
    return changed
