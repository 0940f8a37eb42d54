"""What every engine's wrapper shares: the wrapped model, its gradient sink, ``zero_grad`` that also
clears ``p.grad_sample``, attribute access that falls through to the wrapped model, and the one
backward step of the generic rule on a module's output."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from fxdp.diagnostics import ROOT_NAME, SampleMixingModuleError, UnsupportedModuleError
from fxdp.grad_sample.accumulate import zero_grad_sample
from fxdp.grad_sample.generic import autocast_state, summed_loss_backprops
from fxdp.grad_sample.mixing import sample_mixing_modules
from fxdp.layout import BatchLayout
from fxdp.sinks.capture import layer_capture
from fxdp.sinks.contract import SINK_ATTR, GradientSink, GradSampleSink, LayerCapture, check_loss_reduction
from fxdp.sinks.model_methods import OpacusModelMethods


def trainable_own_params(module: nn.Module) -> List[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def has_trainable_params(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


# -- engine hooks live and die with their wrapper ------------------------------------------------------

_OWNER_ATTR = "_fxdp_engine_owner"  # on each hook an engine puts on a model: weakref to its wrapper


def refuse_sample_mixing_modules(model: nn.Module, engine: str) -> None:
    """Raise :class:`~fxdp.errors.SampleMixingModuleError` naming every module of ``model`` that mixes samples in
    the mode it is in now (BatchNorm in training; the rule is :mod:`fxdp.grad_sample.mixing`, the validators'),
    before ``engine`` hooks into the model: no per-sample gradient of such a model is right. One put in training
    mode later is caught by the hooks engine's self-check on its first batch."""
    found = sample_mixing_modules(model)
    if not found:
        return
    errors = [UnsupportedModuleError(message, module_name=name or ROOT_NAME, module_type=type(module), fix=fix)
              for name, module, message, fix in found]
    raise SampleMixingModuleError.aggregate(errors, (
        f"fxdp: {engine} cannot compute per-sample gradients of {type(model).__name__}: {len(errors)} module(s) "
        "mix samples in the mode they are in (fix them, e.g. with fxdp.validators.ModuleValidator.fix(model), "
        "or put them in eval mode with running statistics):"))


class EngineHook:
    """A hook an engine put on a model's module. It holds its wrapper weakly; a copy of the model
    (deepcopy, pickle) gets a dead one, which does nothing and is removed by the next wrapper."""

    def __init__(self, fn: Callable, wrapper: Optional[nn.Module]):
        self.fn = fn
        self._fxdp_engine_owner = weakref.ref(wrapper) if wrapper is not None else _no_owner

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs) if self._fxdp_engine_owner() is not None else None

    def __reduce__(self):
        return (_dead_hook, ())

    def __deepcopy__(self, memo):
        return _dead_hook()


def _no_owner():
    return None


def _dead_hook() -> EngineHook:
    return EngineHook(_no_owner, None)


def mark_engine_hook(fn: Callable, wrapper: nn.Module) -> Callable:
    """``fn`` as a hook of ``wrapper``'s engine, so that a later compile (or a copy) can find it."""
    return EngineHook(fn, wrapper)


