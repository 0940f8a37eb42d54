"""The one registry of per-sample gradient rules ("grad samplers").

A rule has the signature ``(module, activations, backprops) -> {param: grad_sample}``:

- ``activations``: list of the module's tensor inputs, batch first (``activations[0]`` is the input);
- ``backprops``: gradient of the loss w.r.t. the module's output, batch first, **for a summed loss**
  (the callers undo the ``1/N`` of a mean reduction before calling the rule);
- the result maps each trainable parameter of ``module`` to a tensor of shape ``(N, *param.shape)``.

Lookup walks ``type(module).__mro__``: a subclass of ``nn.Linear`` uses the Linear rule unless it
registers its own or overrides ``forward`` (then it has no rule: the graph traces into it and the
hooks engine gives it the generic rule), or the rule was registered with ``subclasses=True``. The
last registration for a type wins. Both the compiled graph and the hooks engine look rules up here,
so a user rule serves both. A rule for a class of an optional library (transformers' ``Conv1D``) is
registered by its dotted path (:func:`register_grad_sampler_by_path`): it applies once that library's module
is imported, and fxdp never imports it.

A module with a parametrization (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``,
a user's) computes its weight from other parameters (``parametrizations.weight.original0``, ...), so
its class's rule, which differentiates the computed weight, does not apply: it gets
:func:`parametrized_grad_sampler`, the generic rule over its real parameters.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable, List, Optional, Type, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from fxdp.diagnostics.errors import PerSampleError
from fxdp.registry import TypeRegistry

GradSampler = Callable[[nn.Module, List[torch.Tensor], torch.Tensor], Dict[nn.Parameter, torch.Tensor]]

GRAD_SAMPLERS: TypeRegistry[GradSampler] = TypeRegistry(
    nn.Module, type_error="register_grad_sampler expects nn.Module subclasses, got {!r}",
    unless_overridden="forward")
_GRAD_SAMPLERS = GRAD_SAMPLERS.entries  # the plain dict underneath (tests snapshot and restore it)

PARAMETRIZED = "generic (parametrized)"  # the rule name reports give a parametrized module


def register_grad_sampler(target_class_or_classes: Union[Type[nn.Module], Iterable[Type[nn.Module]]],
                          *, subclasses: bool = False):
    """Decorator: register ``fn(module, activations, backprops)`` as the rule for the given types.

    The rule serves subclasses that do not override ``forward``; ``subclasses=True``: all of them."""
    return GRAD_SAMPLERS.register(target_class_or_classes, subclasses=subclasses)


def register_grad_sampler_by_path(path: str, *, subclasses: bool = False):
    """Decorator: register ``fn`` as the rule for the class ``path`` ("module.ClassName") of a library fxdp
    does not import, as soon as that module has been imported (:meth:`TypeRegistry.register_by_path`). A
    rule registered for that class with :func:`register_grad_sampler` takes precedence."""
    return GRAD_SAMPLERS.register_by_path(path, subclasses=subclasses)


def find_grad_sampler(module_or_type) -> Optional[GradSampler]:
    """The rule for a module (or module type), walking the class hierarchy; ``None`` if there is none."""
    if _is_parametrized(module_or_type):
        return parametrized_grad_sampler
    return GRAD_SAMPLERS.find(module_or_type)


def rule_name(module_or_type) -> Optional[str]:
    """Name of the class whose rule applies (``"Linear"`` for a subclass of nn.Linear), or the rule's own
    ``label`` (a rule shared by many classes: the mixture-of-experts one), or None."""
    if _is_parametrized(module_or_type):
        return PARAMETRIZED
    owner = GRAD_SAMPLERS.owner(module_or_type)
    if owner is None:
        return None
    return getattr(GRAD_SAMPLERS.find(module_or_type), "label", None) or owner.__name__  # a shared rule names itself


def _is_parametrized(module_or_type) -> bool:
    if isinstance(module_or_type, type):  # parametrize gives each module its own class, marked so
        return getattr(module_or_type, "__module__", "") == parametrize.__name__ and issubclass(module_or_type, nn.Module) \
            and module_or_type.__name__.startswith("Parametrized")
    # parametrize gives the module a class of its own (the check above), and takes it back when the last
    # parametrization is removed: asking the class first spares the usual module a slow attribute miss
    return (isinstance(module_or_type, nn.Module) and _is_parametrized(type(module_or_type))
            and parametrize.is_parametrized(module_or_type))


def parametrized_grad_sampler(module: nn.Module, activations, backprops) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a parametrized module's real parameters: the generic rule, with the
    parametrizations in eval mode while each sample is re-run.

    ``spectral_norm`` in training mode runs a step of power iteration in every forward, updating its
    ``u``/``v`` buffers in place before using them; the gradient of that forward treats them as
    constants. In eval mode it uses the buffers as they are, which are the ones that forward used
    (the rule runs in the backward of the forward it differentiates), and the re-run changes nothing.
    """
    from fxdp.grad_sample.generic import generic_grad_sampler  # generic imports nothing from here

    parametrizations = [m for m in module.parametrizations.modules()]
    _refuse_a_second_stateful_call(module, parametrizations)
    modes = [m.training for m in parametrizations]
    try:
        for m in parametrizations:
            m.training = False  # not .eval(): only these modules, not the layer's own submodules
        return generic_grad_sampler(module, activations, backprops)
    finally:
        for m, mode in zip(parametrizations, modes):
            m.training = mode


_CALLS_IN_BACKWARD: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def _refuse_a_second_stateful_call(module: nn.Module, parametrizations) -> None:
    """A parametrization that updates buffers in training, on a layer called twice in the forward whose
    backward this is: the buffers hold the last call's values, so the other call's gradients would
    be wrong (the graph engine reports this at compile time; this catches it in any engine)."""
    if not any(m.training and any(True for _ in m.buffers(recurse=False)) for m in parametrizations):
        return
    task = torch._C._current_graph_task_id()
    if task < 0:  # not inside a backward pass
        return
    if _CALLS_IN_BACKWARD.get(module) == task:
        raise PerSampleError(
            f"fxdp: {type(module).__name__} ({module!r}) was called more than once in the forward of this "
            "backward pass, and its parametrization updates its buffers in each call in training mode "
            "(spectral_norm's power iteration): per-sample gradients can only be computed with the last "
            "call's buffers, so the others' would be wrong. Call the layer once per forward, or put its "
            "parametrizations in eval mode (`layer.parametrizations.eval()`)."
        )
    _CALLS_IN_BACKWARD[module] = task
