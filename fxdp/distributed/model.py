"""The model side of distributed DP-SGD: what ``make_private`` does with a
``torch.nn.parallel.DistributedDataParallel`` (DDP) model.

DDP averages the *raw* gradients of the ranks during backward (its reducer's hooks on the
parameters). DP-SGD needs the opposite order: clip each sample's gradient on its rank first, then sum
over ranks. So ``make_private`` takes the model out of its DDP wrapper (``ddp.module``), compiles that
model, and returns a :class:`DPDistributedDataParallel`: the same surface (``.module``, ``forward``,
``no_sync()``, ``.process_group``, ``state_dict`` keys under ``module.``) around the compiled model,
with no reducer: nothing is communicated during backward, and the
:class:`~fxdp.distributed.DistributedDPOptimizer` all-reduces the clipped sums once per logical step.

Why not keep DDP and run every step under ``ddp.no_sync()``? Its reducer would stay attached and
average raw gradients the first time a user forgets the context manager; its forward would run the
uncompiled model; and it would broadcast buffers every step although a private model has none that
change in training. The user's DDP object is only read (its module, process group and bucket size):
its construction already broadcast rank 0's weights, so every rank starts from the same parameters.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fxdp.distributed.fsdp import fsdp_kind, refuse_fsdp1
from fxdp.distributed.optimizer import DEFAULT_BUCKET_BYTES
from fxdp.sinks.contract import sink_of


class DPDistributedDataParallel(nn.Module):
    """A compiled model trained across processes, with DistributedDataParallel's surface and no
    gradient communication in backward (the DP optimizer sums clipped gradients instead).

    ``module`` is the model ``fxdp.compile_for_dp`` returned; ``fxdp.report(this)`` is its report.
    Inputs must already be on the model's device (DDP's ``device_ids`` input scattering is not done).

    Opacus's ``DifferentiallyPrivateDistributedDataParallel(model)`` is this class around the plain model,
    before ``make_private``: rank 0's parameters and buffers are broadcast to every rank (as DDP does), and
    ``make_private`` then treats it as it treats DistributedDataParallel.
    """

    def __init__(self, module: nn.Module, *, process_group: Optional[Any] = None,
                 device_ids: Optional[list] = None, output_device: Any = None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.device_ids = device_ids
        self.output_device = output_device
        if sink_of(module) is None and dist.is_available() and dist.is_initialized():
            with torch.no_grad():  # every rank starts from rank 0's model, as DDP does
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t, src=0, group=process_group)

    @property
    def is_private(self) -> bool:
        """Whether it wraps a model fxdp compiled (what make_private returns), not a plain one."""
        return sink_of(self.module) is not None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Does nothing: backward never communicates here. (A logical batch made of several physical
        batches is accumulated with ``optimizer.signal_skip_step()``, as BatchMemoryManager does.)"""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)  # the compiled model's: also per-sample gradients

    @property
    def fxdp_sink(self):
        """The compiled model's gradient sink (what ``fxdp.sinks.contract.sink_of`` looks for)."""
        return sink_of(self.module)

    @property
    def fxdp_report(self):
        """The compiled model's report (what ``fxdp.report`` looks for)."""
        return getattr(self.module, "fxdp_report", None)


def split_data_parallel(module: nn.Module) -> Tuple[nn.Module, Optional[DistributedDataParallel]]:
    """``(model to compile, the DDP wrapper or None)``. Refuses what fxdp cannot train privately
    across processes yet, rather than letting it average unclipped gradients."""
    if isinstance(module, DPDistributedDataParallel) and not module.is_private:
        return module.module, module  # Opacus's DPDDP around the plain model: DDP's place
    if isinstance(module, DPDistributedDataParallel):
        raise TypeError("fxdp: this model was already made private (it is what make_private returned); pass "
                        "the original DistributedDataParallel model and a fresh optimizer")
    if fsdp_kind(module) == "fsdp1":
        refuse_fsdp1(module)
    if fsdp_kind(module) == "fsdp2":
        raise TypeError("fxdp: a fully_shard model is not a DDP model; PrivacyEngine.make_private takes it "
                        "(fxdp.distributed.fsdp.sharding_plan_of)")
    if isinstance(module, nn.DataParallel):
        raise NotImplementedError(
            "fxdp: torch.nn.DataParallel (one process, several GPUs) is not supported; use "
            "DistributedDataParallel with one process per device (torchrun), or the plain model"
        )
    if isinstance(module, DistributedDataParallel):
        return module.module, module
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"fxdp: torch.distributed runs {dist.get_world_size()} processes but the model is not wrapped in "
            "DistributedDataParallel: each process trains its own copy on its own batches, nothing is "
            "communicated, and each accountant counts only its process's steps. Wrap the model in "
            "DistributedDataParallel before make_private to train one model on the global batch",
            stacklevel=3,
        )
    return module, None


def wrap_like(compiled: nn.Module, ddp) -> DPDistributedDataParallel:
    """The compiled inner model, with ``ddp``'s surface."""
    return DPDistributedDataParallel(compiled, process_group=ddp.process_group,
                                     device_ids=ddp.device_ids, output_device=ddp.output_device)


def bucket_bytes_of(ddp: DistributedDataParallel) -> int:
    """The all-reduce bucket size the user chose for DDP (``bucket_cap_mb``)."""
    return int(getattr(ddp, "bucket_bytes_cap", DEFAULT_BUCKET_BYTES))
