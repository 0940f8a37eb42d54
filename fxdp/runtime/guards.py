"""Guards on the compile-time assumptions of a compiled model, checked at every forward.

The batch_dim analysis ran on some input shapes; the layouts it recorded in the sites (where the
batch sits in each layer's input and output, the factors of a merged ``(N*T, d)`` layout, which
inputs carry the batch) hold for those shapes only. A compiled model's graph starts with::

    batch_size = fxdp_runtime_guards_batch_size(self.fxdp_batch_guard, x, mask)

:func:`batch_size` runs the model's :class:`BatchGuard` (``fxdp_batch_guard``). Per forward it costs a
shape signature of the inputs and a dict lookup: for a signature seen before, the sites get back the
layouts analysed for it; for a new one the batch guard asks its :class:`Reanalysis` for the layouts of these
shapes (it re-runs the batch_dim analysis, and refuses the model if it no longer holds, with an fxdp error
naming the node and the user's line) and records them. A layout that no longer holds is never read.

One exception: a graph torch.export captured with a symbolic batch size (every size the model's code
computes from the batch stays a formula of it, not a number) runs the same ops on every batch size.
Its layouts analysed for one batch size of two or more hold for every other one (they record where the
batch sits and the static sizes merged with it, never the batch size itself), so a new batch size with
otherwise the same shapes reuses them instead of re-running the analysis (:attr:`BatchGuard.symbolic_batch`).

It also checks that no parameter frozen at compile time and used where no site records it became
trainable, and numbers the forward calls, so that the sink keeps the rows of two forward calls
before one backward apart (in call order). The guards of a graph torch.export captured are here too:
:class:`ExportShapeGuard` (the sizes the graph holds) and :class:`CapturedModeGuard` (dropout it keeps on).

The runtime imports no pass: :class:`Reanalysis` is the typed interface of the compile-time work a guard
asks for; :mod:`fxdp.passes.reanalyse` implements it (an object the compiled model holds, so that it
still pickles).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import sympy
import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxdp.diagnostics import (ExportModeError, ExportShapeError, FxdpError, TrainabilityChangedError,
                              UnsupportedInputError)
from fxdp.layout import BatchLayout
from fxdp.runtime.structure import StructureWatch

GUARD_ATTR = "fxdp_batch_guard"  # where a compiled model holds its BatchGuard (its graph's code reads it)
_MAX_SIGNATURES = 256  # analysed shape signatures kept per model (oldest dropped first)


@dataclass
class FrozenUse:
    """A parameter that was frozen at compile time, used by an op that has no per-sample site."""

    name: str
    param: nn.Parameter = field(repr=False)
    node: str
    where: str  # "file.py:12 (code)" of the user's line, or ""


@dataclass(frozen=True)
class AnalysedLayouts:
    """What the batch_dim analysis found for one shape signature: which input carries the batch, in which
    dimension, and per site (in the order of :attr:`BatchGuard.sites`) its input and output layouts. The
    lists are the sites' own and never mutated: a running call keeps the ones it read."""

    input_index: int
    dim: int
    sites: Tuple[Tuple[Sequence[BatchLayout], Sequence[BatchLayout]], ...]


