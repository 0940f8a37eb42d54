"""Which parts of a model no front end captures: when neither torch.fx nor torch.export captures the whole model,
each submodule is traced on its own (torch.fx, symbolically: no inputs needed) to find the untraceable code.

- A module that traces is a *traceable part* (the largest ones are listed, under each untraceable module).
- A module that does not trace, once its untraceable submodules are taken as leaves (called whole), is itself
  an *untraceable part*: its own ``forward`` holds the code the tracer rejects (data-dependent control flow,
  ``.item()``, a loop over a tensor), named with the trace error and the user's line.

An untraceable submodule whose layers do not see the batch where the hooks engine's per-layer rules need it runs
as one op, a *block* (the generic rule, each sample re-run alone, checked against the batch at every forward:
:mod:`fxdp.engines.blocks`); the others, and the model's own ``forward``, keep the per-layer rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple

import torch.fx
from torch import nn

from fxdp.diagnostics.source import SourceLocation, location_from_traceback
from fxdp.frontends.fx import DPTracer, _one_line, _state_restored, is_leaf_layer

ROOT = "<model>"


@dataclass(frozen=True)
class UntraceablePart:
    path: str  # the module's name in the model ("<model>": the model's own forward)
    type_name: str
    reason: str  # the trace error, one line
    location: Optional[SourceLocation]  # the user's line the tracer stopped at

    def describe(self) -> str:
        where = f" at {self.location}" if self.location is not None else ""
        return f"'{self.path}' ({self.type_name}){where}: {self.reason}"


@dataclass(frozen=True)
class Parts:
    untraceable: Tuple[UntraceablePart, ...]
    traceable: Tuple[Tuple[str, str], ...]  # (path, type name) of the largest traceable submodules

    @property
    def blocks(self) -> Tuple[UntraceablePart, ...]:
        """The untraceable submodules (not the model's own forward): each runs as one op."""
        return tuple(p for p in self.untraceable if p.path != ROOT)


class _LeafTracer(DPTracer):
    """torch.fx with some modules called whole (the untraceable submodules found so far)."""

    def __init__(self, leaves: FrozenSet[int]):
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._leaves or super().is_leaf_module(m, module_qualified_name)


def _trace_error(module: nn.Module, leaves: FrozenSet[int] = frozenset()) -> Optional[BaseException]:
    try:
        with _state_restored(module):
            _LeafTracer(leaves).trace(module)
    except Exception as exc:  # noqa: BLE001 - any Python the tracer cannot follow is the finding
        return exc
    return None


def find_parts(model: nn.Module) -> Parts:
    """The untraceable parts of ``model`` (deepest first, the model's own forward last) and its largest
    traceable submodules; see the module docstring."""
    untraceable: List[UntraceablePart] = []
    traceable: List[Tuple[str, str]] = []
    blocks: List[nn.Module] = []

    def visit(path: str, module: nn.Module) -> None:
        if is_leaf_layer(module) or _trace_error(module) is None:
            if any(p.requires_grad for p in module.parameters()):
                traceable.append((path, type(module).__name__))
            return
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)
        own = _trace_error(module, frozenset(id(b) for b in blocks))
        if own is not None:
            untraceable.append(UntraceablePart(path or ROOT, type(module).__name__, _one_line(own),
                                               location_from_traceback(own.__traceback__)))
            if path:
                blocks.append(module)

    visit("", model)
    blocked = [p.path for p in untraceable if p.path != ROOT]
    # a traceable module inside a block runs inside it (as part of the block's op), not as a part of its own
    traceable = [(p, t) for p, t in traceable if not any(p.startswith(b + ".") for b in blocked)]
    return Parts(tuple(untraceable), tuple(traceable))


def describe_parts(parts: Parts, blocks: Tuple[str, ...] = ()) -> List[str]:
    """The compile report's lines: which part is untraceable (module path, reason, line) and the engine of each
    (``blocks``: the untraceable submodules that run as one op)."""
    lines = []
    for part in parts.untraceable:
        if part.path == ROOT:
            lines.append(f"untraceable part {part.describe()}; engine: hooks (its layers' per-layer rules; the model "
                         "is tested against batches of one on its first batch)")
        elif part.path in blocks:
            lines.append(f"untraceable part {part.describe()}; engine: hooks, the block as one op (the generic rule "
                         "over its parameters, each sample re-run alone; every forward checks that the block's output "
                         "for each sample equals that sample's alone)")
        else:
            lines.append(f"untraceable part {part.describe()}; engine: hooks (its layers' per-layer rules; every "
                         "forward checks that its output for each sample equals that sample's alone; it runs as one op "
                         "instead if one of its layers does not see the batch on the first batch)")
    if parts.traceable:
        listed = ", ".join(f"'{p}' ({t})" for p, t in parts.traceable)
        lines.append(f"traceable parts (torch.fx traces them alone): {listed}; engine: hooks (per-layer rules)")
    return lines
