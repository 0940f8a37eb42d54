"""What fxdp supports, read from its three registries: per layer class, whether it has a per-sample rule
(:mod:`fxdp.grad_sample`), a book-keeping plan (:mod:`fxdp.sinks.bookkeeping`: norms and clipped sums without
materialising per-sample gradients) and a batch rule (:mod:`fxdp.passes.batch_rules`: where the batch goes through
the layer when the graph calls it whole). The built-in layer families register the three side by side
(:mod:`fxdp.layers`, :func:`fxdp.register_layer`). ``fxdp layers`` prints the table; docs/layers.md holds it (a test
keeps the two equal).

A layer with none of the three may still be supported: the graph engine traces into it and handles the ops it is
made of (an ``nn.Sequential``, a user's block), and the generic rule covers what no rule names (docs/per_sample.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import fxdp.layers  # noqa: F401  (the built-in layer families: per-sample rules, book-keeping, batch rules)
import fxdp.passes.batch_rules  # noqa: F401  (the batch rules of ops and of layers without parameters)
from fxdp.grad_sample.registry import GRAD_SAMPLERS
from fxdp.passes.batch_rules.core import LAYER_RULES
from fxdp.registry import TypeRegistry
from fxdp.sinks.bookkeeping.registry import BOOKKEEPING

COLUMNS = ("per-sample rule", "book-keeping plan", "batch rule")


@dataclass(frozen=True)
class LayerSupport:
    """One layer class and which of the three registries name it."""

    layer: str  # the class's dotted name (as the library that defines it spells it)
    per_sample_rule: bool
    bookkeeping_plan: bool
    batch_rule: bool


def _name(cls: type) -> str:
    module = cls.__module__
    if module.startswith("torch.nn.modules."):  # torch.nn.modules.linear.Linear -> torch.nn.Linear
        module = "torch.nn"
    return f"{module}.{cls.__qualname__}"


def _names(registry: TypeRegistry) -> List[str]:
    """The layers ``registry`` names: its classes, and the classes it names by dotted path (whether or not their
    library was imported)."""
    return [_name(cls) for cls in registry.entries] + list(registry.by_path)


def supported_layers() -> List[LayerSupport]:
    """Every layer class one of the three registries names, sorted by name."""
    has: Dict[str, List[bool]] = {}
    for column, registry in enumerate((GRAD_SAMPLERS, BOOKKEEPING, LAYER_RULES)):
        for name in _names(registry):
            has.setdefault(name, [False, False, False])[column] = True
    return [LayerSupport(name, *flags) for name, flags in sorted(has.items(), key=lambda kv: kv[0].lower())]


def layers_table() -> str:
    """:func:`supported_layers` in Markdown: a table of the layers with a per-sample rule or a book-keeping plan
    (those with parameters fxdp computes per-sample gradients of as a whole), then the layers with a batch rule
    only (activations, pooling, losses, ...: no parameter, or parameters the graph engine traces into)."""
    rows = [f"| layer | {' | '.join(COLUMNS)} |", "|---|" + "---|" * len(COLUMNS)]
    batch_only = []
    for s in supported_layers():
        if not (s.per_sample_rule or s.bookkeeping_plan):
            batch_only.append(f"`{s.layer}`")
            continue
        marks = ["yes" if has else "" for has in (s.per_sample_rule, s.bookkeeping_plan, s.batch_rule)]
        rows.append(f"| `{s.layer}` | {' | '.join(marks)} |")
    return "\n".join(rows) + (f"\n\nWith a batch rule only ({len(batch_only)}; the rule says where the batch goes "
                               f"through the layer, or that it mixes samples, as BatchNorm in training does, which "
                               f"is then refused): {', '.join(batch_only)}.\n")


__all__ = ["COLUMNS", "LayerSupport", "layers_table", "supported_layers"]
