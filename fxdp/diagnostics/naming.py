"""How reports and errors name an op or a layer: the ``op`` column of every finding.

``operator.iadd``, ``torch.relu_``, ``F.relu``, ``Tensor.add_``, ``torch.special.erf``, ``nn.BatchNorm2d``;
a user's own function or layer by its bare name. For the functions the inplace pass emits, the name is
also a valid expression in a compiled model's code (``torch.relu``, ``F.gelu``, ``operator.add``).

The modules that register rules for ops may give an op its name first (:func:`name_op`): the batch rules
name a function that is both ``torch.x`` and ``F.x`` as they registered it, and the functions of a library
fxdp does not import by their public path (``torchvision.ops.stochastic_depth``).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

# op (a function, or the dotted path of one) -> the name given by the module that registered it
_GIVEN: Dict[Any, str] = {}


def name_op(op, name: str) -> None:
    """Findings call ``op`` (a function, or the dotted path ``module.qualname`` of a function of a library
    fxdp does not import) ``name``; the first name given wins."""
    try:
        _GIVEN.setdefault(op, name)
    except TypeError:  # an unhashable op keeps its derived name
        pass


def dotted_name(fn) -> str:
    """``module.qualname`` of a function (how a function of a library fxdp does not import is keyed)."""
    return f"{getattr(fn, '__module__', None) or ''}.{getattr(fn, '__qualname__', None) or ''}"


def _given_name(op) -> Optional[str]:
    try:
        given = _GIVEN.get(op)
    except TypeError:
        return None
    if given is None and callable(op) and _GIVEN:
        given = _GIVEN.get(dotted_name(op))
    return given


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
    given = _given_name(op)
    if given is not None:
        return given
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
