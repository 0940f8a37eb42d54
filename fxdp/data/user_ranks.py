"""Users across processes (user-level DP-SGD with DDP or FSDP2): which rank trains which user.

Every rank groups the same dataset by user (:func:`fxdp.data.users.records_by_user`) and draws the same user sample
at every step, from a seed rank 0 broadcasts (``DPDataLoader(distributed=True)``): the coin of every user, then the
``min(n_u, k)`` records of every sampled user, exactly the draws one process makes. Each rank then keeps the sampled
users assigned to it, with all their records. So the global batch (the union over the ranks) is the batch one
process draws from that seed: each user sampled with probability q, independently, and each sampled user's records
on one rank, where they are clipped as one unit.

The assignment (:func:`assign_users`): users sorted by the records they bring to a step, ``min(n_u, k)``, largest
first (ties in order of first appearance), dealt to the ranks in snake order ``0, 1, ..., W-1, W-1, ..., 1, 0, 0,
1, ...``. It is a function of the users' record counts alone, so every rank computes the same one; the ranks hold
the same number of users up to one, and their expected records per step differ by at most ``q * k``.

It assumes every rank holds the same users (the same dataset, in the same order, with the same ``user_ids``), as
distributed Poisson sampling of records assumes the same dataset. :func:`check_same_users` checks it when the loader
is built (a fingerprint of each rank's users, gathered once): ranks grouping the records differently would train a
user on two ranks, clipped in parts, or on none, so the loader is refused.
"""

from __future__ import annotations

import hashlib
from typing import List

import torch


def assign_users(users: List[torch.Tensor], world_size: int, max_records_per_user: int) -> torch.Tensor:
    """``(len(users),)`` long: the rank that trains each user (see the module docstring)."""
    loads = torch.tensor([m.numel() for m in users], dtype=torch.long).clamp(max=max_records_per_user)
    order = torch.sort(-loads, stable=True).indices  # largest first; ties in order of first appearance
    position = torch.arange(len(users)) % (2 * world_size)
    snake = torch.where(position < world_size, position, 2 * world_size - 1 - position)
    ranks = torch.empty(len(users), dtype=torch.long)
    ranks[order] = snake
    return ranks


def users_fingerprint(users: List[torch.Tensor]) -> str:
    """A digest of the users and their records' indices, in order."""
    digest = hashlib.sha256()
    digest.update(torch.tensor([len(users)] + [m.numel() for m in users], dtype=torch.int64).numpy().tobytes())
    digest.update(torch.cat(users).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def check_same_users(users: List[torch.Tensor], rank: int, world_size: int) -> None:
    """Refuses (on every rank, naming those that differ) unless every rank of the default process group grouped
    its records into the same users."""
    import torch.distributed as dist

    own = (users_fingerprint(users), len(users), sum(m.numel() for m in users))
    everyone: List[tuple] = [None] * world_size
    dist.all_gather_object(everyone, own)
    differ = [r for r, theirs in enumerate(everyone) if theirs[0] != everyone[0][0]]
    if differ:
        raise ValueError(
            f"fxdp: user-level sampling across {world_size} processes needs every rank to hold the same users, "
            f"but rank(s) {differ} grouped their records differently from rank 0 (users, records per rank: "
            f"{[theirs[1:] for theirs in everyone]}; this is rank {rank}). Give every rank the same dataset, in the "
            "same order, with the same user_ids: each user is trained by one rank, chosen from the users' record "
            "counts")
