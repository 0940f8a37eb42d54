"""``ModuleValidator``: find the modules DP-SGD cannot train as they are, and fix them.

Validators and fixers are registered per module type with :func:`register_module_validator` /
:func:`register_module_fixer`. The registries belong to a validator class: a subclass of
``ModuleValidator`` gets registries of its own, and looks rules up in them before its parents', so it
inherits the default rules and can override them without touching ``ModuleValidator``. Lookups walk
``type(module).__mro__``: a subclass of ``nn.BatchNorm2d`` is covered by the BatchNorm rules.

Signatures: a validator is ``fn(module, **kwargs) -> list[UnsupportedError]``, a fixer
``fn(module, *, input_shapes, **kwargs) -> nn.Module`` (it may return the module itself, changed, or a
replacement). ``input_shapes`` are the shapes of the module's input in the example forward of
``fix(model, example_inputs=...)``, one per call (``None`` without example inputs; empty for a module
the forward did not call). A fixer receives only the keyword arguments its signature names (all of them
if it takes ``**kwargs``), so a fixer written ``def fix(module)`` works too.

``ModuleValidator.VALIDATORS`` and ``ModuleValidator.FIXERS`` show the registries as dicts from module
type to rule (Opacus's class attributes): ``VALIDATORS[nn.BatchNorm2d]`` is the rule ``validate`` uses
for that type (found along its MRO), and ``FIXERS[MyLayer] = fix`` registers a fixer.

The validators sit above the compiler's passes and use them: ``fix(remove_inplace_ops=True)`` traces the
model with the front end and rewrites its in-place ops with the inplace pass. The validate pass does not
import this module; the compiler hands it ``ModuleValidator`` as its module rules, so the imports go
one way (validators -> passes, never back).
"""

from __future__ import annotations

import copy
import inspect
import logging
import warnings
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Type, Union

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedTensorMixin

from fxdp.registry import TypeRegistry, find_in
from fxdp.diagnostics import (
    ROOT_NAME,
    ModuleFixWarning,
    Severity,
    UnsupportedError,
    UnsupportedModuleError,
    expect_module,
    op_name,
)
from fxdp.frontends.fx import trace
from fxdp.passes.inplace import remove_inplace_ops
from fxdp.passes.validate import model_not_training_error
from fxdp.validators.inplace_flags import disable_inplace_flags

Validator = Callable[..., List[UnsupportedError]]
Fixer = Callable[..., nn.Module]

_TYPE_ERROR = "expected nn.Module subclasses to register a rule for, got {!r}"

logger = logging.getLogger("fxdp.validators")


class _RuleTable(MutableMapping):
    """One validator class's validators or fixers as a dict from module type to rule (see the module).

    Reading looks a type up as ``validate``/``fix`` do; writing and deleting change the registry of the
    class it was read from; iteration lists every registered type, the class's own first."""

    def __init__(self, owner: type, attr: str):
        self._owner, self._attr = owner, attr

    def __getitem__(self, module_type):
        rule = _lookup(self._owner, self._attr, module_type) if isinstance(module_type, type) else None
        if rule is None:
            raise KeyError(module_type)
        return rule

    def __setitem__(self, module_type, rule) -> None:
        vars(self._owner)[self._attr].register(module_type)(rule)

    def __delitem__(self, module_type) -> None:
        del vars(self._owner)[self._attr].entries[module_type]

    def _types(self) -> List[type]:
        registries = [vars(k)[self._attr] for k in self._owner.__mro__ if self._attr in vars(k)]
        return list(dict.fromkeys(t for registry in registries for t in registry.entries))

    def __iter__(self):
        return iter(self._types())

    def __len__(self) -> int:
        return len(self._types())

    def __repr__(self) -> str:
        return repr({t: self[t] for t in self})


class _RulesOf:
    """The class attribute ``VALIDATORS`` / ``FIXERS``: a :class:`_RuleTable` of the class it is read from."""

    def __init__(self, attr: str):
        self.attr = attr

    def __get__(self, instance, owner: type) -> _RuleTable:
        return _RuleTable(owner, self.attr)


