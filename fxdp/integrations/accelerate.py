"""Private training with Hugging Face Accelerate (the ``accelerate`` package; extra ``transformers`` or ``test``)::

    from fxdp.integrations.accelerate import make_private

    accelerator = Accelerator()
    model, optimizer, loader = make_private(accelerator, fxdp.PrivacyEngine(), module=model,
                                            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                            data_loader=DataLoader(train, batch_size=64),  # per process, as Accelerate
                                            noise_multiplier=1.0, max_grad_norm=1.0)
    for x, y in loader:
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        optimizer.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()

``accelerator.prepare(model, optimizer, loader)`` cannot take fxdp's three as they are:

- the loader: Accelerate rebuilds it as its own ``DataLoaderShard`` (fetching one batch ahead), which no longer tells
  the DP optimizer which Poisson batch each step takes; the optimizer then refuses the first step (a batch "from
  elsewhere"). The Poisson loader fxdp returns is iterated as it is (and its batches moved to ``accelerator.device``);
- the model, under several processes: Accelerate wraps the *private* model in ``DistributedDataParallel``, whose
  averaged ``p.grad`` the DP optimizer does not read: each process would clip, noise and step on its own batches,
  and the accountant count one process's. fxdp's DDP (docs/distributed.md) needs the model wrapped *before*
  ``make_private``.

:func:`make_private` does it in that order: ``accelerator.prepare_model(module)`` (DDP across processes, on
``accelerator.device``), then :meth:`fxdp.PrivacyEngine.make_private` (or ``make_private_with_epsilon`` with
``target_epsilon``) on it, with the loader sharded across processes as Accelerate shards it (each process's
``batch_size`` is its share: the expected global batch is ``batch_size * num_processes``), then
``accelerator.prepare_optimizer`` on the DP optimizer (so ``accelerator.backward``, ``optimizer.step`` and
``zero_grad`` go through Accelerate as usual), and registers the accountant for checkpointing, so that
``accelerator.save_state`` / ``load_state`` carry its history with the model and the DP optimizer. Refused with
:class:`~fxdp.diagnostics.PrivacySettingError` before anything moves: ``gradient_accumulation_steps != 1``
(Accelerate would skip the DP optimizer's steps: one Poisson batch is one private step), mixed precision (not verified
with fxdp's clipping here), and distributed types other than one process and DDP (FSDP, DeepSpeed, ...: fxdp's own
FSDP support is ``fully_shard``, docs/distributed.md).
"""

from __future__ import annotations

from typing import Any, Tuple

import accelerate
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from fxdp.diagnostics import PrivacySettingError
from fxdp.privacy_engine import PrivacyEngine

SUPPORTED = (accelerate.DistributedType.NO, accelerate.DistributedType.MULTI_CPU, accelerate.DistributedType.MULTI_GPU)


def make_private(accelerator: "accelerate.Accelerator", privacy_engine: PrivacyEngine, *, module: nn.Module,
                 optimizer: Optimizer, data_loader: DataLoader, **settings: Any) -> Tuple[nn.Module, Any, DataLoader]:
    """``(model, optimizer, loader)`` for training with ``accelerator`` and DP-SGD (see the module's docstring).
    ``settings``: :meth:`fxdp.PrivacyEngine.make_private`'s (``noise_multiplier``, ``max_grad_norm``, ...), or
    ``make_private_with_epsilon``'s when they hold ``target_epsilon``. The optimizer must be over ``module``'s
    parameters (built before this call, as for Accelerate)."""
    check_accelerator(accelerator)
    if not isinstance(data_loader, DataLoader) or type(data_loader).__module__.startswith("accelerate"):
        raise PrivacySettingError(
            f"fxdp: make_private needs the plain torch DataLoader, got {type(data_loader).__name__}: do not pass it "
            "through accelerator.prepare first (fxdp replaces it by a Poisson loader, which is iterated as it is)")
    if type(optimizer).__module__.startswith("accelerate") or type(module).__module__.startswith("accelerate"):
        raise PrivacySettingError("fxdp: make_private needs the model and optimizer before accelerator.prepare: "
                                  "it prepares them itself, in the order DP-SGD needs")
    model = accelerator.prepare_model(module)
    if accelerator.num_processes > 1 and not isinstance(data_loader.sampler, DistributedSampler):
        data_loader = _sharded(data_loader, accelerator)
    if "target_epsilon" in settings:
        model, dp_optimizer, loader = privacy_engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=data_loader, **settings)
    else:
        model, dp_optimizer, loader = privacy_engine.make_private(
            module=model, optimizer=optimizer, data_loader=data_loader, **settings)
    accelerator.register_for_checkpointing(privacy_engine.accountant)  # save_state / load_state carry its history
    return model, accelerator.prepare_optimizer(dp_optimizer), loader


def check_accelerator(accelerator: "accelerate.Accelerator") -> None:
    """Refuses, with the reasons, an ``Accelerator`` whose settings DP-SGD cannot train with."""
    problems = []
    if accelerator.gradient_accumulation_steps != 1:
        problems.append(f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps}: Accelerate would skip "
                        "the DP optimizer's steps in between; one Poisson batch is one private step (raise the "
                        "loader's batch_size instead)")
    if accelerator.mixed_precision != "no":
        problems.append(f"mixed_precision={accelerator.mixed_precision!r}: not verified with fxdp's per-sample "
                        "clipping; train in float32")
    if accelerator.distributed_type not in SUPPORTED:
        problems.append(f"distributed_type={accelerator.distributed_type}: fxdp trains in one process or with DDP "
                        "(MULTI_CPU, MULTI_GPU); for sharded models see docs/distributed.md (fully_shard)")
    if problems:
        raise PrivacySettingError("fxdp: make_private cannot train with this Accelerator:\n  - "
                                  + "\n  - ".join(problems))


def _sharded(loader: DataLoader, accelerator: "accelerate.Accelerator") -> DataLoader:
    """The loader with each process reading its share of the dataset, as ``accelerator.prepare`` would shard it
    (the Poisson loader built from it draws one mask over the whole dataset, each process keeping its share)."""
    sampler = DistributedSampler(loader.dataset, num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, shuffle=False)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn,
                      num_workers=loader.num_workers, pin_memory=loader.pin_memory)
