"""``make_private(..., compile=True)``: the private model ``torch.compile``'d in place, one graph per forward.

The model is compiled with :meth:`torch.nn.Module.compile` (``torch.compile`` of its call), not wrapped in the
``OptimizedModule`` ``torch.compile(model)`` returns (a copy, deepcopy or pickle, is compiled for itself:
:func:`fxdp.runtime.module.compile_module`): the object ``make_private`` returns stays the private model
itself, so its ``state_dict`` names, ``fxdp.report(model)``, its gradient sink (which the DP optimizer reads),
``eval()``/``train()`` and the checkpoints of :class:`~fxdp.privacy_engine.PrivacyEngine` are those of the eager
model. Under torch.compile the DP-aware layers deliver from the compiled backward
(:mod:`fxdp.runtime.compiled_delivery`), so the forward is one graph; the checks that must run on every call (the
batch guard, the structure watch) run eagerly (:func:`fxdp.runtime.guards.run_eagerly`). See docs/torch_compile.md.

The DP optimizer's step (clip factors, clipped sums, noise) stays eager: see docs/torch_compile.md, "compile=True".
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, Optional

import torch
from torch import nn

from fxdp.diagnostics.report import REPORT_ATTR
from fxdp.runtime import compiled_delivery
from fxdp.runtime.module import CompiledGraphModule, compile_module

#: torch.compile's keyword arguments a ``compile`` dict may hold (``model`` is the private model itself)
TORCH_COMPILE_KEYWORDS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def compile_options(value: Any) -> Optional[Dict[str, Any]]:
    """The keyword arguments for ``torch.compile`` that make_private's ``compile`` asks for (``None``: do not
    compile): ``False``/``None`` -> ``None``, ``True`` -> ``{}`` (torch.compile's defaults: inductor), a dict ->
    a copy of it, its keys checked against torch.compile's signature.

    A compiled model also gets fixed-shape batches by default: make_private's Poisson batches padded to a few bucket
    sizes with masked rows (``padded_batches=None`` means that where ``compile`` is asked for,
    :func:`fxdp.data.padding.padded_batches_for`), so that a few compiled graphs serve every batch."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        unknown = sorted(str(k) for k in value if k not in TORCH_COMPILE_KEYWORDS)
        if unknown:
            raise TypeError(f"fxdp: make_private(compile=...) got {', '.join(map(repr, unknown))}, which "
                            f"torch.compile does not take; its options are {', '.join(TORCH_COMPILE_KEYWORDS)} "
                            "(e.g. compile={'backend': 'aot_eager'} or compile={'mode': 'reduce-overhead'})")
        return dict(value)
    raise TypeError(f"fxdp: make_private(compile=...) takes True, False or a dict of torch.compile's options "
                    f"(e.g. {{'backend': 'aot_eager'}}), got {value!r} of type {type(value).__name__}")


def check_compile_is_possible(*, grad_sample_mode: str, wrap_model: bool, data_parallel: bool,
                              sharded: bool) -> None:
    """Refuse, before anything is built, ``compile=...`` with what it is not made for: the engines other than
    the graph one (their per-layer hooks under torch.compile are not tested), and training across processes."""
    if grad_sample_mode != "fx" or not wrap_model:
        what = "wrap_model=False (the hooks engine on the model)" if wrap_model is False \
            else f"grad_sample_mode={grad_sample_mode!r}"
        raise ValueError(
            f"fxdp: make_private(compile=...) is for the graph engine (grad_sample_mode='fx', the default, with "
            f"wrap_model=True), whose layers deliver their per-sample captures from the compiled backward; with {what} "
            "each layer keeps eager hooks that torch.compile runs untested. Use the default grad_sample_mode, or "
            "pass compile=False")
    if data_parallel or sharded:
        raise ValueError(
            "fxdp: make_private(compile=...) is not supported for a model trained across processes "
            "(DistributedDataParallel or fully_shard): it is not tested there. Pass compile=False")


def compile_in_place(private: nn.Module, options: Dict[str, Any]) -> nn.Module:
    """``private.compile(**options)``: the model make_private returns, compiled, the same object. Refuses a model
    the compiler did not put on the graph engine (torch.fx and torch.export could not capture it: the hooks
    engine took it), saying why."""
    report = getattr(private, REPORT_ATTR, None)
    engine = getattr(report, "engine", None)
    if engine != "fx" or not isinstance(private, CompiledGraphModule):
        why = f" ({report.fallback_reason})" if getattr(report, "fallback_reason", None) else ""
        raise ValueError(
            f"fxdp: make_private(compile=...) needs the graph engine, but this {getattr(report, 'model', 'model')} "
            f"runs on the {engine!r} engine{why}: its per-layer hooks under torch.compile are not tested. Pass "
            "compile=False (fxdp.report(model) says why the graph engine was not used)")
    if not compiled_delivery.TRACEABLE:
        warnings.warn(f"fxdp: make_private(compile=...) on torch {torch.__version__}: dynamo cannot trace fxdp's "
                      "compiled delivery before torch 2.13, so each DP-aware layer keeps its eager hook (a graph "
                      "break per layer; the per-sample gradients are the same)", stacklevel=3)
    compile_module(private, options)  # (its copies, deepcopy or pickle, are compiled for themselves)
    return private