class ModuleValidator:
    """Validates and fixes models for DP-SGD; holds the registries of validators and fixers."""

    _validators: TypeRegistry[Validator] = TypeRegistry(nn.Module, _TYPE_ERROR)
    _fixers: TypeRegistry[Fixer] = TypeRegistry(nn.Module, _TYPE_ERROR)
    VALIDATORS = _RulesOf("_validators")
    FIXERS = _RulesOf("_fixers")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Each validator class owns its registries; lookups fall back to the parents'.
        cls._validators = TypeRegistry(nn.Module, _TYPE_ERROR)
        cls._fixers = TypeRegistry(nn.Module, _TYPE_ERROR)

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
        expect_module(module, "ModuleValidator.validate(module)")
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
        expect_module(module, "ModuleValidator.is_valid(module)")
        return not cls.validate(module, strict=False)

    # -- fixing -------------------------------------------------------------------------------------

    @classmethod
    def fix(cls, module: nn.Module, *, remove_inplace_ops: bool = False, example_inputs: Any = None,
            **kwargs) -> nn.Module:
        """A fixed deep copy of ``module``; ``module`` itself is never changed.

        - in-place flags (``nn.ReLU(inplace=True)``, ``nn.Dropout(inplace=True)``, any module with a
          true ``inplace`` attribute) are always turned off: cheap and type preserving;
        - each submodule with a registered fixer is replaced by the fixer's result (BatchNorm becomes
          GroupNorm or LayerNorm, with ``num_groups`` from ``kwargs``; InstanceNorm stops tracking
          running stats). A :class:`~fxdp.validators.ModuleFixWarning` lists what was replaced;
        - ``example_inputs`` (a tensor, a tuple of positional inputs or a dict of keyword inputs) are
          run through a copy of the model in eval mode to record each module's input shape, so the
          replacements fit what each layer sees: a ``BatchNorm1d`` over ``(N, C)`` features becomes
          ``LayerNorm(C)``, over ``(N, C, L)`` ``GroupNorm``. Without them a ``BatchNorm1d`` becomes
          ``GroupNorm(1, C)``, which suits both;
        - with ``remove_inplace_ops=True`` the model is traced and in-place ops in ``forward``
          (``out += identity``, ``x.relu_()``, ``x[m] = v``) are rewritten out of place. The result is
          then a ``torch.fx.GraphModule``, not the original class (a warning says so). A model that
          cannot be traced is returned with the module-level fixes only, and the reason is logged at
          INFO on the ``"fxdp"`` logger.

        ``kwargs`` are passed to every fixer.

        Raises:
            ValueError: a module no replacement can fix without making its output ignore its input
                (e.g. a BatchNorm1d over ``(N, 1)``), naming the module.
        """
        expect_module(module, "ModuleValidator.fix(module)")
        fixed, messages = cls._fix(module, remove_inplace_ops=remove_inplace_ops, example_inputs=example_inputs,
                                   **kwargs)
        for message in messages:
            warnings.warn(message, stacklevel=2)
        return fixed

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs) -> nn.Module:
        """:meth:`fix`, then :meth:`validate` with ``strict=True``; returns the fixed model.

        Raises:
            UnsupportedModuleError: if problems remain that no fixer handles.
        """
        expect_module(module, "ModuleValidator.fix_and_validate(module)")
        fixed, messages = cls._fix(module, **kwargs)
        for message in messages:
            warnings.warn(message, stacklevel=2)
        cls.validate(fixed, strict=True)
        return fixed

    @classmethod
    def _fix(cls, module: nn.Module, *, remove_inplace_ops: bool = False, example_inputs: Any = None,
             **kwargs) -> Tuple[nn.Module, List[Warning]]:
        """The fixed copy and the warnings to show (replacements first)."""
        shapes = None if example_inputs is None else record_input_shapes(module, example_inputs)
        model = _deepcopy(module)
        disable_inplace_flags(model)
        changes: List[Tuple[str, str, str]] = []
        model = _apply_fixers(cls, model, "", {}, kwargs, shapes, changes)
        messages: List[Warning] = []
        if changes:
            messages.append(ModuleFixWarning(changes, example_inputs_given=shapes is not None))
        if remove_inplace_ops:
            model, warning = _rewrite_inplace_ops(model)
            if warning:
                messages.append(UserWarning(warning))
        return model, messages


def record_input_shapes(module: nn.Module, example_inputs: Any) -> Dict[str, Tuple[Tuple[int, ...], ...]]:
    """The shape of each submodule's input (its first tensor argument), one per call, by qualified name.

    Runs a throwaway copy in eval mode without gradients, so neither ``module`` nor the fixed copy is
    changed (lazy modules initialised, buffers updated) by the probe.
    """
    probe = _deepcopy(module).eval()
    shapes: Dict[str, List[Tuple[int, ...]]] = {}

    def recorder(name):
        def hook(_module, args, kwargs):
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None:
                shapes.setdefault(name, []).append(tuple(first.shape))
        return hook

    for name, sub in probe.named_modules():
        sub.register_forward_pre_hook(recorder(name), with_kwargs=True)
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    try:
        with torch.no_grad():
            probe(*args, **kwargs)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise ValueError(
            f"ModuleValidator.fix: running {type(module).__name__} on example_inputs failed "
            f"({type(exc).__name__}: {text[0] if text else ''}); give example_inputs as forward takes them: "
            "a tensor, a tuple of positional inputs or a dict of keyword inputs") from exc
    return {name: tuple(calls) for name, calls in shapes.items()}


def _deepcopy(module: nn.Module) -> nn.Module:
    # Uninitialised parameters of lazy modules refuse deepcopy; fresh ones are equivalent copies.
    memo = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if isinstance(tensor, UninitializedTensorMixin):
            memo[id(tensor)] = type(tensor)(requires_grad=tensor.requires_grad)
    return copy.deepcopy(module, memo)