@runtime_checkable
class Reanalysis(Protocol):
    """The compile-time work a :class:`BatchGuard` asks for before a forward (implemented by
    :class:`fxdp.passes.reanalyse.GraphReanalysis`; the runtime imports no pass)."""

    original: Optional[nn.Module]  # the model compiled (the compiled graph shares its layers and parameters)

    def layouts_for(self, guard: "BatchGuard", inputs: Tuple[Any, ...]) -> AnalysedLayouts:
        """The layouts of ``guard``'s sites for the shapes of ``inputs`` (not analysed yet); raises an fxdp
        error where per-sample gradients would be wrong for them."""

    def rebuild(self, model: nn.Module, why: str, args: tuple, kwargs: dict) -> None:
        """``model`` changed since it was compiled (``why``, found by :attr:`BatchGuard.watch`): compile it again
        in place, or raise."""

    def recapture(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """For a graph torch.export captured: put in the graph captured for the sizes of these inputs."""

    def relink(self, model: nn.Module, guard: "BatchGuard") -> None:
        """``model`` is a copy of the compiled model (deepcopy, pickle) holding ``guard``: its own report and
        its own layers are the ones to update and watch."""


@dataclass
class SymbolicBatch:
    """Which inputs of a captured graph carry the batch (placeholders, in order), and what torch.export
    assumed of the batch size: its range and the conditions it recorded (``Eq(Mod(7*s0, s1), 0)``,
    ``Eq(s1, s0)``, a divisibility a reshape needs), over the symbols that stand for it. A batch size that
    meets them runs the very ops the graph holds, every size computed from it by the same formula
    (``fxdp.frontends.export.symbolic_batch`` finds it)."""

    inputs: Tuple[bool, ...]
    symbols: Tuple[Any, ...]  # sympy symbols of the batch size
    lower: int
    upper: Optional[int]
    conditions: Tuple[Any, ...]  # sympy relations over ``symbols``

    def admits(self, n: int) -> bool:
        if n < self.lower or (self.upper is not None and n > self.upper):
            return False
        values = {symbol: n for symbol in self.symbols}
        return all(condition.xreplace(values) is sympy.true for condition in self.conditions)


@dataclass
class BatchGuard:
    """The batch guard of a compiled model (its ``fxdp_batch_guard``): which model input carries the batch and in
    which dimension, the sites whose layouts it keeps right for the input shapes of each forward, and what
    it checks before a forward.

    ``reanalysis`` (set by the compiler) gives the layouts of shapes not analysed yet, and compiles the
    model again where it changed; ``sites`` are the model's sites.
    """

    input_index: int
    dim: int
    reanalysis: Optional[Reanalysis] = field(default=None, repr=False)
    sites: List[Any] = field(default_factory=list, repr=False)
    frozen: List[FrozenUse] = field(default_factory=list, repr=False)
    calls: int = 0  # forward calls so far: which call a capture belongs to
    # ``calls`` as a tensor, what code compiled by torch.compile reads (an int it would specialise on, and compile
    # again at every forward); see fxdp/runtime/compiled_delivery.py
    call_number: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    folded: Dict[str, List[str]] = field(default_factory=dict, repr=False)  # a site's inputs after folding
    current: Any = field(default=None, repr=False)  # the signature the sites' layouts hold for
    # For a graph symbolic in the batch size (torch.export's capture): layouts analysed for one admitted batch
    # size then hold for every other one, which needs no second analysis. None: every new shape is analysed.
    symbolic_batch: Optional[SymbolicBatch] = field(default=None, repr=False)
    _seen: "OrderedDict[Any, Tuple[AnalysedLayouts, Optional[tuple]]]" = field(default_factory=OrderedDict,
                                                                                 repr=False)
    # What the graph was compiled from (its layers and parameters, which frozen parameters it cannot train),
    # checked before every forward (fxdp.runtime.module.CompiledGraphModule.__call__); on a change,
    # ``reanalysis.rebuild`` compiles the model again in place, or raises.
    watch: Optional[StructureWatch] = field(default=None, repr=False)
    batch_size: Optional[int] = None  # the number of samples in the last forward (what the loss probe judges)

    def __repr__(self) -> str:
        return f"BatchGuard(input {self.input_index}, dim {self.dim})"

    def fxdp_relink(self, model) -> None:
        """A copy of the compiled model (deepcopy, pickle) holds a copy of this guard: the report the first
        batch's analysis updates is the copy's own (the reanalysis drops its model when copied)."""
        if self.reanalysis is not None:
            self.reanalysis.relink(model, self)

    def before_forward(self, model, args: tuple, kwargs: dict) -> None:
        """Compile ``model`` again (or refuse) if it changed since it was compiled (see ``watch``); put in the
        graph captured for these input sizes (see :meth:`Reanalysis.recapture`)."""
        reanalysis = self.reanalysis
        if reanalysis is None:
            return
        if self.watch is not None:
            why = self.watch.changed()
            if why is not None:
                reanalysis.rebuild(model, why, args, kwargs)
        reanalysis.recapture(model, args, kwargs)

    def size_of(self, inputs: Tuple[Any, ...]) -> int:
        return batch_size_of(inputs, self.input_index, self.dim)

    # -- signatures --------------------------------------------------------------------------

    def remember(self, signature, inputs: Optional[Tuple[Any, ...]] = None) -> None:
        """The sites' layouts (and the batched input) now hold for ``signature`` (the signature of
        ``inputs``, which are given where a symbolic batch may let other batch sizes reuse them): keep them."""
        self._remember(signature, None if inputs is None else self._batch_free_key(inputs))

    def layouts(self) -> AnalysedLayouts:
        """The layouts the sites hold now."""
        return AnalysedLayouts(self.input_index, self.dim,
                               tuple((site.layouts, site.out_layouts) for site in self.sites))

    def _remember(self, signature, key: Optional[tuple]) -> None:
        self._seen[signature] = (self.layouts(), key)
        self._seen.move_to_end(signature)
        while len(self._seen) > _MAX_SIGNATURES:
            self._seen.popitem(last=False)
        self.current = signature

    def _apply(self, layouts: AnalysedLayouts) -> None:
        self.input_index, self.dim = layouts.input_index, layouts.dim
        for site, (ins, outs) in zip(self.sites, layouts.sites):
            site.layouts, site.out_layouts = ins, outs  # replaced, never mutated: running calls keep theirs

    def _restore(self, signature) -> None:
        self._apply(self._seen[signature][0])
        self._seen.move_to_end(signature)
        self.current = signature

    def _batch_free_key(self, inputs: Tuple[Any, ...]) -> Optional[tuple]:
        """The inputs' signature with the batch size left out, where the graph is symbolic in it and admits
        this batch size (two samples or more: a batch of one or none is analysed on its own, since with one
        sample a layout can be ambiguous); None otherwise."""
        if self.symbolic_batch is None:
            return None
        mask = self.symbolic_batch.inputs
        if len(inputs) != len(mask):
            return None
        key, sizes = [], set()
        for x, batched in zip(inputs, mask):
            if batched:
                if not isinstance(x, torch.Tensor) or x.dim() <= self.dim:
                    return None
                sizes.add(x.shape[self.dim])
                key.append(x.shape[:self.dim] + (-1,) + x.shape[self.dim + 1:])
            else:
                key.append(_leaf_signature(x))
        if len(sizes) != 1 or not self.symbolic_batch.admits(sizes.pop()):
            return None
        return tuple(key)

    def _analysed_with(self, key: Optional[tuple]):
        """A remembered signature with this batch-free ``key``, whose layouts then hold for every input of that
        key: the same shapes but for the batch size, in a graph symbolic in it (see ``symbolic_batch``); None
        if there is none."""
        if key is None:
            return None
        return next((signature for signature, (_, seen_key) in reversed(self._seen.items()) if seen_key == key), None)

    def check(self, inputs: Tuple[Any, ...]) -> None:
        if any(isinstance(x, torch.fx.Proxy) for x in inputs):
            # re-tracing would inline this call as shape arithmetic: the compiled model would lose its guards
            raise FxdpError("fxdp: a compiled model cannot be traced again by torch.fx (its guards would be lost); "
                            "trace or pickle the original model and compile the copy with fxdp.compile_for_dp")
        for use in self.frozen:
            if use.param.requires_grad:
                raise TrainabilityChangedError(
                    f"fxdp: parameter '{use.name}' was frozen (requires_grad=False) when the model was compiled "
                    f"and is trainable now, but the compiled graph records no per-sample gradient for its use "
                    f"at node '{use.node}'{' (' + use.where + ')' if use.where else ''}: its p.grad would have no "
                    "p.grad_sample. Compile the model again after changing which parameters are trainable "
                    "(or freeze it again).")
        signature = input_signature(inputs)
        if signature == self.current:
            return
        if signature in self._seen:
            self._restore(signature)
        elif (analysed := self._analysed_with(key := self._batch_free_key(inputs))) is not None:
            self._restore(analysed)  # the batched input of an entry with this key: the key holds for it
            self._remember(signature, key)
        elif self.reanalysis is not None:
            self.current = None  # until the analysis succeeds, these layouts hold for nothing
            self._apply(self.reanalysis.layouts_for(self, inputs))
            self.remember(signature, inputs)


def batch_size_of(inputs: Tuple[Any, ...], input_index: int, dim: int) -> int:
    """The size of dimension ``dim`` of input ``input_index``: the batch size where that input carries the batch."""
    x = inputs[input_index]
    if not isinstance(x, torch.Tensor):
        raise UnsupportedInputError(
            f"fxdp: model input {input_index} was recorded as the one carrying the batch, "
            f"but it is a {type(x).__name__} at run time"
        )
    return x.shape[dim]


def _leaf_signature(x) -> Any:
    if isinstance(x, torch.Tensor):
        return x.shape
    if x is None or isinstance(x, (bool, int, float, str)):
        return x  # a Python number can steer shapes (reshape(N * T, ...)); it is part of the signature
    return type(x)


def input_signature(inputs: Tuple[Any, ...]) -> tuple:
    """The shapes (and plain Python values) of the inputs: what the layouts depend on."""
    if all(isinstance(x, torch.Tensor) for x in inputs):
        return tuple(x.shape for x in inputs)
    leaves, spec = pytree.tree_flatten(inputs)
    return (str(spec), *(_leaf_signature(x) for x in leaves))


def run_eagerly(fn: Callable, *args):
    """``fn(*args)``, run as Python on every call, also inside ``torch.compile``: the structure watch and the
    batch guard read mutable state (the model's layers, the layouts analysed so far) that a traced copy would
    fold into constants, checked afterwards only as far as torch.compile's own guards happen to cover it. Under
    torch.compile this is a graph break (one per forward for each check), under torch.fx tracing it is traced."""
    if torch.compiler.is_dynamo_compiling():
        from torch._dynamo import disable  # (loaded already: torch.compile is running)

        return disable(fn, recursive=True)(*args)
    return fn(*args)


def batch_size(guard: BatchGuard, *inputs) -> int:
    """The batch guard, then the number of samples in this forward call (see the module docstring), run eagerly
    under torch.compile (:func:`run_eagerly`)."""
    return run_eagerly(_guarded_batch_size, guard, *inputs)


def _guarded_batch_size(guard: BatchGuard, *inputs) -> int:
    """Without grad mode no DP-aware op records anything (evaluation), so nothing needs guarding."""
    if torch.is_grad_enabled():
        guard.check(inputs)
    guard.calls += 1
    guard.call_number = torch.tensor(guard.calls)
    guard.batch_size = guard.size_of(inputs)
    return guard.batch_size


def forward_call(site) -> int:
    """The number of the forward call a site is running in (called once per call of the site). A site
    without a guard (the whole-model op) is called once per forward: it counts its own calls."""
    guard = getattr(site, "guard", None)
    if guard is not None:
        return guard.calls
    site.calls += 1
    return site.calls


# ------------------------------------------------------------------------------------------------
# The guards of a graph torch.export captured (fxdp.frontends.export puts them in its graph)
# ------------------------------------------------------------------------------------------------


class ExportShapeGuard(nn.Module):
    """Checks at every forward that the inputs have the sizes the captured graph holds: every size of
    every tensor input as in the example inputs, but the batch dimension, which all batched inputs
    share; and every input that is no tensor (a flag, a number: export builds its value into the graph)
    the value it was captured with. (torch.export's own check is a closure that cannot be pickled; this one can.)"""

    def __init__(self, names: List[str], shapes: List[Optional[Tuple[Optional[int], ...]]], batch_dim: int,
                 model_name: str, values: Optional[List[Any]] = None):
        super().__init__()
        self.names, self.shapes, self.batch_dim, self.model_name = names, shapes, batch_dim, model_name
        self.values = values  # the value of each input that is no tensor (where its shape is None)

    def describe(self) -> str:
        """``input_ids (N, 7), attention_mask (N, 7)``: the shapes the graph runs (N: any batch size), and the values
        it holds of inputs that are no tensor and not None (``flag=True``)."""
        values = getattr(self, "values", None) or [None] * len(self.shapes)
        return ", ".join(f"{name} {tuple('N' if e is None else e for e in shape)}".replace("'", "")
                         if shape is not None else f"{name}={_brief(value)}"
                         for name, shape, value in zip(self.names, self.shapes, values)
                         if shape is not None or value is not None)

    def mismatch(self, inputs) -> Optional[Tuple[str, Any, Any]]:
        """``(input name, shape the graph holds, shape given)`` of the first input that does not fit; None if all do.
        For an input that is no tensor, ``(name, "value <captured>", "value <given>")`` where the value differs."""
        batch = None
        values = getattr(self, "values", None) or [None] * len(self.shapes)  # (a guard pickled before values)
        for name, expected, value, x in zip(self.names, self.shapes, values, inputs):
            if expected is None:
                if getattr(self, "values", None) is not None and not _same_value(value, x):
                    return name, f"value {value!r}", f"value {_brief(x)}"
                continue
            if not isinstance(x, torch.Tensor):
                continue
            fits = x.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, x.shape))
            if fits and expected[self.batch_dim] is None:
                fits = batch is None or x.shape[self.batch_dim] == batch
                batch = x.shape[self.batch_dim]
            if not fits:
                return name, tuple("N" if e is None else e for e in expected), tuple(x.shape)
        return None

    def forward(self, *inputs) -> None:
        found = self.mismatch(inputs)
        if found is not None:
            name, want, shape = found
            if isinstance(want, str):
                raise ExportShapeError(
                    f"fxdp: {self.model_name} was captured with torch.export (torch.fx could not trace it), and the "
                    f"graph holds the {want} of input '{name}' (no tensor: export built it into the graph), but this "
                    f"call gives {shape}. Compile again with example_inputs that give it this value.")
            raise ExportShapeError(
                f"fxdp: {self.model_name} was captured with torch.export (torch.fx could not trace it), and the "
                f"graph holds the sizes the model's code took from the example inputs: input '{name}' must have "
                f"shape {want} (N: the batch size, shared by the batched inputs), but it has "
                f"{shape}. Compile again with example_inputs of the shapes you train with (e.g. pad "
                "every batch to one sequence length).")


