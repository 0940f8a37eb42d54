"""One helper for every registry keyed by class: per-layer grad samplers, batch rules for layers,
module validators and fixers.

``TypeRegistry`` maps classes to values (rules). ``register(types)`` is a decorator that accepts one
class or a list/tuple/set of classes; the last registration for a class wins. ``find(x)`` takes an
instance or a class and walks ``type(x).__mro__``. ``find_in(registries, x)`` looks a class up in
several registries at once (a validator class's own registry before its parents'), most specific
class first.

Which subclasses a registration covers is the registry's choice, made once, here:

- a registry made with ``unless_overridden="forward"`` (per-sample rules, batch rules of layers) lets a
  rule for ``nn.Linear`` serve a subclass only when the subclass does not override ``forward``: a
  ``CosineLinear(nn.Linear)`` that normalises its weight computes something else, and the Linear
  rule applied to it would be silently wrong. ``register(T, subclasses=True)`` says a rule is right
  for every subclass of ``T`` whatever its ``forward`` (``nn.RNNBase``'s rule for LSTM, GRU, RNN);
- a registry made without it (validators, fixers) covers every subclass: a check on what a module
  *is* (a BatchNorm keeps running statistics) stays true when a subclass changes ``forward``.

A class of a library fxdp does not import (transformers' ``Conv1D``) is registered by its dotted path,
``register_by_path("transformers.pytorch_utils.Conv1D")``: the registration takes effect once that module
has been imported (a class of it can exist only then), so fxdp never imports the library itself.

This module imports nothing from fxdp.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, Generic, List, Optional, Sequence, Set, Tuple, TypeVar

import torch

V = TypeVar("V")


def as_types(types) -> List[type]:
    """One class or a list/tuple/set of classes, as a list."""
    return list(types) if isinstance(types, (list, tuple, set, frozenset)) else [types]


def _class_of(obj) -> type:
    return obj if isinstance(obj, type) else type(obj)


#: bumped by every change of any registry (entries, ``subclasses=True`` marks, registrations by path): a
#: lookup remembered with :func:`lookup_stamp` holds while this has not moved
_CHANGES = [0]


def _changed() -> None:
    _CHANGES[0] += 1


def lookup_stamp(obj) -> Optional[tuple]:
    """A key equal at two moments only if every registry answers the same for the module ``obj`` at both: the
    registries unchanged, ``obj`` of the same class, its class's ``forward`` the same. ``None`` where answers for
    ``obj`` are not to be remembered (the instance replaced ``forward`` itself). Callers that look a layer's rules
    up at every call keep the answers with this key and look again when it differs (a class registered by path
    is registered at the first lookup after its module is imported, and ``obj``'s class exists only after that:
    an answer remembered for ``obj`` already saw it)."""
    if "forward" in getattr(obj, "__dict__", ()):
        return None
    klass = type(obj)
    return _CHANGES[0], klass, getattr(klass, "forward", None)


class _Entries(dict):
    """A registry's registrations (class -> value): a dict that counts its changes, so that lookups can be
    remembered until the next one, however it is changed (``register``, ``restore``, or tests and
    benchmarks editing the dict directly)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.changes = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.changes += 1
        _changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self.changes += 1
        _changed()

    def pop(self, *args):
        self.changes += 1
        _changed()
        return super().pop(*args)

    def popitem(self):
        self.changes += 1
        _changed()
        return super().popitem()

    def setdefault(self, key, default=None):
        self.changes += 1
        _changed()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.changes += 1
        _changed()

    def clear(self):
        super().clear()
        self.changes += 1
        _changed()