def _lookup(validator_class: type, attr: str, module_or_type):
    """Most specific module type first; at each type, this validator class's registry before its parents'."""
    registries = [vars(k)[attr] for k in validator_class.__mro__ if attr in vars(k)]
    return find_in(registries, module_or_type)


def _apply_fixers(validator_class, module: nn.Module, name: str, memo: Dict[int, nn.Module], kwargs,
                  shapes: Optional[Dict[str, tuple]], changes: List[Tuple[str, str, str]]) -> nn.Module:
    """Fix children first, then ``module``; a module shared by two parents stays shared.

    ``shapes``: input shapes by qualified name (None: not recorded); each change made is appended to
    ``changes`` as (name, before, after).
    """
    if id(module) in memo:
        return memo[id(module)]
    for child_name, child in list(module.named_children()):
        new_child = _apply_fixers(validator_class, child, f"{name}.{child_name}" if name else child_name, memo,
                                  kwargs, shapes, changes)
        if new_child is not child:
            setattr(module, child_name, new_child)
    result = module
    fixer = validator_class.find_fixer(module)
    if fixer is not None:
        before, before_items, changes_before = _describe_module(module), _repr_items(module), len(changes)
        input_shapes = None if shapes is None else shapes.get(name, ())
        try:
            result = fixer(module, **_accepted(fixer, dict(kwargs, input_shapes=input_shapes)))
        except ValueError as exc:
            raise ValueError(f"cannot fix `{name or ROOT_NAME}` ({op_name(module)}): {exc}") from exc
        if not isinstance(result, nn.Module):
            raise TypeError(
                f"the fixer {getattr(fixer, '__name__', fixer)!r} for {op_name(module)} returned "
                f"{type(result).__name__}; a fixer must return an nn.Module"
            )
        where = f" (input {', '.join(str(s) for s in dict.fromkeys(input_shapes))})" if input_shapes else ""
        if result is not module:
            changes.append((name or ROOT_NAME, before, _describe_module(result) + where))
        elif _repr_items(result) != before_items:  # changed in place: name what changed
            after_items = _repr_items(result)
            old = [item for item in before_items if item not in after_items]
            new = [item for item in after_items if item not in before_items]
            type_name = op_name(module)
            changes.append((name or ROOT_NAME, f"{type_name}({', '.join(old)})", f"{type_name}({', '.join(new)})"))
        if len(changes) > changes_before:  # the line Opacus logs for each replacement (scripts read it)
            logger.info("Replaced sub_module %s: %s with %s", *changes[-1])
    memo[id(module)] = result
    return result


def _accepted(fixer: Callable, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments ``fixer`` takes: all of them with ``**kwargs``, else those it names."""
    try:
        parameters = inspect.signature(fixer).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): give it everything
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    named = {p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                      inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in named}


def _describe_module(module: nn.Module) -> str:
    """``nn.GroupNorm(32, 64)``: the type and the positional part of its ``extra_repr``."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return f"{op_name(module)}(sized at its first input)"
    items = [item for item in _repr_items(module) if "=" not in item]
    return f"{op_name(module)}({', '.join(items)})"


def _repr_items(module: nn.Module) -> List[str]:
    """The comma-separated items of ``module.extra_repr()`` (commas inside brackets kept)."""
    text = module.extra_repr()
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    return items + [tail] if tail else items


def _rewrite_inplace_ops(model: nn.Module) -> Tuple[nn.Module, str]:
    """``model`` traced with its in-place ops rewritten out of place by the inplace pass (a GraphModule), and
    a warning for the user; ``(model, "")`` when it cannot be traced."""
    traced = trace(model)
    if not traced.ok:
        where = f" at {traced.location}" if traced.location is not None else ""
        logging.getLogger("fxdp").info(
            "ModuleValidator.fix(remove_inplace_ops=True): %s cannot be traced (%s%s); returning it "
            "with the module-level fixes only, its in-place ops are left as they are",
            type(model).__name__, traced.reason, where,
        )
        return model, ""
    result = remove_inplace_ops(traced.graph_module)
    warning = (
        f"ModuleValidator.fix(remove_inplace_ops=True) returns a torch.fx.GraphModule, not a "
        f"{type(model).__name__}: isinstance checks, methods defined on {type(model).__name__} and "
        f"pickling by class see the GraphModule type ({len(result.report.changes)} in-place op(s) "
        f"rewritten)."
    )
    kept = [f for f in result.report.findings if f.severity is not Severity.INFO]
    if kept:
        warning += " Not rewritten: " + "; ".join(f"{f.node} at {f.where}: {f.message}" for f in kept)
    return result.graph_module, warning


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
    if not (isinstance(validator_class, type) and issubclass(validator_class, ModuleValidator)):
        raise TypeError(f"validator_class must be ModuleValidator or a subclass of it, got {validator_class!r}")
    return vars(validator_class)[attr].register(targets)  # raises TypeError for non-Module types
