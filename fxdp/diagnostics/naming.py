"""How reports and errors name an op or a layer: the ``op`` column of every finding.

``operator.iadd``, ``torch.relu_``, ``F.relu``, ``Tensor.add_``, ``torch.special.erf``, ``nn.BatchNorm2d``;
a user's own function or layer by its bare name. For the functions the inplace pass emits, the name is
also a valid expression in a compiled model's code (``torch.relu``, ``F.gelu``, ``operator.add``).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn


def op_name(op) -> str:
    """The name of a function, Tensor method (given by name), module or module type."""
    if op is None:
        return "?"
    if isinstance(op, nn.Module):
        op = type(op)
    if isinstance(op, type):
        return f"nn.{op.__name__}" if op.__module__.startswith("torch.nn") else op.__name__
    if isinstance(op, str):  # a call_method target or a call_module path
        return op
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(op)  # an ATen op of a graph torch.export captured: aten.view.default
    name = getattr(op, "__name__", None) or repr(op)
    if getattr(operator, name, None) is op:
        return f"operator.{name}"
    if name.startswith("_") and getattr(F, name[1:], None) is op:  # F.threshold is F._threshold
        return f"F.{name[1:]}"
    if getattr(torch, name, None) is op:
        return f"torch.{name}"
    if getattr(F, name, None) is op:
        return f"F.{name}"
    if getattr(torch.Tensor, name, None) is op:
        return f"Tensor.{name}"
    module = getattr(op, "__module__", None) or ""
    if module.startswith("torch.nn.functional") or module == "torch._C._nn":
        return f"F.{name}"
    if module.startswith("torch._C._"):  # torch._C._special.special_erf -> torch.special.erf
        sub = module[len("torch._C._"):]
        return f"torch.{sub}.{name[len(sub) + 1:] if name.startswith(sub + '_') else name}"
    if module == "torch" or module.startswith("torch."):  # not torchvision
        return f"torch.{name}"
    return name
