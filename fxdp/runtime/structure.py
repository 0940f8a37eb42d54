"""What a compiled or wrapped model was built from, checked before every forward: which layer and parameter
objects sit where, and which parameters were trainable where that matters.

A compiled graph calls the layers and reads the parameters it was compiled with; a hooks engine hooked the
layers that were trainable when it was wrapped. After ``model.fc = nn.Linear(...)``, ``model.fc.weight =
nn.Parameter(...)`` or ``p.requires_grad_(True)`` that no longer describes the model: the new layer would never
be called (or never be hooked), the old one's parameters would reach the optimizer with no per-sample
gradient. :class:`StructureWatch` notices such a change in a few dictionary look-ups per forward (one per
edge of the watched part of the module tree), so that the engine builds itself again, or refuses, before
the forward runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, is_not, ne
from typing import Iterable, List, Optional, Tuple

from torch import nn

_REQUIRES_GRAD = attrgetter("requires_grad")


@dataclass
class StructureWatch:
    """``entries``: ``(container, key, object, what)``, where ``container`` is a module's ``_modules`` or
    ``_parameters`` dict and ``what`` says in words what replacing the object means; ``sizes``: such dicts and
    their lengths (a parameter or layer added or removed); ``flags``: ``(parameter, requires_grad, what)``."""

    entries: List[Tuple[dict, str, object, str]] = field(default_factory=list)
    sizes: List[Tuple[dict, int, str]] = field(default_factory=list)
    flags: List[Tuple[nn.Parameter, bool, str]] = field(default_factory=list)

    _columns: Optional[tuple] = field(default=None, repr=False, compare=False)  # entries and flags by column
    _keys: Optional[set] = field(default=None, repr=False, compare=False)  # (id of container, key) watched

    def __getstate__(self):  # both are rebuilt from the lists (ids differ in a copy)
        return {**vars(self), "_columns": None, "_keys": None}

    def changed(self) -> Optional[str]:
        """What changed since the watch was made (the first change found, in words), or None. The look-ups
        run in C (``map``): this runs before every forward."""
        if self._columns is None:
            self._columns = (tuple(c for c, _, _, _ in self.entries), tuple(k for _, k, _, _ in self.entries),
                             tuple(o for _, _, o, _ in self.entries), tuple(p for p, _, _ in self.flags),
                             tuple(f for _, f, _ in self.flags), tuple(c for c, _, _ in self.sizes),
                             tuple(n for _, n, _ in self.sizes))
        containers, keys, objects, params, flags, sized, sizes = self._columns
        if any(map(is_not, map(dict.get, containers, keys), objects)):
            return next(what for container, key, obj, what in self.entries if container.get(key) is not obj)
        if any(map(is_not, map(_REQUIRES_GRAD, params), flags)):
            return next(what for param, flag, what in self.flags if param.requires_grad is not flag)
        if any(map(ne, map(len, sized), sizes)):
            return next(what for container, size, what in self.sizes if len(container) != size)
        return None

    def add_path(self, root: nn.Module, path: str, root_name: str) -> Optional[object]:
        """Watch every step of ``path`` (``"encoder.layer.0.fc"`` or ``"fc.weight"``) from ``root``; returns
        the object at its end (None, watching nothing, where ``root`` has no layer or parameter there)."""
        steps: List[Tuple[dict, str, object, str]] = []
        module: object = root
        parts = path.split(".") if path else []
        for k, part in enumerate(parts):
            if not isinstance(module, nn.Module):
                return None
            name = ".".join(parts[:k + 1])
            if part in module._modules:
                container, kind = module._modules, "layer"
            elif part in module._parameters:
                container, kind = module._parameters, "parameter"
            else:
                return None
            obj = container[part]
            steps.append((container, part, obj, f"{kind} '{name}' of {root_name} was replaced"))
            module = obj
        self._extend(steps)
        return module

    def add_subtree(self, module: nn.Module, name: str, root_name: str, sizes: bool = True) -> None:
        """Watch every layer and parameter inside ``module`` (named ``name`` in ``root_name``); with ``sizes``
        also that none is added (a forward that looks for one, ``if self.extra is not None``)."""
        prefix = f"{name}." if name else ""
        steps = []
        for sub_name, sub in module.named_modules(remove_duplicate=True):
            at = prefix + (f"{sub_name}." if sub_name else "")
            for key, child in sub._modules.items():
                steps.append((sub._modules, key, child, f"layer '{at}{key}' of {root_name} was replaced"))
            for key, param in sub._parameters.items():
                steps.append((sub._parameters, key, param, f"parameter '{at}{key}' of {root_name} was replaced"))
            if sizes:
                self._columns = None
                where = at[:-1] or "the model"
                self.sizes.append((sub._modules, len(sub._modules),
                                   f"a layer was added to or removed from '{where}' of {root_name}"))
                self.sizes.append((sub._parameters, len(sub._parameters),
                                   f"a parameter was added to or removed from '{where}' of {root_name}"))
        self._extend(steps)

    def add_frozen(self, param: nn.Parameter, name: str) -> None:
        """Watch that the frozen ``param`` (named ``name``) stays frozen."""
        self._columns = None
        self.flags.append((param, param.requires_grad,
                           f"parameter '{name}', frozen when fxdp compiled (or wrapped) the model, was unfrozen"))

    def _extend(self, steps: Iterable[Tuple[dict, str, object, str]]) -> None:
        self._columns = None
        if self._keys is None:
            self._keys = {(id(c), k) for c, k, _, _ in self.entries}
        for step in steps:
            key = (id(step[0]), step[1])
            if key not in self._keys:
                self._keys.add(key)
                self.entries.append(step)


__all__ = ["StructureWatch"]
