"""The parts of :meth:`fxdp.PrivacyEngine.make_private` that choose: the engine that makes the model private
(:func:`prepare_model`) and the DP optimizer's class (:func:`prepare_optimizer`). ``make_private`` reads as
prepare the model, the data loader, the optimizer, the accountant; the loader and the accountant are the
PrivacyEngine's own (it keeps the accountant)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from fxdp.compile_option import compile_in_place
from fxdp.compiler import attach_hooks, compile_for_dp
from fxdp.data.example_inputs import inputs_from_the_loader
from fxdp.distributed import DistributedDPOptimizer, bucket_bytes_of
from fxdp.distributed.fsdp import check_sharded_mode, fsdp_forward_hooks_off, report_sharding
from fxdp.distributed.sharded_optimizer import FullyShardedDPOptimizer
from fxdp.distributed.user_level import DistributedUserLevelDPOptimizer, FullyShardedUserLevelDPOptimizer
from fxdp.frontends.fx import trace
from fxdp.model_labels import labels_outside_the_graph
from fxdp.optim import AdaClipDPOptimizer, DPOptimizer
from fxdp.optim.user_level import UserLevelDPOptimizer
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import sink_of


def prepare_model(module: nn.Module, data_loader: DataLoader, *, grad_sample_mode: str, sharded: Any,
                  ddp: Optional[DistributedDataParallel], wrap_model: bool, materialise_grad_sample: bool,
                  batch_first: bool, loss_reduction: str, example_inputs: Any, batch_inputs: Any,
                  compile_with: Optional[Dict[str, Any]]) -> nn.Module:
    """The private model: where ``make_private`` chooses the engine. A ``fully_shard`` model (``sharded``: its
    plan) gets the hooks engine on its layers (FSDP runs the model); ``wrap_model=False`` the hooks engine on the
    model itself; any other model :func:`~fxdp.compile_for_dp` (which chooses among the graph engine and the
    fallbacks, and says why in ``fxdp.report``), then ``torch.compile`` when ``compile_with`` asks for it. The
    default mode book-keeps (a :class:`BookkeepingSink`) unless ``materialise_grad_sample``."""
    batch_dim = 0 if batch_first else 1
    bookkept = grad_sample_mode == "fx" and not materialise_grad_sample
    if sharded is not None:  # FSDP runs the model; the hooks engine sits on its layers (fxdp/distributed/fsdp.py)
        check_sharded_mode(grad_sample_mode, wrap_model)
        with fsdp_forward_hooks_off(module):  # the analysis traces the model: FSDP must not see it
            compiled = attach_hooks(module, batch_dim=batch_dim, loss_reduction=loss_reduction,
                                    sink=BookkeepingSink() if bookkept else None, verify=False)
        report_sharding(compiled, sharded, bookkept)
        return compiled
    if not wrap_model:
        if ddp is not None:
            raise ValueError("fxdp: wrap_model=False with a DistributedDataParallel model is not supported: "
                             "pass wrap_model=True (the default) and call the model make_private returns")
        if grad_sample_mode not in ("fx", "hooks"):
            raise ValueError(f"fxdp: wrap_model=False puts the hooks engine on the model itself; "
                             f"grad_sample_mode={grad_sample_mode!r} needs its wrapper: pass wrap_model=True")
        return attach_hooks(module, batch_dim=batch_dim, loss_reduction=loss_reduction,
                            sink=BookkeepingSink() if bookkept else None)
    from_loader = None
    if example_inputs is None and grad_sample_mode == "fx" and not trace(module).ok:
        from_loader = inputs_from_the_loader(module, data_loader, batch_dim)
        if from_loader is not None:
            example_inputs = from_loader.inputs
            batch_inputs = batch_inputs if batch_inputs is not None else from_loader.batch_inputs or None
    compiled = compile_for_dp(module, example_inputs, batch_dim=batch_dim, loss_reduction=loss_reduction,
                              grad_sample_mode=grad_sample_mode, sink=BookkeepingSink() if bookkept else None,
                              batch_inputs=batch_inputs)
    task = labels_outside_the_graph(compiled, module, example_inputs, loss_reduction)
    if from_loader is not None:
        from_loader.mark(compiled, task)
    if compile_with is not None:  # before the optimizer, loader and claim: a refusal leaves nothing behind
        compiled = compile_in_place(compiled, compile_with)
    return compiled


def prepare_optimizer(optimizer: Optimizer, compiled: nn.Module, module: nn.Module, *, clipping: str,
                      ddp: Optional[DistributedDataParallel], sharded: Any, by_user: bool,
                      optimizer_kwargs: Dict[str, Any], **settings: Any) -> DPOptimizer:
    """The DP optimizer around ``optimizer``, reading ``compiled``'s gradient sink: where ``make_private`` chooses
    its class (:class:`AdaClipDPOptimizer` for ``clipping="adaptive"``, one process only;
    :class:`DistributedDPOptimizer` across DDP processes; :class:`FullyShardedDPOptimizer` for ``fully_shard``;
    :class:`UserLevelDPOptimizer` for ``by_user``, user-level privacy (composed with the DDP or FSDP2 one across
    processes: fxdp/distributed/user_level.py); else
    :class:`DPOptimizer`). ``settings``: the DP optimizer's arguments (noise multiplier, bound, ...)."""
    optimizer_class, kwargs = UserLevelDPOptimizer if by_user else DPOptimizer, dict(optimizer_kwargs)
    if clipping == "adaptive":
        if ddp is not None or sharded is not None:
            raise ValueError("fxdp: clipping='adaptive' is for one process (its unclipped count is not "
                             "combined across processes yet); use clipping='flat' with DDP")
        optimizer_class, clipping = AdaClipDPOptimizer, "flat"
    if ddp is not None:
        optimizer_class = DistributedUserLevelDPOptimizer if by_user else DistributedDPOptimizer
        kwargs.update(process_group=ddp.process_group, bucket_bytes=bucket_bytes_of(ddp))
    if sharded is not None:
        optimizer_class = FullyShardedUserLevelDPOptimizer if by_user else FullyShardedDPOptimizer
        kwargs.update(plan=sharded)
    return optimizer_class(optimizer, clipping=clipping, sink=sink_of(compiled),
                           param_names={p: name for name, p in module.named_parameters()}, **settings, **kwargs)


__all__ = ["prepare_model", "prepare_optimizer"]
