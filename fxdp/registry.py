"""One helper for every registry keyed by class: per-layer grad samplers, batch rules for layers,
module validators and fixers.

``TypeRegistry`` maps classes to values (rules). ``register(types)`` is a decorator that accepts one
class or a list/tuple/set of classes; the last registration for a class wins. ``find(x)`` takes an
instance or a class and walks ``type(x).__mro__``, so a subclass of ``nn.Linear`` is covered by the
Linear rule unless it has its own. ``find_in(registries, x)`` looks a class up in several registries
at once (a validator class's own registry before its parents'), most specific class first.

This module imports nothing from fxdp.
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, List, Optional, Sequence, TypeVar

V = TypeVar("V")


def as_types(types) -> List[type]:
    """One class or a list/tuple/set of classes, as a list."""
    return list(types) if isinstance(types, (list, tuple, set, frozenset)) else [types]


def _class_of(obj) -> type:
    return obj if isinstance(obj, type) else type(obj)


class TypeRegistry(Generic[V]):
    """Values registered per class, looked up along the class hierarchy.

    ``base``: when given, only subclasses of it may be registered; anything else raises ``TypeError``
    with ``type_error`` (formatted with the offending key) when ``register`` is called.
    ``entries`` is the plain dict underneath (class -> value), in registration order.
    """

    def __init__(self, base: Optional[type] = None,
                 type_error: str = "expected a class to register a rule for, got {!r}"):
        self.base = base
        self.type_error = type_error
        self.entries: Dict[type, V] = {}

    def register(self, types) -> Callable[[V], V]:
        """Decorator: register the decorated value for ``types`` (a class or a collection of them)."""
        targets = as_types(types)
        for t in targets:
            if not isinstance(t, type) or (self.base is not None and not issubclass(t, self.base)):
                raise TypeError(self.type_error.format(t))

        def decorator(value: V) -> V:
            for t in targets:
                self.entries[t] = value
            return value

        return decorator

    def find(self, obj) -> Optional[V]:
        """The value for an instance or a class, walking its MRO; ``None`` if there is none."""
        return find_in((self,), obj)

    def owner(self, obj) -> Optional[type]:
        """The class (in ``obj``'s MRO) whose registration applies, or ``None``."""
        for klass in _class_of(obj).__mro__:
            if klass in self.entries:
                return klass
        return None

    def snapshot(self) -> Dict[type, V]:
        """A copy of the registrations, for :meth:`restore` (tests undo what they register)."""
        return dict(self.entries)

    def restore(self, snapshot: Dict[type, V]) -> None:
        """Put back the registrations of an earlier :meth:`snapshot` (the same dict object is kept)."""
        self.entries.clear()
        self.entries.update(snapshot)


def find_in(registries: Sequence[TypeRegistry], obj) -> Optional[V]:
    """The first value for ``obj``'s class: most specific class first, then the registries in order."""
    for klass in _class_of(obj).__mro__:
        for registry in registries:
            value = registry.entries.get(klass)
            if value is not None:
                return value
    return None

