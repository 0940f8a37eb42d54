"""Wrapping a model that fxdp already wrapped: an engine's wrapper is unwrapped, a compiled graph or a
model a live wrapper still hooks is refused (two engines would add the same per-sample gradients twice)."""

from __future__ import annotations

import gc

import torch
import torch.fx
from torch import nn

from fxdp.diagnostics import AlreadyCompiledError
from fxdp.engines.base import GradSampleModuleBase, engine_hooks, remove_dead_engine_hooks
from fxdp.engines.hooks import GradSampleModule
from fxdp.engines.whole_model import PerSampleModel


def unwrap_or_refuse(model: nn.Module) -> nn.Module:
    """The model to compile: an engine's wrapper is unwrapped (its hooks removed), a compiled graph is
    refused, and a model still hooked by a live wrapper is refused, since both engines would add the
    same per-sample gradients (they would come out doubled)."""
    if isinstance(model, GradSampleModuleBase):
        if isinstance(model, GradSampleModule):
            model.remove_hooks()
        model = model.module
    elif isinstance(model, PerSampleModel):
        model = model.module
    elif isinstance(model, torch.fx.GraphModule) and hasattr(model, "fxdp_report"):
        raise AlreadyCompiledError(
            f"fxdp: this {type(model).__name__} was already compiled by fxdp.compile_for_dp; compile the "
            "original model instead (the compiled one shares its parameters), or use the compiled one as it is")
    if engine_hooks(model):
        gc.collect()  # a deleted wrapper in a reference cycle: its finalizer removes its hooks
        remove_dead_engine_hooks(model)
    live = [(name, wrapper) for name, wrapper in engine_hooks(model) if wrapper is not None]
    live.sort(key=lambda found: found[0] == "<model>")  # a layer's name first: the model's own hook only counts calls
    if live:
        name, wrapper = live[0]
        raise AlreadyCompiledError(
            f"fxdp: {type(model).__name__} is still wrapped by a {type(wrapper).__name__} (hooks on '{name}'), "
            "whose hooks would add the same per-sample gradients a second time. Pass that wrapper instead "
            "(it is unwrapped), call its remove_hooks(), or delete it first.")
    return model
