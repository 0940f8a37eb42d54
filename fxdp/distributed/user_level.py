"""User-level DP-SGD across processes: :class:`~fxdp.optim.user_level.UserLevelDPOptimizer` composed with the
optimizers of DDP and FSDP2, each part written once.

The user-level optimizer overrides only how the clip factors are formed (``_factors``: one factor per user, given
to each of the user's records divided by their number) and what a batch must tell (``observe_batch``: the users'
record counts; no skip steps). The distributed optimizers override only the other parts of DPOptimizer's one
template of the private gradient (``_write_private_grads``): DDP who adds the noise and the all-reduce of the
noised sums (``_adds_noise``, ``_reduce``), FSDP2 the reduce-scatter of the sums into shards, each rank's rows of
the noise and the DTensor gradients (``_scaled_sums``, ``_add_noise``, ``_set_grads``). The classes below inherit
both, so a step is, on every rank::

    factors of this rank's users          (UserLevelDPOptimizer._factors; each user entirely on this rank)
    S_r = sum_i f_i g_i, scaled by 1/E    (the template; E the GLOBAL expected number of users for "mean")
    sum over ranks, noise added once      (DDP: rank 0 draws it; FSDP2: every rank its rows of one draw)

The loader (``UserLevelDataLoader(distributed=True)``, :mod:`fxdp.data.user_ranks`) hands each rank its users'
share of the one-process batch, so the update is the one-process update on the same users, up to summation order.
"""

from __future__ import annotations

from fxdp.distributed.optimizer import DistributedDPOptimizer
from fxdp.distributed.sharded_optimizer import FullyShardedDPOptimizer
from fxdp.optim.user_level import UserLevelDPOptimizer


class DistributedUserLevelDPOptimizer(UserLevelDPOptimizer, DistributedDPOptimizer):
    """User-level DP-SGD with ``DistributedDataParallel``: each rank clips its own users; the clipped sums are
    all-reduced once per step, the noise added by rank 0. Arguments: :class:`DistributedDPOptimizer`'s, with
    ``expected_batch_size`` the expected number of users of the global batch."""


class FullyShardedUserLevelDPOptimizer(UserLevelDPOptimizer, FullyShardedDPOptimizer):
    """User-level DP-SGD with FSDP2 (``fully_shard``): each rank clips its own users; each parameter's clipped sum
    is reduce-scattered into the shards, each rank adding its rows of the noise. Arguments:
    :class:`FullyShardedDPOptimizer`'s, with ``expected_batch_size`` the expected number of users of the global
    batch."""


__all__ = ["DistributedUserLevelDPOptimizer", "FullyShardedUserLevelDPOptimizer"]
