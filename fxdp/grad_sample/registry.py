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

GradSampler = Callable[[nn.Module, List[torch.Tensor], torch.Tensor], Dict[nn.Parameter, torch.Tensor]]

_GRAD_SAMPLERS: Dict[type, GradSampler] = {}


def register_grad_sampler(target_class_or_classes: Union[Type[nn.Module], Iterable[Type[nn.Module]]]):
    """Decorator: register ``fn(module, activations, backprops)`` as the rule for the given types."""
    targets = (
        list(target_class_or_classes)
        if isinstance(target_class_or_classes, (list, tuple, set))
        else [target_class_or_classes]
    )
    for t in targets:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"register_grad_sampler expects nn.Module subclasses, got {t!r}")

    def decorator(fn: GradSampler) -> GradSampler:
        for t in targets:
            _GRAD_SAMPLERS[t] = fn
        return fn

    return decorator


def find_grad_sampler(module_or_type) -> Optional[GradSampler]:
    """The rule for a module (or module type), walking the class hierarchy; ``None`` if there is none."""
    cls = module_or_type if isinstance(module_or_type, type) else type(module_or_type)
    for klass in cls.__mro__:
        rule = _GRAD_SAMPLERS.get(klass)
        if rule is not None:
            return rule
    return None


def rule_name(module_or_type) -> Optional[str]:
    """Name of the class whose rule applies (``"Linear"`` for a subclass of nn.Linear), or None."""
    cls = module_or_type if isinstance(module_or_type, type) else type(module_or_type)
    for klass in cls.__mro__:
        if klass in _GRAD_SAMPLERS:
            return klass.__name__
    return None
