"""The compiled module class: what ``compile_for_dp`` returns when it compiles the graph.

A compiled model is a ``torch.fx.GraphModule`` whose class derives from :class:`CompiledGraphModule`
(:func:`make_copyable`): it runs the guards' checks before every forward, answers Opacus's
``_module``, and survives deepcopy, pickle and ``torch.save`` with its report, its sink and its forward
hooks (:class:`OutputType` gives the output the type the model's own forward returns).

Like the rest of the runtime this imports no pass and no front end: the compiler hands it graphs.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import inspect
import pickle
import warnings

import torch
import torch.fx
from torch import nn

from fxdp.diagnostics import FxdpError, UnsupportedInputError
from fxdp.sinks.model_methods import OpacusModelMethods
from fxdp.runtime.guards import GUARD_ATTR, CapturedModeGuard, run_eagerly
from fxdp.runtime.loss_probe import LOSS_WATCH_ATTR, plain


class OutputType:
    """A forward hook giving a compiled model's output the type the model's own forward returns."""

    def __init__(self, cls: type):
        self.cls = cls

    def __call__(self, module, args, output):
        if isinstance(output, dict) and type(output) is not self.cls:
            try:
                return self.cls(**output)
            except TypeError:
                return self.cls(output)
        return None


# -- compiled graphs survive deepcopy, pickle and torch.save ------------------------------------------
#
# torch.fx rebuilds a GraphModule from its code on load and on deepcopy, keeping only the attributes
# the graph uses: a compiled model's report, its sink and its forward hooks (the analysis on the first
# batch) would be lost. A compiled model's class is a subclass of CompiledGraphModule, which carries them.


def _op_overload(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _reduce_op_overload(op):
    return _op_overload, (op.namespace, op._opname, op._overloadname)


# a captured graph's sites hold the ATen ops they call; pickle names them (torch's OpOverload has no reduce)
copyreg.pickle(torch._ops.OpOverload, _reduce_op_overload)


#: Where a model compiled in place (``make_private(compile=...)``: ``nn.Module.compile``) keeps its torch.compile
#: options, so that each copy (deepcopy, pickle) is compiled for itself: the compiled call ``nn.Module.compile``
#: stores is bound to the model it compiled, and a copy holding it would run the original's parameters.
COMPILE_OPTIONS_ATTR = "fxdp_compile_options"

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class CompiledGraphModule(OpacusModelMethods, torch.fx.GraphModule):
    """A GraphModule whose copies (deepcopy, pickle, torch.save) keep every attribute and forward hook.
    ``_module`` and :meth:`to_standard_module` give the model it was compiled from (the same parameters)."""

    def _standard_module(self) -> nn.Module:
        guard = self.__dict__.get(GUARD_ATTR)
        original = getattr(getattr(guard, "reanalysis", None), "original", None)
        return original if original is not None else self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_module":  # Opacus's name for the wrapped model; a submodule of that name comes first
                return self._standard_module()
            raise

    def __call__(self, *args, **kwargs):
        # a model changed since it was compiled (a layer replaced, a parameter unfrozen) is compiled again
        # before its forward runs (fxdp.runtime.structure): the graph's code calls what it was compiled with
        guard = self.__dict__.get(GUARD_ATTR)
        if not self.training and not torch.is_grad_enabled() and _keeps_dropout_on(self):
            return self._evaluate_with_the_original(guard, args, kwargs)
        watch = self.__dict__.get(LOSS_WATCH_ATTR)
        if watch is not None and watch.pending is not None:  # a step in progress is probed: the graph gets tensors
            args, kwargs = plain(args, detach=False), plain(kwargs, detach=False)
        if guard is not None:
            run_eagerly(guard.before_forward, self, args, kwargs)  # (also under torch.compile)
        try:
            output = super().__call__(*args, **kwargs)
        except FxdpError:  # (some are TypeErrors too): already says what to do
            raise
        except TypeError:
            _refuse_inputs_the_graph_does_not_take(self, args, kwargs)
            raise
        if watch is not None and guard is not None and watch.wants(self):  # the first step: the loss is judged
            output = watch.probe(self, output, guard.reanalysis, guard.batch_size)
        return output

    def _evaluate_with_the_original(self, guard, args, kwargs):
        """An evaluation (eval mode, no gradients) of a graph captured in training mode that keeps dropout on
        (:class:`~fxdp.runtime.guards.CapturedModeGuard`: eval() cannot switch it off) runs the model it was
        compiled from, which shares its parameters and layers, in eval mode; the compiled model's hooks (labels
        given to it) still apply. Nothing is trained: no gradient, and no sample reaches the DP step."""
        original = getattr(getattr(guard, "reanalysis", None), "original", None)
        if original is None:  # (a copy that dropped it): the graph's guard refuses eval(), saying what to do
            return super().__call__(*args, **kwargs)
        # all of it in eval mode: the compiled model's eval() reaches only the layers its graph calls (attention
        # blocks whose code the graph inlined keep their mode); every mode is put back after
        modes = [(m, m.training) for m in original.modules()]
        original.eval()
        self.__dict__["forward"] = original
        try:
            return super().__call__(*args, **kwargs)
        finally:
            del self.__dict__["forward"]
            for m, mode in modes:
                m.training = mode

    # torch.fx saves the code and re-traces it on load, which renames the nodes (the DP-aware ops'
    # sites refer to them by name): the graph itself is saved instead.
    def __reduce__(self):
        body = self.__dict__.copy()
        body.pop("_compiled_call_impl", None)  # bound to this model (and not picklable): the copy compiles its own
        original = body.pop("_graph")
        graph = torch.fx.Graph()
        with _quiet_pytree_specs():
            graph._codegen = copy.deepcopy(original._codegen)  # torch.export's: flattens inputs, rebuilds outputs
        graph.output(graph.graph_copy(original, {}))
        for node in graph.nodes:  # analysis results (fake tensors) are not needed to run, nor picklable
            node.meta = {k: v for k, v in node.meta.items() if _picklable(v)}
        return (_rebuild_compiled, (body, graph, type(self).__mro__[1].__name__))

    def __deepcopy__(self, memo):
        with _quiet_pytree_specs():
            res = super().__deepcopy__(memo)
            copied = copy.deepcopy(self.__dict__, memo)  # the objects the copy already holds, via memo
        for key, value in copied.items():
            if key in _HOOK_DICTS or key not in res.__dict__:
                res.__dict__[key] = value
        res.training = self.training
        _relink(res)
        _compile_for_itself(res)
        return res


@contextlib.contextmanager
def _quiet_pytree_specs():
    """Copying torch.export's pytree specs (in a captured graph's code generator) warns about a check
    torch itself makes (``isinstance(treespec, LeafSpec)``, deprecated); the user can do nothing about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        yield


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - anything pickle refuses
        return False
    return True


