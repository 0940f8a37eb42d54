"""The one registry of per-sample gradient rules ("grad samplers").

A rule has the signature ``(module, activations, backprops) -> {param: grad_sample}``:

- ``activations``: list of the module's tensor inputs, batch first (``activations[0]`` is the input);
- ``backprops``: gradient of the loss w.r.t. the module's output, batch first, **for a summed loss**
  (the callers undo the ``1/N`` of a mean reduction before calling the rule);
- the result maps each trainable parameter of ``module`` to a tensor of shape ``(N, *param.shape)``.

Lookup walks ``type(module).__mro__``, so a subclass of ``nn.Linear`` uses the Linear rule unless it
registers its own. The last registration for a type wins. Both the compiled graph and the hooks
engine look rules up here, so a user rule serves both.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Type, Union

import torch
from torch import nn

from fxdp.registry import TypeRegistry

GradSampler = Callable[[nn.Module, List[torch.Tensor], torch.Tensor], Dict[nn.Parameter, torch.Tensor]]

GRAD_SAMPLERS: TypeRegistry[GradSampler] = TypeRegistry(
    nn.Module, type_error="register_grad_sampler expects nn.Module subclasses, got {!r}")
_GRAD_SAMPLERS = GRAD_SAMPLERS.entries  # the plain dict underneath (tests snapshot and restore it)


def register_grad_sampler(target_class_or_classes: Union[Type[nn.Module], Iterable[Type[nn.Module]]]):
    """Decorator: register ``fn(module, activations, backprops)`` as the rule for the given types."""
    return GRAD_SAMPLERS.register(target_class_or_classes)


def find_grad_sampler(module_or_type) -> Optional[GradSampler]:
    """The rule for a module (or module type), walking the class hierarchy; ``None`` if there is none."""
    return GRAD_SAMPLERS.find(module_or_type)


def rule_name(module_or_type) -> Optional[str]:
    """Name of the class whose rule applies (``"Linear"`` for a subclass of nn.Linear), or None."""
    owner = GRAD_SAMPLERS.owner(module_or_type)
    return None if owner is None else owner.__name__
