"""Private training across processes with torch.distributed (see docs/distributed.md).

The usual PyTorch pattern works: ``init_process_group``, the model wrapped in
``DistributedDataParallel``, each rank's loader over the global dataset, then
``PrivacyEngine.make_private``. Each rank clips its own samples; the clipped sums are all-reduced
once per logical step, with the noise added once (by rank 0) for the global batch.

``DistributedDPOptimizer``   the DP optimizer whose clipped sums are summed over the ranks
``DPDistributedDataParallel`` what make_private returns for a DDP model: its surface, no reducer
``split_data_parallel``       (model to compile, DDP wrapper or None); refuses FSDP1 and DataParallel

A model sharded with FSDP2 (``fully_shard``) is trained as FSDP runs it, with each parameter's clipped sum
reduce-scattered into its shards: :mod:`fxdp.distributed.fsdp` (the model side) and
:mod:`fxdp.distributed.sharded_optimizer` (``FullyShardedDPOptimizer``).
``global_batch_size``         the global batch of a non-Poisson loader with a DistributedSampler

User-level DP-SGD (``privacy_unit="user"``) across processes: :mod:`fxdp.distributed.user_level`
(``DistributedUserLevelDPOptimizer``, ``FullyShardedUserLevelDPOptimizer``), each user trained by one rank.
"""

from fxdp.distributed.data import check_poisson_group, global_batch_size
from fxdp.distributed.model import DPDistributedDataParallel, bucket_bytes_of, split_data_parallel, wrap_like
from fxdp.distributed.optimizer import DistributedDPOptimizer
from fxdp.distributed.sharded_optimizer import FullyShardedDPOptimizer
from fxdp.distributed.user_level import DistributedUserLevelDPOptimizer, FullyShardedUserLevelDPOptimizer


class DistributedDPOptimizerFastGradientClipping(DistributedDPOptimizer):
    """Opacus's distributed optimizer for fast gradient (ghost) clipping: fxdp's DistributedDPOptimizer, which
    reads the model's sink whichever it is (see fxdp.optim.DPOptimizerFastGradientClipping)."""


class SimpleDistributedPerLayerOptimizer(DistributedDPOptimizer):
    """Opacus's name for ``DistributedDPOptimizer(..., clipping="per_layer")``: ``max_grad_norm`` is a list with
    one bound per trainable parameter."""

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, clipping="per_layer", **kwargs)


__all__ = ["DPDistributedDataParallel", "DistributedDPOptimizer", "FullyShardedDPOptimizer",
           "DistributedUserLevelDPOptimizer", "FullyShardedUserLevelDPOptimizer",
           "DistributedDPOptimizerFastGradientClipping",
           "SimpleDistributedPerLayerOptimizer", "bucket_bytes_of", "check_poisson_group", "global_batch_size",
           "split_data_parallel", "wrap_like"]
