"""``ModuleValidator``: find the modules DP-SGD cannot train as they are, and fix them.

Validators and fixers are registered per module type with :func:`register_module_validator` /
:func:`register_module_fixer`. The registries belong to a validator class: a subclass of
``ModuleValidator`` gets registries of its own, and looks rules up in them before its parents', so it
inherits the default rules and can override them without touching ``ModuleValidator``. Lookups walk
``type(module).__mro__``: a subclass of ``nn.BatchNorm2d`` is covered by the BatchNorm rules.

Signatures: a validator is ``fn(module, **kwargs) -> list[UnsupportedError]``, a fixer
``fn(module, **kwargs) -> nn.Module`` (it may return the module itself, changed, or a replacement).
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Type, Union

from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from fxdp.diagnostics import (
    ROOT_NAME,
    IllegalModuleConfigurationError,
    UnsupportedError,
    UnsupportedModuleError,
    op_name,
)
from fxdp.validators.inplace_flags import disable_inplace_flags

Validator = Callable[..., List[UnsupportedError]]
Fixer = Callable[..., nn.Module]


class ModuleValidator:
    """Validates and fixes models for DP-SGD; holds the registries of validators and fixers."""

    _validators: Dict[type, Validator] = {}
    _fixers: Dict[type, Fixer] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Each validator class owns its registries; lookups fall back to the parents'.
        cls._validators = {}
        cls._fixers = {}

    # -- lookups ------------------------------------------------------------------------------------

    @classmethod
    def find_validator(cls, module_or_type) -> Optional[Validator]:
        """The validator for a module (or module type): most specific module type first."""
        return _lookup(cls, "_validators", module_or_type)

    @classmethod
    def find_fixer(cls, module_or_type) -> Optional[Fixer]:
        """The fixer for a module (or module type): most specific module type first."""
        return _lookup(cls, "_fixers", module_or_type)

    # -- validation ---------------------------------------------------------------------------------

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> List[UnsupportedError]:
        """Every problem in ``module`` and its submodules; with ``strict=True``, raise them instead.

        Raises:
            UnsupportedModuleError: with ``strict=True``, listing every error in ``errors``.
        """
        errors: List[UnsupportedError] = []
        if not module.training:
            errors.append(model_not_training_error(module))
        errors.extend(cls.module_errors(module))
        if strict and errors:
            raise UnsupportedModuleError.aggregate(errors)
        return errors

    @classmethod
    def module_errors(cls, module: nn.Module, *, prefix: str = "") -> List[UnsupportedError]:
        """What the registered validators say about ``module`` and its submodules.

        Unlike :meth:`validate`, this does not check the root's training mode; the validate pass uses
        it on each module the graph calls (``prefix`` is that module's qualified name).
        """
        errors: List[UnsupportedError] = []
        for name, sub in module.named_modules(prefix=prefix):
            validator = cls.find_validator(sub)
            if validator is None:
                continue
            for error in validator(sub):
                errors.append(error.locate(name or ROOT_NAME, type(sub)))
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """True when :meth:`validate` finds nothing."""
        return not cls.validate(module, strict=False)

    # -- fixing -------------------------------------------------------------------------------------

    @classmethod
    def fix(cls, module: nn.Module, *, remove_inplace_ops: bool = False, **kwargs) -> nn.Module:
        """A fixed deep copy of ``module``; ``module`` itself is never changed.

        - in-place flags (``nn.ReLU(inplace=True)``, ``nn.Dropout(inplace=True)``, any module with a
          true ``inplace`` attribute) are always turned off: cheap and type preserving;
        - each submodule with a registered fixer is replaced by the fixer's result (BatchNorm becomes
          GroupNorm, with ``num_groups`` from ``kwargs``; InstanceNorm stops tracking running stats);
        - with ``remove_inplace_ops=True`` the model is traced and in-place ops in ``forward``
          (``out += identity``, ``x.relu_()``, ``x[m] = v``) are rewritten out of place. The result is
          then a ``torch.fx.GraphModule``, not the original class (a warning says so). A model that
          cannot be traced is returned with the module-level fixes only, and the reason is logged at
          INFO on the ``"fxdp"`` logger.

        ``kwargs`` are passed to every fixer.
        """
        fixed, warning = cls._fix(module, remove_inplace_ops=remove_inplace_ops, **kwargs)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=2)
        return fixed

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs) -> nn.Module:
        """:meth:`fix`, then :meth:`validate` with ``strict=True``; returns the fixed model.

        Raises:
            UnsupportedModuleError: if problems remain that no fixer handles.
        """
        fixed, warning = cls._fix(module, **kwargs)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=2)
        cls.validate(fixed, strict=True)
        return fixed

    @classmethod
    def _fix(cls, module: nn.Module, *, remove_inplace_ops: bool = False, **kwargs) -> Tuple[nn.Module, str]:
        model = _deepcopy(module)
        disable_inplace_flags(model)
        model = _apply_fixers(cls, model, "", {}, kwargs)
        if not remove_inplace_ops:
            return model, ""
        return _rewrite_inplace_ops(model)


def model_not_training_error(module: nn.Module) -> IllegalModuleConfigurationError:
    return IllegalModuleConfigurationError(
        "the model is in eval mode; DP-SGD trains it, and layers such as Dropout and the per-sample "
        "gradient computation need training mode.",
        module_name=ROOT_NAME,
        module_type=type(module),
        fix="call model.train() before making it private.",
    )


def _deepcopy(module: nn.Module) -> nn.Module:
    # Uninitialised parameters of lazy modules refuse deepcopy; fresh ones are equivalent copies.
    memo = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if isinstance(tensor, UninitializedTensorMixin):
            memo[id(tensor)] = type(tensor)(requires_grad=tensor.requires_grad)
    return copy.deepcopy(module, memo)


def _registries(validator_class: type, attr: str) -> List[dict]:
    return [vars(k)[attr] for k in validator_class.__mro__ if attr in vars(k)]


def _lookup(validator_class: type, attr: str, module_or_type):
    module_type = module_or_type if isinstance(module_or_type, type) else type(module_or_type)
    registries = _registries(validator_class, attr)
    for klass in module_type.__mro__:
        for registry in registries:
            if klass in registry:
                return registry[klass]
    return None


def _apply_fixers(validator_class, module: nn.Module, name: str, memo: Dict[int, nn.Module], kwargs) -> nn.Module:
    """Fix children first, then ``module``; a module shared by two parents stays shared."""
    if id(module) in memo:
        return memo[id(module)]
    for child_name, child in list(module.named_children()):
        new_child = _apply_fixers(validator_class, child, f"{name}.{child_name}" if name else child_name, memo, kwargs)
        if new_child is not child:
            setattr(module, child_name, new_child)
    result = module
    fixer = validator_class.find_fixer(module)
    if fixer is not None:
        try:
            result = fixer(module, **kwargs)
        except ValueError as exc:
            raise ValueError(f"cannot fix `{name or ROOT_NAME}` ({op_name(module)}): {exc}") from exc
        if not isinstance(result, nn.Module):
            raise TypeError(
                f"the fixer {getattr(fixer, '__name__', fixer)!r} for {op_name(module)} returned "
                f"{type(result).__name__}; a fixer must return an nn.Module"
            )
    memo[id(module)] = result
    return result


def _rewrite_inplace_ops(model: nn.Module) -> Tuple[nn.Module, str]:
    from fxdp.rewrite_inplace import rewrite_inplace_ops  # the inplace pass's graph rewrite, traced

    return rewrite_inplace_ops(model)


def register_module_validator(
    target_class_or_classes: Union[Type[nn.Module], Iterable[Type[nn.Module]]],
    validator_class: Type[ModuleValidator] = ModuleValidator,
):
    """Decorator: register ``fn(module, **kwargs) -> list[UnsupportedError]`` for the given types.

    The rule goes into ``validator_class``'s registry (and so also serves its subclasses).
    """
    return _register(target_class_or_classes, validator_class, "_validators")


def register_module_fixer(
    target_class_or_classes: Union[Type[nn.Module], Iterable[Type[nn.Module]]],
    validator_class: Type[ModuleValidator] = ModuleValidator,
):
    """Decorator: register ``fn(module, **kwargs) -> nn.Module`` as the fixer for the given types."""
    return _register(target_class_or_classes, validator_class, "_fixers")


def _register(targets, validator_class, attr):
    targets = list(targets) if isinstance(targets, (list, tuple, set)) else [targets]
    for t in targets:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"expected nn.Module subclasses to register a rule for, got {t!r}")
    if not (isinstance(validator_class, type) and issubclass(validator_class, ModuleValidator)):
        raise TypeError(f"validator_class must be ModuleValidator or a subclass of it, got {validator_class!r}")

    def decorator(fn):
        registry = vars(validator_class)[attr]
        for t in targets:
            registry[t] = fn
        return fn

    return decorator
