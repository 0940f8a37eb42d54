"""One registration per book-kept layer type: how the book-keeping sink plans the layer (which parameters, which
method at what cost), how it forms their per-sample squared norms and clipped sums from (A, G), and, where
it can, how the layer runs forward so that backward computes its input gradient alone. Side by side in one
class, as fastDP keeps a layer type's norm and clipping together and BackPACK maps ``module_exts``.

A registration is a :class:`LayerBookkeeping` subclass decorated with :func:`register_bookkeeping`, which
registers one instance of it for

- layer classes, looked up along the class's MRO (:class:`~fxdp.registry.TypeRegistry`): a subclass that
  overrides ``forward`` computes something else and is not served;
- classes of a library fxdp does not import, by dotted path (``by_path``: transformers' ``Conv1D``);
- torch functions and Tensor methods that use a parameter directly (``functions``: ``x + self.pos``), for the
  compile report's plans.

A registration applies to a layer only while the layer's per-sample rule is the one its formulas reproduce
(:attr:`LayerBookkeeping.rule`; a user's rule or a parametrization then decides, by materialising). One file
per family here holds the built-in ones (``linear``, ``conv``, ``embedding``, ``norms``, ``transformers_conv1d``,
``recurrent``, ``transformer``, ``broadcast``), and :mod:`fxdp.layers` registers each for its layer classes
beside the layer's per-sample rule and batch rule (``fxdp.register_layer``; ``broadcast`` registers itself, for
functions, not layer classes); docs/bookkeeping_a_new_layer.md adds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.registry import TypeRegistry, as_types
from fxdp.sinks.bookkeeping.uses import Use

METHODS = ("outer", "ghost", "per_sample", "index", "summed", "materialise")

NO_FORM = "no book-keeping registration: per-sample gradients from its rule or the generic rule, materialised"


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's per-sample norms are computed, and why (costs are multiply-adds per sample)."""

    layer: str  # "Linear", "Conv2d", "Embedding", "LayerNorm", "generic", ...
    method: str  # one of METHODS
    reason: str
    ghost_cost: Optional[int] = None
    per_sample_cost: Optional[int] = None


def pick(layer: str, ghost: int, per_sample: int, prefer: Optional[str], what: str) -> LayerPlan:
    """``ghost`` or ``per_sample``, whichever costs fewer multiply-adds per sample (``prefer``, the sink's
    ``method`` argument, forces one); ``what`` says which shapes the costs came from."""
    if prefer in ("ghost", "per_sample"):
        method, reason = prefer, f"{prefer} forced by the sink's method argument"
    elif ghost <= per_sample:
        method, reason = "ghost", f"{what}: ghost norm {ghost:,} <= per-sample gradient {per_sample:,} mult-adds/sample"
    else:
        method, reason = "per_sample", f"{what}: per-sample gradient {per_sample:,} < ghost norm {ghost:,} mult-adds/sample"
    return LayerPlan(layer, method, reason, ghost, per_sample)


@dataclass(frozen=True)
class Captured:
    """One capture as a registration's :meth:`~LayerBookkeeping.uses` reads it. ``a`` and ``g`` are the layer's
    input and output gradient, batch first, in at least float32; ``g`` as delivered, ``scale * g`` being the
    summed loss's (fold ``scale`` into norms, ``scale ** 2``, and clip factors rather than copying ``g``);
    ``params``: the trainable parameters to cover; ``method``: the plan's."""

    module: nn.Module
    params: Tuple[nn.Parameter, ...]
    a: torch.Tensor
    g: torch.Tensor
    scale: float
    method: str


# ``fn(x, *params)``: the layer's output from its input and parameter tensors
FunctionalForward = Tuple[Callable[..., torch.Tensor], Tuple[Optional[torch.Tensor], ...]]


