"""Guards on the compile-time assumptions of a compiled model, checked at every forward.

The batch_dim analysis ran on some input shapes; the layouts it recorded in the sites (where the
batch sits in each layer's input and output, the factors of a merged ``(N*T, d)`` layout, which
inputs carry the batch) hold for those shapes only. A compiled model's graph starts with::

    batch_size = fxdp_runtime_guards_batch_size(self.fxdp_batch, x, mask)

:func:`batch_size` is the guard. Per forward it costs a shape signature of the inputs and a dict
lookup: for a signature seen before, the sites get back the layouts analysed for it; for a new one
the compiler's callback (:attr:`BatchSource.reanalyse`) re-runs the batch_dim analysis on these
shapes, refuses the model if it no longer holds (an fxdp error naming the node and the user's line)
and records the new layouts. A layout that no longer holds is never read.

One exception: a graph torch.export captured with a symbolic batch size (every size the model's code
computes from the batch stays a formula of it, not a number) runs the same ops on every batch size.
Its layouts analysed for one batch size of two or more hold for every other one (they record where the
batch sits and the static sizes merged with it, never the batch size itself), so a new batch size with
otherwise the same shapes reuses them instead of re-running the analysis (:attr:`BatchSource.symbolic_batch`).

It also checks that no parameter frozen at compile time and used where no site records it became
trainable, and numbers the forward calls, so that the sink keeps the rows of two forward calls
before one backward apart (in call order).

The runtime imports no pass: the analysis is the compiler's callback, stored as a module-level
function so that a compiled model still pickles.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxdp.diagnostics import FxdpError, ModelChangedError, UnsupportedInputError
from fxdp.runtime.structure import StructureWatch

_MAX_SIGNATURES = 256  # analysed shape signatures kept per model (oldest dropped first)


class TrainabilityChangedError(ModelChangedError):
    """A parameter frozen at compile time is trainable now, and the compiled graph records no
    per-sample gradient for (some of) its uses (the compiled model is compiled again before a forward where
    that happens; this guard is what remains should the graph's code run without it)."""


@dataclass
class FrozenUse:
    """A parameter that was frozen at compile time, used by an op that has no per-sample site."""

    name: str
    param: nn.Parameter = field(repr=False)
    node: str
    where: str  # "file.py:12 (code)" of the user's line, or ""


@dataclass
class BatchSource:
    """Which model input carries the batch and in which dimension, and the guard's state.

    ``reanalyse(source, inputs)`` (set by the compiler) re-runs the batch_dim analysis for the shapes
    of ``inputs``, updates the sites' layouts (and ``input_index``/``dim``) or raises; ``context`` is
    what it needs (the analysed graph, batch_dim, ...). ``sites`` are the model's sites.
    """

    input_index: int
    dim: int
    reanalyse: Optional[Callable[["BatchSource", Tuple[Any, ...]], None]] = field(default=None, repr=False)
    context: Any = field(default=None, repr=False)
    sites: List[Any] = field(default_factory=list, repr=False)
    frozen: List[FrozenUse] = field(default_factory=list, repr=False)
    calls: int = 0  # forward calls so far: which call a capture belongs to
    folded: Dict[str, List[str]] = field(default_factory=dict, repr=False)  # a site's inputs after folding
    current: Any = field(default=None, repr=False)  # the signature the sites' layouts hold for
    # For a graph symbolic in the batch size (torch.export's capture, fxdp.frontends.export.SymbolicBatch):
    # ``inputs``, which inputs carry the batch (in dimension ``dim``), and ``admits(n)``, whether batch size n
    # meets what the capture assumed of it. Layouts analysed for one admitted batch size then hold for every
    # other one, which needs no second analysis. None: every new shape is analysed.
    symbolic_batch: Any = field(default=None, repr=False)
    _seen: "OrderedDict[Any, tuple]" = field(default_factory=OrderedDict, repr=False)
    # What the graph was compiled from (its layers and parameters, which frozen parameters it cannot train),
    # checked before every forward (fxdp.runtime.module.CompiledGraphModule.__call__); on a change, ``rebuild(model,
    # why, args, kwargs)`` (set by the compiler) compiles the model again in place, or raises.
    watch: Optional[StructureWatch] = field(default=None, repr=False)
    rebuild: Optional[Callable[[Any, str, tuple, dict], None]] = field(default=None, repr=False)
    # A graph torch.export captured holds the sizes other than the batch's (a sequence length): for inputs of
    # other sizes, ``recapture(model, args, kwargs)`` (set by the compiler) puts in the graph captured for them
    # (captured now, or earlier and kept), before the forward runs.
    recapture: Optional[Callable[[Any, tuple, dict], None]] = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"BatchSource(input {self.input_index}, dim {self.dim})"

    def fxdp_relink(self, model) -> None:
        """A copy of the compiled model (deepcopy, pickle) holds a copy of this guard: the report the first
        batch's analysis updates is the copy's own (the context drops its model when copied)."""
        relink = getattr(self.context, "fxdp_relink", None)
        if callable(relink):  # the compiler's context: it also watches the copy's own layers
            relink(model, self)
        elif self.context is not None and hasattr(self.context, "compiled"):
            self.context.compiled = model

    def before_forward(self, model, args: tuple, kwargs: dict) -> None:
        """Compile ``model`` again (or refuse) if it changed since it was compiled (see ``watch``); put in the
        graph captured for these input sizes (see ``recapture``)."""
        if self.watch is not None and self.rebuild is not None:
            why = self.watch.changed()
            if why is not None:
                self.rebuild(model, why, args, kwargs)
        if self.recapture is not None:
            self.recapture(model, args, kwargs)

    def size_of(self, inputs: Tuple[Any, ...]) -> int:
        x = inputs[self.input_index]
        if not isinstance(x, torch.Tensor):
            raise UnsupportedInputError(
                f"fxdp: model input {self.input_index} was recorded as the one carrying the batch, "
                f"but it is a {type(x).__name__} at run time"
            )
        return x.shape[self.dim]

    # -- signatures --------------------------------------------------------------------------

    def remember(self, signature, inputs: Optional[Tuple[Any, ...]] = None) -> None:
        """The sites' layouts (and the batch source) now hold for ``signature`` (the signature of
        ``inputs``, which are given where a symbolic batch may let other batch sizes reuse them): keep them."""
        self._remember(signature, None if inputs is None else self._batch_free_key(inputs))

    def _remember(self, signature, key: Optional[tuple]) -> None:
        self._seen[signature] = (self.input_index, self.dim,
                                 [(site.layouts, site.out_layouts) for site in self.sites], key)
        self._seen.move_to_end(signature)
        while len(self._seen) > _MAX_SIGNATURES:
            self._seen.popitem(last=False)
        self.current = signature

    def _restore(self, signature) -> None:
        self.input_index, self.dim, layouts = self._seen[signature][:3]
        for site, (ins, outs) in zip(self.sites, layouts):
            site.layouts, site.out_layouts = ins, outs  # replaced, never mutated: running calls keep theirs
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
        return next((signature for signature, entry in reversed(self._seen.items())
                     if len(entry) > 3 and entry[3] == key), None)

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
            self._restore(analysed)  # the batch source of an entry with this key: the key holds for it
            self._remember(signature, key)
        elif self.reanalyse is not None:
            self.current = None  # until the analysis succeeds, these layouts hold for nothing
            self.reanalyse(self, inputs)
            self.remember(signature, inputs)


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
    shape guard read mutable state (the model's layers, the layouts analysed so far) that a traced copy would
    fold into constants, checked afterwards only as far as torch.compile's own guards happen to cover it. Under
    torch.compile this is a graph break (one per forward for each check), under torch.fx tracing it is traced."""
    if torch.compiler.is_dynamo_compiling():
        from torch._dynamo import disable  # (loaded already: torch.compile is running)

        return disable(fn, recursive=True)(*args)
    return fn(*args)


def batch_size(source: BatchSource, *inputs) -> int:
    """The guard, then the number of samples in this forward call (see the module docstring), run eagerly
    under torch.compile (:func:`run_eagerly`)."""
    return run_eagerly(_guarded_batch_size, source, *inputs)


def _guarded_batch_size(source: BatchSource, *inputs) -> int:
    """Without grad mode no DP-aware op records anything (evaluation), so nothing needs guarding."""
    if torch.is_grad_enabled():
        source.check(inputs)
    source.calls += 1
    return source.size_of(inputs)


def forward_call(site) -> int:
    """The number of the forward call a site is running in (called once per call of the site). A site
    without a guard (the whole-model op) is called once per forward: it counts its own calls."""
    guard = getattr(site, "guard", None)
    if guard is not None:
        return guard.calls
    site.calls += 1
    return site.calls


__all__ = ["BatchSource", "FrozenUse", "TrainabilityChangedError", "batch_size", "forward_call", "input_signature",
           "run_eagerly"]
