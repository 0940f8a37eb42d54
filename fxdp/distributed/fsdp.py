"""The model side of private training on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each parameter as a DTensor sharded on dimension 0 over the ranks of a device mesh; each
``fully_shard`` unit all-gathers its parameters for its forward and again for its backward, and frees them
after. fxdp keeps that: the model runs as FSDP runs it, so no rank holds more gathered parameters than
FSDP itself would (see docs/distributed.md, "FSDP2").

What fxdp changes:

- the hooks engine (:class:`~fxdp.engines.hooks.GradSampleHooks`, with the book-keeping sink by default) sits
  on the model's layers, inside FSDP's gathered windows: each layer hands its input ``A`` and output gradient
  ``G`` to the sink. A sample lives on one rank and ``A``, ``G`` of its rows are all there, so its per-sample
  norm over *every* layer is complete on that rank: clip factors need no communication;
- FSDP's own reduce-scatter of the ordinary (unclipped, averaged) gradients is switched off: the gathered
  parameters' gradients are dropped as autograd accumulates them (a hook per parameter), so FSDP finds none
  to reduce and the sharded ``p.grad`` stays ``None`` until the DP optimizer writes it;
- the optimizer (:class:`~fxdp.distributed.sharded_optimizer.FullyShardedDPOptimizer`) forms each
  parameter's clipped sum (full shape) and reduce-scatters it, one parameter at a time, into the rank's shard.

FSDP1 (``FullyShardedDataParallel``) flattens each unit's parameters into one ``FlatParameter`` and reduces
its averaged gradient in its own backward hooks: the parameters an optimizer holds are not the layers' ones,
so it is refused with what to do (shard with ``fully_shard``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from fxdp.diagnostics.report import REPORT_ATTR
from fxdp.sinks.contract import sink_of


def fsdp_kind(module: nn.Module) -> Optional[str]:
    """``"fsdp2"`` for a root made with ``fully_shard``, ``"fsdp1"`` for ``FullyShardedDataParallel``, else None.
    (A model wrapped in FSDP means torch.distributed.fsdp was imported: no need to import it, a slow import.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    fsdp1, fsdp2 = getattr(fsdp, "FullyShardedDataParallel", None), getattr(fsdp, "FSDPModule", None)
    if isinstance(fsdp1, type) and isinstance(module, fsdp1):
        return "fsdp1"
    if isinstance(fsdp2, type) and isinstance(module, fsdp2):
        return "fsdp2"
    return None


def refuse_fsdp1(module: nn.Module) -> None:
    raise NotImplementedError(
        f"fxdp: {type(module).__name__} (FSDP1, FullyShardedDataParallel) is not supported: it flattens each "
        "unit's parameters into one FlatParameter and reduces their averaged, unclipped gradient in its own "
        "backward hooks, so the parameters an optimizer holds are not the layers' ones. Shard the model with "
        "FSDP2 instead: torch.distributed.fsdp.fully_shard(block, mesh=mesh) for each block, then "
        "fully_shard(model, mesh=mesh), and pass that model to make_private (see docs/distributed.md, FSDP2)")


def sharding_plan_of(module: nn.Module) -> Optional["ShardingPlan"]:
    """The :class:`ShardingPlan` of a ``fully_shard`` root; None for any other model; FSDP1 refused."""
    kind = fsdp_kind(module)
    if kind == "fsdp1":
        refuse_fsdp1(module)
    return ShardingPlan(module) if kind == "fsdp2" else None


def check_sharded_mode(grad_sample_mode: str, wrap_model: bool) -> None:
    if grad_sample_mode not in ("fx", "hooks"):
        raise ValueError(
            f"fxdp: grad_sample_mode={grad_sample_mode!r} is not available for a fully_shard model: FSDP must run the "
            "model itself (it gathers each unit's parameters around the unit's forward and backward), so fxdp puts "
            "its hooks engine on the model's layers: use the default 'fx' (book-keeping on those hooks) or 'hooks'")
    if not wrap_model:
        raise ValueError("fxdp: wrap_model=False with a fully_shard model is not supported: call the model "
                         "make_private returns (it is your model, with fxdp's hooks on its layers)")


def report_sharding(hooks: nn.Module, plan: "ShardingPlan", bookkept: bool) -> None:
    """Adds to the hooks engine's report how the model is sharded and how each layer's per-sample norms and
    clipped sums are formed."""
    rep = getattr(hooks, REPORT_ATTR)
    how = ("book-kept (norms and clipped sums from the layer's input and output gradient, no per-sample "
           "gradient materialised)" if bookkept else "per-sample gradients materialised (p.grad_sample)")
    layers = [f"  {name}: {rule}, {how}" for name, rule in getattr(hooks, "grad_sample_layers", {}).items()]
    notes = (*rep.notes, *plan.describe(), "layers (the hooks engine, inside FSDP's gathered windows):", *layers,
             "the hooks engine's self-check (a test of the model on its first batch) is off under FSDP2: its extra "
             "forward and backward passes would gather parameters on some ranks and not others; each layer is still "
             "checked against the batch at every forward. Check the model unsharded with "
             "fxdp.check_per_sample_gradients_are_correct")
    reason = ("FSDP2 runs the model (it gathers each unit's parameters around the unit's forward and backward), so "
              "the hooks engine sits on its layers")
    setattr(hooks, REPORT_ATTR, dataclasses.replace(rep, notes=notes, fallback_reason=reason))


@contextlib.contextmanager
def fsdp_forward_hooks_off(root: nn.Module) -> Iterator[None]:
    """FSDP's forward hooks set aside while fxdp analyses the model: torch.fx enters a non-leaf module through
    its ``__call__``, so a unit's hook would run on the tracer's proxies, all-gather for nothing, and take the
    unit for a root of its own (FSDP's lazy initialisation), which breaks the first real forward. The hooks
    come back in their order when the analysis ends, whatever happens."""
    saved = []
    for m in root.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            ours = [k for k, h in hooks.items() if getattr(h, "__module__", "").startswith("torch.distributed.fsdp")]
            if ours:
                saved.append((hooks, dict(hooks)))
                for k in ours:
                    del hooks[k]
    try:
        yield
    finally:
        for hooks, before in saved:
            added = {k: h for k, h in hooks.items() if k not in before}  # (the analysis's own, if any are left)
            hooks.clear()
            hooks.update(before)
            hooks.update(added)


class ShardingPlan:
    """How a ``fully_shard`` model is sharded: its mesh, the units (module names) and, for every parameter,
    the gathered tensor FSDP puts in its place during a unit's forward and backward (``gathered``)."""

    def __init__(self, root: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        names = {m: n for n, m in root.named_modules()}
        self.units: List[str] = [names[m] or "<model>" for m in root.modules() if isinstance(m, FSDPModule)]
        sharded = {id(p): p for p in root.parameters()}
        first = next(iter(sharded.values()), None)
        if first is None or not hasattr(first, "device_mesh"):
            raise ValueError("fxdp: the fully_shard model has no sharded (DTensor) parameter; shard it with "
                             "fully_shard(block, mesh=mesh) for each block and then the root")
        self.mesh = first.device_mesh
        if self.mesh.ndim != 1:
            raise NotImplementedError(
                f"fxdp: the model is sharded over a {self.mesh.ndim}-dimensional mesh {tuple(self.mesh.shape)} "
                "(HSDP, or FSDP with tensor parallelism); fxdp supports a 1-D mesh: init_device_mesh(device, (world,))")
        for p in sharded.values():
            placements = getattr(p, "placements", None)
            if getattr(p, "device_mesh", None) != self.mesh or placements is None or len(placements) != 1 \
                    or not placements[0].is_shard(0):
                raise NotImplementedError(
                    "fxdp: every parameter of a fully_shard model must be sharded on dimension 0 over one mesh "
                    "(fully_shard's default); a custom shard_placement_fn or a second mesh is not supported")
        self.root = root
        self.process_group = self.mesh.get_group()
        self.world_size = self.mesh.size()
        self.gathered = self._gathered_twins(root, sharded)

    @staticmethod
    def _gathered_twins(root: nn.Module, sharded: Dict[int, nn.Parameter]) -> Dict[nn.Parameter, nn.Parameter]:
        """``{gathered parameter: sharded parameter}``: FSDP2 swaps each layer's attribute between the two and
        keeps both objects for the model's life, so one unshard and reshard (collectives every rank makes here,
        in make_private) finds them."""
        from torch.distributed.fsdp import FSDPModule

        slots = [(m, name) for m in root.modules() for name, p in m._parameters.items() if p is not None]
        before = [m._parameters[name] for m, name in slots]
        units = [m for m in root.modules() if isinstance(m, FSDPModule)]  # the root first
        for unit in units:
            unit.unshard()
        after = [m._parameters[name] for m, name in slots]
        for unit in reversed(units):
            unit.reshard()
        return {g: s for g, s in zip(after, before) if g is not s and id(s) in sharded}

    def describe(self) -> List[str]:
        return [f"sharded with FSDP2 (fully_shard): {self.world_size} ranks on a 1-D {self.mesh.device_type} mesh, "
                f"parameters sharded on dimension 0; {len(self.units)} units: {', '.join(self.units)}",
                "each rank clips its own samples (their norms are complete there); each parameter's clipped sum is "
                "reduce-scattered into its shards; FSDP's own gradient reduce-scatter is off"]


class DPFullyShardedModule(nn.Module):
    """What ``make_private`` returns for a ``fully_shard`` model: the model itself (``.module``, called as
    it is, so FSDP gathers and frees each unit as usual) with fxdp's per-sample hooks on its layers.
    ``state_dict`` and ``load_state_dict`` are the model's own (its keys, its DTensor shards)."""

    def __init__(self, module: nn.Module, hooks: nn.Module, plan: ShardingPlan):
        super().__init__()
        self.module = module
        self.plan = plan
        object.__setattr__(self, "_hooks", hooks)  # not a submodule: state_dict and parameters stay the model's
        self._grad_drops = [g.register_post_accumulate_grad_hook(_drop_grad)
                            for g, s in plan.gathered.items() if s.requires_grad]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The model's state dict with whole tensors (on the CPU), under the plain model's names, as one process
        saves it: a collective, every rank calls it (``PrivacyEngine.save_checkpoint`` does)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.module.reshard()  # a forward under no_grad (evaluation) leaves the root's parameters gathered
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Each rank keeps its shards of a whole state dict (:meth:`full_state_dict`, or one process's)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self.module.reshard()
        set_model_state_dict(self.module, state_dict, options=StateDictOptions(full_state_dict=True))

    @property
    def fxdp_sink(self):
        return sink_of(self._hooks)

    @property
    def fxdp_report(self):
        return getattr(self._hooks, REPORT_ATTR, None)

    def remove_hooks(self) -> None:
        for handle in self._grad_drops:
            handle.remove()
        self._grad_drops = []
        self._hooks.cleanup()


def _drop_grad(p: torch.Tensor) -> None:
    # the gathered parameter's plain gradient: unclipped, so nothing may read it, and FSDP reduce-scatters
    # (and averages) only the gradients it finds, so dropping it also saves that communication
    p.grad = None


__all__ = ["DPFullyShardedModule", "ShardingPlan", "check_sharded_mode", "fsdp_forward_hooks_off", "fsdp_kind",
           "refuse_fsdp1", "report_sharding", "sharding_plan_of"]