class TypeRegistry(Generic[V]):
    """Values registered per class, looked up along the class hierarchy.

    ``base``: when given, only subclasses of it may be registered; anything else raises ``TypeError``
    with ``type_error`` (formatted with the offending key) when ``register`` is called.
    ``unless_overridden``: a method name (``"forward"``); a registration then serves a subclass only
    if no class between the two defines that method (nor the instance itself), unless it was
    registered with ``subclasses=True``. ``None``: every subclass is served.
    ``entries`` is the plain dict underneath (class -> value), in registration order; ``by_path`` holds
    the registrations of classes by dotted path (path -> (value, subclasses)) not yet imported.
    """

    def __init__(self, base: Optional[type] = None,
                 type_error: str = "expected a class to register a rule for, got {!r}",
                 unless_overridden: Optional[str] = None):
        self.base = base
        self.type_error = type_error
        self.unless_overridden = unless_overridden
        self.entries: Dict[type, V] = _Entries()
        self.for_subclasses: Set[type] = set()  # registered with subclasses=True
        # what find() answered per class, valid while (entries.changes, self._changes) is _found_at: layers
        # look their rule up several times per training step
        self._found: Dict[type, tuple] = {}  # class -> (value, the method it resolved then)
        self._found_at = None
        self._changes = 0  # for_subclasses changes (register, restore)
        self.by_path: Dict[str, Tuple[V, bool]] = {}
        self._scanned = None  # (modules imported, paths, entries' changes) at the last look for them

    def register(self, types, *, subclasses: bool = False) -> Callable[[V], V]:
        """Decorator: register the decorated value for ``types`` (a class or a collection of them).

        ``subclasses=True``: the value is right for every subclass, even one that overrides the
        registry's ``unless_overridden`` method."""
        targets = as_types(types)
        for t in targets:
            if not isinstance(t, type) or (self.base is not None and not issubclass(t, self.base)):
                raise TypeError(self.type_error.format(t))

        def decorator(value: V) -> V:
            for t in targets:
                self.entries[t] = value
                (self.for_subclasses.add if subclasses else self.for_subclasses.discard)(t)
            self._changes += 1
            _changed()
            return value

        return decorator

    def register_by_path(self, path: str, *, subclasses: bool = False) -> Callable[[V], V]:
        """Decorator: register the decorated value for the class ``path`` ("module.ClassName") as soon as
        that module has been imported, without importing it. A registration of the class itself (with
        :meth:`register`) takes precedence."""
        def decorator(value: V) -> V:
            self.by_path[path] = (value, subclasses)
            self._changes += 1
            _changed()
            return value

        return decorator

    def _register_imported(self) -> None:
        """Register the classes of ``by_path`` whose module has been imported since the last look."""
        if torch.compiler.is_dynamo_compiling():
            # Traced, the scan below would make torch.compile guard on len(sys.modules) and compile the model again
            # after every import. A class that can be looked up exists, so its module was imported before the
            # model was compiled for DP, whose lookups (eager) registered it.
            return
        state = (len(sys.modules), len(self.by_path), getattr(self.entries, "changes", None))
        if not self.by_path or (state == self._scanned and state[2] is not None):
            return
        self._scanned = state
        for path, (value, subclasses) in self.by_path.items():
            module_name, _, class_name = path.rpartition(".")
            cls = getattr(sys.modules.get(module_name), class_name, None)
            if isinstance(cls, type) and cls not in self.entries:
                self.register(cls, subclasses=subclasses)(value)

    def serves(self, klass: type, obj) -> bool:
        """Whether the registration of ``klass`` (in ``obj``'s MRO) applies to ``obj``."""
        method = self.unless_overridden
        if method is None or klass in self.for_subclasses:
            return True
        if not isinstance(obj, type) and method in getattr(obj, "__dict__", {}):
            return False  # the instance itself replaced the method (``m.forward = ...``)
        for between in _class_of(obj).__mro__:
            if between is klass:
                return True
            if method in vars(between):
                return False
        return False

    def find(self, obj) -> Optional[V]:
        """The value for an instance or a class, walking its MRO; ``None`` if there is none. Remembered
        per class until the registrations change or the class's method does (an instance that replaced
        the method is looked up afresh each time)."""
        method = self.unless_overridden
        self._register_imported()
        if method is not None and not isinstance(obj, type) and method in getattr(obj, "__dict__", {}):
            return find_in((self,), obj)
        at = (getattr(self.entries, "changes", None), self._changes)
        if at != self._found_at or at[0] is None:
            self._found.clear()
            self._found_at = at
        klass = _class_of(obj)
        # the method as the class resolves it now: a class patched after a lookup (``MyLinear.forward = f``)
        # is looked up afresh
        resolved = None if method is None else getattr(klass, method, None)
        found = self._found.get(klass)
        if found is not None and found[1] is resolved:
            return found[0]
        value = find_in((self,), klass)
        self._found[klass] = (value, resolved)
        return value

    def owner(self, obj) -> Optional[type]:
        """The class (in ``obj``'s MRO) whose registration applies, or ``None``."""
        self._register_imported()
        for klass in _class_of(obj).__mro__:
            if klass in self.entries and self.serves(klass, obj):
                return klass
        return None

    def snapshot(self):
        """A copy of the registrations, for :meth:`restore` (tests undo what they register)."""
        return dict(self.entries), set(self.for_subclasses)

    def restore(self, snapshot) -> None:
        """Put back the registrations of an earlier :meth:`snapshot` (the same dict object is kept)."""
        entries, for_subclasses = snapshot if isinstance(snapshot, tuple) else (snapshot, None)
        self.entries.clear()
        self.entries.update(entries)
        if for_subclasses is not None:
            self.for_subclasses.clear()
            self.for_subclasses.update(for_subclasses)
        self._changes += 1
        _changed()


def find_in(registries: Sequence[TypeRegistry], obj) -> Optional[V]:
    """The first value for ``obj``'s class: most specific class first, then the registries in order
    (each registration only where its registry says it serves ``obj``)."""
    for registry in registries:
        registry._register_imported()
    for klass in _class_of(obj).__mro__:
        for registry in registries:
            value = registry.entries.get(klass)
            if value is not None and registry.serves(klass, obj):
                return value
    return None