class LayerBookkeeping:
    """How the book-keeping sink treats one layer type. Every method has a default meaning "no book-keeping
    form: materialise through the layer's per-sample rule", so a registration overrides what it has."""

    #: the per-sample rule (``(module, activations, backprops) -> {p: grad_sample}``) whose result these
    #: formulas reproduce: the registration applies only while ``find_grad_sampler(module)`` is this one.
    #: ``None``: :meth:`applies` decides alone.
    rule: Optional[Callable] = None

    #: a registration whose plan is ``materialise`` still has :meth:`uses` called, which may form the per-sample
    #: gradients of small layers together with others alike (:mod:`~fxdp.sinks.bookkeeping.lanes`)
    forms_small_together: bool = False

    def applies(self, module: nn.Module) -> bool:
        """Whether this registration describes ``module`` (its class is served already)."""
        rule = type(self).rule  # (read from the class: the plain function, not a method bound to self)
        return rule is None or find_grad_sampler(module) is rule

    def params(self, module: nn.Module) -> Sequence[Optional[nn.Parameter]]:
        """The parameters :meth:`uses` covers; a capture with another trainable one is materialised whole."""
        return getattr(module, "weight", None), getattr(module, "bias", None)

    def plan(self, module: nn.Module, a: List[int], g: List[int], prefer: Optional[str]) -> LayerPlan:
        """The method for batch-first input shape ``a`` and output gradient shape ``g`` (static shapes only, so
        the compiler can plan from the shapes its batch_dim pass found). ``prefer``: the sink's ``method``
        argument (``"ghost"`` / ``"per_sample"``), for layers with a choice (:func:`pick`)."""
        return LayerPlan(type(module).__name__, "materialise", NO_FORM)

    def uses(self, captured: Captured, sink) -> Optional[Dict[nn.Parameter, Use]]:
        """``{p: use}`` for each of ``captured.params``: a :class:`~fxdp.sinks.bookkeeping.uses.Use` that
        answers ``squared_norms()``, ``clipped_sum(c)`` and ``grad_samples()`` from A and G. ``sink``: the
        :class:`~fxdp.sinks.bookkeeping.BookkeepingSink` (its :meth:`bias_sum` shares work between uses of one
        G). ``None``: materialise through the rule."""
        return None

    def functional_forward(self, module: nn.Module, x: torch.Tensor) -> Optional[FunctionalForward]:
        """``(fn, params)`` with ``fn(x, *params)`` equal to ``module(x)``, so that the DP-aware op can call the
        layer with backward computing the input gradient alone (the sink forms the parameters' gradients);
        ``None``: the layer is called as usual (its parameter gradients are computed and then replaced)."""
        return None

    def graph_plans(self, module: Optional[nn.Module], gm, node, site, n: int,
                    prefer: Optional[str]) -> Optional[List[Tuple[str, LayerPlan]]]:
        """For the compile report: ``(name inside the call, plan)`` of one DP-aware op in the compiled graph
        (``node``, its ``site``, ``n`` the example batch size; ``module`` None for a function using a parameter
        directly). ``None``: plan the call as one layer from the shapes the batch_dim pass recorded; a block
        lists its inner layers (``"self_attn.in_proj"``)."""
        return None


BOOKKEEPING: TypeRegistry[LayerBookkeeping] = TypeRegistry(
    nn.Module, type_error="register_bookkeeping expects nn.Module subclasses, got {!r}", unless_overridden="forward")
_FUNCTIONS: Dict[Any, LayerBookkeeping] = {}  # torch function or Tensor method name -> registration


def register_bookkeeping(layers=(), *, by_path: Sequence[str] = (), functions: Sequence[Any] = ()):
    """Class decorator: register one instance of a :class:`LayerBookkeeping` subclass for ``layers`` (a class
    or a list of classes), the classes named by ``by_path`` (``"module.ClassName"``, registered once that
    module is imported) and ``functions`` (torch functions or Tensor method names using a parameter)."""
    def decorator(cls: type) -> type:
        instance = cls()
        if as_types(layers):
            BOOKKEEPING.register(layers)(instance)
        for path in as_types(by_path):
            BOOKKEEPING.register_by_path(path)(instance)
        for fn in as_types(functions):
            _FUNCTIONS[fn] = instance
        return cls

    return decorator


def find_bookkeeping(module: Optional[nn.Module]) -> Optional[LayerBookkeeping]:
    """The registration that describes ``module`` (walking its class's MRO), or ``None``."""
    if module is None:
        return None
    found = BOOKKEEPING.find(module)
    return found if found is not None and found.applies(module) else None


def find_function_bookkeeping(fn) -> Optional[LayerBookkeeping]:
    """The registration of a torch function or Tensor method name using a parameter, or ``None``."""
    try:
        return _FUNCTIONS.get(fn)
    except TypeError:  # an unhashable callable has no registration
        return None