class CapturedModeGuard(nn.Module):
    """Refuses a forward in eval mode of a graph captured in training mode whose dropout is not a layer's
    (the ``dropout_p`` of attention, ``F.dropout(x, p, self.training)``): the capture recorded it switched
    on, and ``eval()`` cannot switch it off, so the outputs would silently stay dropped out. (Under
    ``torch.no_grad()`` the compiled model evaluates with the model it was compiled from instead, and this guard
    does not run: :meth:`fxdp.runtime.module.CompiledGraphModule._evaluate_with_the_original`.)"""

    def __init__(self, sites: List[str], model_name: str):
        super().__init__()
        self.sites, self.model_name = sites, model_name

    def forward(self, *inputs) -> None:
        if not self.training:
            raise ExportModeError(
                f"fxdp: {self.model_name} was captured with torch.export in training mode, and its graph keeps "
                f"dropout on that eval() cannot switch off: {'; '.join(self.sites)}. Evaluate under torch.no_grad() "
                "(the compiled model then runs the model you compiled, which shares its parameters), or with the "
                "model you compiled itself, or build it with that dropout at 0.")


__all__ = ["GUARD_ATTR", "AnalysedLayouts", "BatchGuard", "CapturedModeGuard", "ExportShapeGuard", "FrozenUse",
           "Reanalysis", "SymbolicBatch", "batch_size", "batch_size_of", "forward_call",
           "input_signature", "run_eagerly"]


def _same_value(captured: Any, given: Any) -> bool:
    """Whether an input that is no tensor has the value it was captured with (of the same type: True is not 1)."""
    if captured is given:
        return True
    if type(captured) is not type(given) or isinstance(given, torch.Tensor):
        return False
    try:
        return bool(captured == given)
    except Exception:  # noqa: BLE001  (a value that cannot be compared: not the one captured)
        return False


def _brief(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
