""":func:`register_layer`: everything fxdp must know about a layer class, in one call.

fxdp knows a layer class through three registries, one per question:

- its **per-sample rule** (``grad_sampler``; :mod:`fxdp.grad_sample.registry`): ``fn(module, activations,
  backprops) -> {param: grad_sample}``, the hooks engine's rule, and the graph engine's for a layer it calls whole;
- its **book-keeping registration** (``bookkeeping``; :mod:`fxdp.sinks.bookkeeping.registry`): a
  :class:`~fxdp.sinks.bookkeeping.LayerBookkeeping` (subclass or instance) that plans the layer and forms its
  per-sample norms and clipped sums from (A, G) without materialising per-sample gradients;
- its **batch rule** (``batch_rule``; :mod:`fxdp.passes.batch_rules`): ``rule(call) -> Verdict``, where the batch
  goes through the layer, or that the layer mixes samples, when the graph calls it whole.

``register_layer`` registers the ones given, for the classes given (and the classes of libraries fxdp does not
import, by dotted path, once their module is imported), each in its registry: a layer family's three
registrations sit side by side in one module (the built-in ones in ``fxdp/layers/<family>.py``), and a new layer
is one call in one file. Every argument is checked before anything is registered. The registries stay the ones
the engines, the sinks and the passes read, so :func:`fxdp.register_grad_sampler`,
:func:`fxdp.sinks.bookkeeping.register_bookkeeping` and :func:`fxdp.register_batch_rule` keep working and register
into the same places; the last registration for a class wins in each.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Type, Union

from torch import nn

from fxdp.grad_sample.registry import GRAD_SAMPLERS
from fxdp.passes.batch_rules.core import LAYER_RULES
from fxdp.registry import as_types
from fxdp.sinks.bookkeeping.registry import BOOKKEEPING, LayerBookkeeping

Layers = Union[Type[nn.Module], Iterable[Type[nn.Module]]]


def register_layer(layers: Layers = (), *, by_path: Union[str, Iterable[str]] = (),
                   grad_sampler: Optional[Callable] = None,
                   bookkeeping: Union[None, LayerBookkeeping, Type[LayerBookkeeping]] = None,
                   batch_rule: Optional[Callable] = None, subclasses: bool = False) -> None:
    """Register a layer class's per-sample rule, book-keeping registration and batch rule, side by side.

    ``layers``: an ``nn.Module`` subclass or a list of them; ``by_path``: dotted paths (``"transformers.
    pytorch_utils.Conv1D"``) of classes of a library fxdp does not import, registered once their module is
    imported. ``grad_sampler``: ``fn(module, activations, backprops) -> {param: grad_sample}`` (as
    :func:`fxdp.register_grad_sampler` decorates); ``bookkeeping``: a :class:`LayerBookkeeping` subclass (one
    instance is made) or instance; ``batch_rule``: ``rule(call: OpCall) -> Verdict`` (as
    :func:`fxdp.register_batch_rule` decorates). Give at least one of the three. ``subclasses=True``: the
    registrations serve every subclass, even one that overrides ``forward`` (by default such a subclass computes
    something else and is not served).

    A layer with a per-sample rule and no batch rule is still analysed by the graph engine: it is taken to keep
    the batch where its input has it (docs/batch_dim.md)."""
    targets, paths = as_types(layers), as_types(by_path)
    problems = [f"{t!r} is not an nn.Module subclass" for t in targets
                if not (isinstance(t, type) and issubclass(t, nn.Module))]
    problems += [f"by_path={p!r} is not a dotted class path ('module.ClassName')" for p in paths
                 if not (isinstance(p, str) and "." in p)]
    if not targets and not paths:
        problems.append("no layer class given (layers=... or by_path=...)")
    if grad_sampler is None and bookkeeping is None and batch_rule is None:
        problems.append("none of grad_sampler=, bookkeeping=, batch_rule= given")
    for name, value in (("grad_sampler", grad_sampler), ("batch_rule", batch_rule)):
        if value is not None and not callable(value):
            problems.append(f"{name}={value!r} is not callable")
    if isinstance(bookkeeping, type) and issubclass(bookkeeping, LayerBookkeeping):
        bookkeeping = bookkeeping()
    elif bookkeeping is not None and not isinstance(bookkeeping, LayerBookkeeping):
        problems.append(f"bookkeeping={bookkeeping!r} is neither a LayerBookkeeping subclass nor an instance of one")
    if problems:
        raise TypeError("fxdp.register_layer: " + "; ".join(problems) + ". Nothing was registered.")
    for registry, value in ((GRAD_SAMPLERS, grad_sampler), (BOOKKEEPING, bookkeeping), (LAYER_RULES, batch_rule)):
        if value is None:
            continue
        if targets:
            registry.register(targets, subclasses=subclasses)(value)
        for path in paths:
            registry.register_by_path(path, subclasses=subclasses)(value)