def remove_handles(handles: List[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def engine_hooks(model: nn.Module) -> List[Tuple[str, Optional[nn.Module]]]:
    """(module name, live wrapper or None) for every engine hook on ``model`` and its submodules."""
    found = []
    for name, module in model.named_modules():
        for attr in _HOOK_DICTS:
            for fn in getattr(module, attr, {}).values():
                ref = getattr(fn, _OWNER_ATTR, None)
                if ref is not None:
                    found.append((name or "<model>", ref()))
    return found


def remove_dead_engine_hooks(model: nn.Module) -> None:
    """Remove the hooks of wrappers that no longer exist (normally their finalizer already did)."""
    for module in model.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(module, attr, {})
            for key, fn in list(hooks.items()):
                ref = getattr(fn, _OWNER_ATTR, None)
                if ref is not None and ref() is None:
                    del hooks[key]


def user_hooks(module: nn.Module, ignore: Optional[Callable[[Callable], bool]] = None) -> List[str]:
    """What forward/backward hooks the user put on ``module`` itself (not fxdp's engines', nor those
    ``ignore`` accepts)."""
    kinds = []
    for attr in _HOOK_DICTS:
        if any(getattr(fn, _OWNER_ATTR, None) is None and not (ignore is not None and ignore(fn))
               for fn in getattr(module, attr, {}).values()):
            kinds.append(attr.strip("_").replace("_", " ")[:-1])
    return kinds


@contextlib.contextmanager
def without_own_hooks(module: nn.Module):
    """Run ``module.forward`` alone: the generic rule differentiates what ``forward`` returned, the
    module's own hooks act on what flows on (and are in the output gradient already)."""
    saved = {attr: getattr(module, attr) for attr in _HOOK_DICTS if getattr(module, attr, None)}
    for attr in saved:
        setattr(module, attr, type(saved[attr])())
    try:
        yield
    finally:
        for attr, hooks in saved.items():
            setattr(module, attr, hooks)


class ParameterWatch:
    """The parameters of a model that an engine runs as it is at each forward (ew, functorch, the whole-model
    op): a layer or parameter replaced since the last forward is simply used, and the parameters it replaced,
    which an optimizer may still hold, are retired in the sink (a DP optimizer holding one refuses to step:
    noise alone would move it)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.known = {id(p): p for p in model.parameters()}

    def check(self, sink: GradientSink) -> None:
        now = {id(p): p for p in self.model.parameters()}
        if now.keys() != self.known.keys():
            gone = len(self.known.keys() - now.keys())
            if gone:
                sink.retire(self.known.values(), now.values(), f"{gone} parameter(s) of {type(self.model).__name__} "
                                                               "were replaced after it was wrapped, with the layers "
                                                               "that held them")
            self.known = now


class GradSampleModuleBase(OpacusModelMethods, nn.Module):
    """The base of every engine's wrapper; it refuses a model with a module that mixes samples in the mode it is
    in (:func:`refuse_sample_mixing_modules`). ``sink`` receives the per-sample gradients (a fresh
    :class:`~fxdp.sinks.contract.GradSampleSink`, which writes ``p.grad_sample``, by default);
    :func:`fxdp.sinks.contract.sink_of` finds it as attribute ``fxdp_sink``."""

    def __init__(self, model: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean",
                 sink: Optional[GradientSink] = None):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"fxdp: expected an nn.Module to wrap, got {type(model).__name__}")
        check_loss_reduction(loss_reduction)
        refuse_sample_mixing_modules(model, type(self).__name__)
        self._module = model
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        setattr(self, SINK_ATTR, sink if sink is not None else GradSampleSink())
        self._recomputing = False  # the generic rule re-runs modules: forward hooks stand aside meanwhile
        self.forward_calls = 0  # forward calls so far: a capture names its call (LayerCapture.call)

    @property
    def module(self) -> nn.Module:
        return self._module

    def _standard_module(self) -> nn.Module:
        return self._module

    @property
    def batch_dim(self) -> int:
        return 0 if self.batch_first else 1

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        zero_grad_sample(self)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError as outer:
            if name == "_module":
                raise
            try:
                return getattr(self._module, name)
            except AttributeError:
                raise outer from None

    def extra_repr(self) -> str:
        return f"batch_first={self.batch_first}, loss_reduction={self.loss_reduction!r}"

    # -- the backward step ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _recompute(self):
        previous, self._recomputing = self._recomputing, True
        try:
            yield
        finally:
            self._recomputing = previous

    def _to_batch_first(self, activations: List[Any], backprops: torch.Tensor):
        packed = next((a for a in activations if isinstance(a, PackedSequence)), None)
        if packed is not None:  # an RNN fed a PackedSequence: its output gradient is packed like its input
            return activations, backprops, int(packed.batch_sizes[0])
        if self.batch_first:
            return activations, backprops, backprops.shape[0]
        n = backprops.shape[1]
        layout = BatchLayout.at(1)
        moved = [
            layout.to_batch_first(a, n) if isinstance(a, torch.Tensor) and a.dim() >= 2 else a
            for a in activations
        ]
        return moved, layout.to_batch_first(backprops, n), n

    def _output_hook(self, module: nn.Module, activations: List[Any], kwargs: Optional[Mapping[str, Any]] = None,
                     *, generic: bool = False):
        """A hook for ``module``'s output: its gradient, with the module's saved inputs, becomes one
        capture for the sink: the module's hand-written rule's, or the generic rule's (``generic``, or
        no rule), which runs each sample as a batch of one in the module's own layout."""
        call = self.forward_calls
        autocast = autocast_state()  # the forward's, for the generic rule's re-run in backward

        def hook(grad: torch.Tensor) -> None:
            acts, backprops, n = self._to_batch_first(activations, grad)
            backprops = summed_loss_backprops(backprops, self.loss_reduction, n)
            capture = layer_capture(module, acts, backprops, batch_size=n, batch_dim=self.batch_dim,
                                    kwargs=kwargs, generic=generic, autocast=autocast)
            capture.call = call
            self._deliver(capture, module)

        return hook

    def _deliver(self, capture: LayerCapture, module: Optional[nn.Module] = None) -> None:
        compute = capture.grad_samples

        def grad_samples() -> Dict[nn.Parameter, torch.Tensor]:
            if capture.batch_size == 0:  # an empty batch (Poisson sampling): no rows, nothing to run
                return {p: p.new_zeros((0, *p.shape)) for p in capture.params}
            with self._recompute(), (without_own_hooks(module) if module is not None else contextlib.nullcontext()):
                return compute()

        capture.grad_samples = grad_samples
        getattr(self, SINK_ATTR).add(capture)