def _rebuild_compiled(body, graph, class_name):
    with _quiet_pytree_specs():
        return _rebuild(body, graph, class_name)


def _rebuild(body, graph, class_name):
    holder = nn.Module()
    holder.__dict__.update(body)
    gm = make_copyable(torch.fx.GraphModule(holder, graph, class_name))
    for key, value in body.items():  # what the graph does not use (report, sink, hooks, ...)
        if key in _HOOK_DICTS or key not in gm.__dict__:
            gm.__dict__[key] = value
    _relink(gm)
    _compile_for_itself(gm)
    return gm


def compile_module(gm: "CompiledGraphModule", options: dict) -> None:
    """``gm.compile(**options)`` (torch.compile of its call, in place), the options kept for its copies."""
    gm.__dict__[COMPILE_OPTIONS_ATTR] = dict(options)
    gm.compile(**options)


def _compile_for_itself(copied: nn.Module) -> None:
    """A copy of a model compiled in place gets a compiled call of its own (with the options recorded by
    :func:`compile_module`; without them, compiled by hand, the copy runs eagerly), never the original's."""
    copied.__dict__["_compiled_call_impl"] = None
    options = copied.__dict__.get(COMPILE_OPTIONS_ATTR)
    if options is not None:
        copied.compile(**options)


def _relink(gm: torch.fx.GraphModule) -> None:
    """Attributes that refer back to their model (an ``fxdp_relink(model)`` method) point at the copy."""
    for value in list(gm.__dict__.values()):
        relink = getattr(value, "fxdp_relink", None)
        if callable(relink):
            relink(gm)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule running a copy of ``gm``'s graph on the same parameters and layers, with what the
    graph's code reads besides them (torch.export's input and output specs); it copies and pickles as
    compiled models do."""
    with _quiet_pytree_specs():
        graph = copy.deepcopy(gm.graph)
    copied = torch.fx.GraphModule(gm, graph, type(gm).__name__)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(gm, attr):
            setattr(copied, attr, getattr(gm, attr))
    return make_copyable(copied)


def make_copyable(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give ``gm`` (in place) a class derived from :class:`CompiledGraphModule`; returns ``gm``."""
    if not isinstance(gm, CompiledGraphModule):
        # GraphModule gives each instance a class of its own (its forward is set on the class)
        impl = type("GraphModuleImpl", (CompiledGraphModule,), {})
        impl.__qualname__ = "GraphModuleImpl"
        gm.__class__ = impl
        gm.recompile()
    return gm


def _keeps_dropout_on(gm: nn.Module) -> bool:
    return any(isinstance(m, CapturedModeGuard) for m in gm._modules.values())


def _refuse_inputs_the_graph_does_not_take(gm: nn.Module, args: tuple, kwargs: dict) -> None:
    """A call whose inputs the graph's ``forward`` cannot take: a keyword the example inputs did not have, most
    often (torch.export fixes a captured graph's inputs to the example's). Torch's own TypeError names nothing
    to do; this says what was compiled and how to compile for the call."""
    signature = inspect.signature(type(gm).forward)
    try:
        signature.bind(gm, *args, **kwargs)
    except TypeError as exc:
        taken = ", ".join(name for name in signature.parameters if name != "self")
        given = ", ".join([f"{len(args)} positional"] + [f"{name}=" for name in kwargs])
        raise UnsupportedInputError(
            f"fxdp: the compiled model takes the inputs of the example it was compiled from ({taken}); this call "
            f"passes {given} ({exc}). Pass example_inputs in the form your forward calls take (a dict of the "
            "keyword inputs, e.g. example_inputs=dict(input_ids=..., attention_mask=...)) to make_private / "
            "compile_for_dp") from None
