"""The batch sizes of a logical step across ranks, for loaders that are not Poisson-sampled.

With Poisson sampling (``make_private``'s default) ``fxdp.data.DPDataLoader(distributed=True)`` draws
one inclusion mask for the whole dataset, shared by the ranks, and each rank keeps its share: the
sample rate and the expected batch size are those of the global batch already. Without it, each rank
reads its part of the data through a ``DistributedSampler`` and the global batch is ``world_size``
local batches.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def global_batch_size(data_loader: DataLoader, process_group: Optional[Any] = None) -> int:
    """``batch_size x world_size`` for a loader whose ``DistributedSampler`` splits the dataset over
    the ranks of ``process_group``; an error for a loader that would give every rank the same samples."""
    world_size = dist.get_world_size(process_group)
    sampler = data_loader.sampler
    if not isinstance(sampler, DistributedSampler) or data_loader.batch_size is None:
        raise ValueError(
            "fxdp: with poisson_sampling=False across processes, each rank's DataLoader must read its own "
            "part of the data through torch.utils.data.distributed.DistributedSampler (and a batch_size); "
            f"this one has {type(sampler).__name__}, so every rank would train on the same samples. Use "
            "DataLoader(dataset, batch_size=b, sampler=DistributedSampler(dataset)), or poisson_sampling=True"
        )
    if sampler.num_replicas != world_size:
        raise ValueError(f"fxdp: the DistributedSampler splits the data over {sampler.num_replicas} replicas, "
                         f"the process group has {world_size} ranks; build it with the same process group")
    return data_loader.batch_size * world_size


def check_poisson_group(process_group: Optional[Any] = None) -> None:
    """Distributed Poisson sampling splits each batch over all ranks of the default group (fxdp.data
    broadcasts the seed there): a model trained by a subgroup would get a wrong share."""
    if dist.get_world_size(process_group) != dist.get_world_size():
        raise NotImplementedError(
            f"fxdp: the model's process group has {dist.get_world_size(process_group)} of the "
            f"{dist.get_world_size()} ranks; Poisson sampling across processes splits each batch over all "
            "ranks. Use the default process group, or poisson_sampling=False with a DistributedSampler"
        )
