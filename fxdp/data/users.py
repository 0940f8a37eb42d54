"""User-level sampling: each step Poisson-samples USERS, then takes up to k records of each sampled user.

``UserPoissonBatchSampler`` (the law the user-level accounting assumes): at every step each user joins the batch
independently with probability ``q`` (one coin per user, whatever their number of records: a user with many
records is not sampled more often); a sampled user with ``n_u`` records contributes ``min(n_u, k)`` of them,
chosen uniformly at random without replacement, afresh at every step and independently of the other users.
Records beyond ``k`` are not dropped from the dataset: at each step a user's unchosen records are simply not in
that step's batch, and may be chosen at a later step the user is sampled in. The accounting covers this because
it bounds the user, not the records: whichever records are chosen, the user's contribution to a step is clipped
to C as one unit (:mod:`fxdp.optim.user_level`), and the choice depends only on the user's own record count and
the sampler's randomness. The batch's records are grouped by user (user 0's records first, then user 1's, ...).

``UserLevelDataLoader`` (a :class:`~fxdp.data.DPDataLoader`) hands out those batches and tells its batch observer
(the :class:`~fxdp.optim.user_level.UserLevelDPOptimizer`'s ``observe_batch``) the number of records of each user
of the batch it hands out. It keeps only the record indices of each user (one int per record), never a second
copy of the data: records are read from the dataset as the batch is formed, as any DataLoader reads them.
An empty step (no user sampled) is an empty batch, handed out as the DPDataLoader hands one out (noise only).

Across processes (``distributed=True``, DDP or FSDP2): every rank draws the same user sample and keeps the sampled
users assigned to it, each with all their records (:mod:`fxdp.data.user_ranks`); the global batch is the one
process's batch.
"""

from __future__ import annotations

import collections
import inspect
import warnings
from typing import Any, Callable, Deque, Dict, Hashable, Iterator, List, Optional, Sequence, Union

import torch
from torch.utils.data import DataLoader, Dataset

from fxdp.data.loader import DPDataLoader, _unwrapped_collate, is_empty_batch, loader_options
from fxdp.data.user_ranks import assign_users, check_same_users

UserIds = Union[Sequence[Hashable], torch.Tensor, str, Callable[[Any], Hashable]]


def records_by_user(dataset: Dataset, user_ids: UserIds) -> List[torch.Tensor]:
    """The indices of each user's records (users in order of first appearance). ``user_ids``: a sequence (or
    tensor) with one id per record, aligned with the dataset; a string, the name of a field of each record (a
    mapping's key) or of a dataset attribute holding one id per record; or a function of a record. A field or a
    function reads each record once, here, and keeps only its id."""
    n = len(dataset)
    if isinstance(user_ids, str):
        column = getattr(dataset, user_ids, None)
        if column is not None and not callable(column) and len(column) == n:
            ids = column
        else:
            ids = [_field(dataset[i], user_ids, i) for i in range(n)]
    elif callable(user_ids):
        ids = [user_ids(dataset[i]) for i in range(n)]
    else:
        ids = user_ids
    if len(ids) != n:
        raise ValueError(f"fxdp: user_ids holds {len(ids)} ids for a dataset of {n} records; give one user id per "
                         "record, in the dataset's order")
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    position: Dict[Hashable, int] = {}
    members: List[List[int]] = []
    for i, uid in enumerate(ids):
        uid = uid.item() if isinstance(uid, torch.Tensor) else uid
        k = position.setdefault(uid, len(members))
        if k == len(members):
            members.append([])
        members[k].append(i)
    return [torch.tensor(m, dtype=torch.long) for m in members]


def _field(record: Any, name: str, i: int) -> Hashable:
    try:
        value = record[name]
    except (KeyError, TypeError, IndexError):
        raise ValueError(f"fxdp: user_ids={name!r} names no field of record {i} (a {type(record).__name__}) and no "
                         "attribute of the dataset with one id per record; pass a sequence of ids or a function of "
                         "a record") from None
    return value.item() if isinstance(value, torch.Tensor) else value


class UserPoissonBatchSampler:
    """Yields ``steps`` batches of record indices: each user (a tensor of their record indices in ``users``) with
    probability ``sample_rate``, independently; up to ``max_records_per_user`` of a sampled user's records, chosen
    at random. :attr:`told` receives the record counts of each batch's users as the batch is drawn (the loader
    reads them back in order as it hands the batches out).

    ``rank_of_user`` (across processes): the rank that trains each user; this ``rank`` then keeps only its users'
    records of each batch, after drawing exactly what one process draws (every user's coin, every sampled user's
    records), so that the ranks, seeded alike, stay in step and together hand out the one-process batch."""

    def __init__(self, users: List[torch.Tensor], sample_rate: float, steps: int, max_records_per_user: int,
                 generator: Optional[torch.Generator] = None, *, rank: int = 0,
                 rank_of_user: Optional[torch.Tensor] = None):
        if not users:
            raise ValueError("fxdp: user-level sampling needs at least one user")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if isinstance(max_records_per_user, bool) or not isinstance(max_records_per_user, int) \
                or max_records_per_user < 1:
            raise ValueError(f"fxdp: max_records_per_user must be an int >= 1, got {max_records_per_user!r}")
        self.users = users
        self.sample_rate = float(sample_rate)
        self.steps = int(steps)
        self.max_records_per_user = max_records_per_user
        self.generator = generator
        self.rank = rank
        self.rank_of_user = None if rank_of_user is None else rank_of_user.tolist()
        self.told: Deque[torch.Tensor] = collections.deque()

    @property
    def num_users(self) -> int:
        return len(self.users)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        self.told.clear()  # (what an abandoned pass drew and never handed out)
        k = self.max_records_per_user
        for _ in range(self.steps):
            sampled = (torch.rand(len(self.users), generator=self.generator) < self.sample_rate).nonzero().flatten()
            batch, counts = [], []
            for u in sampled.tolist():
                records = self.users[u]
                if records.numel() > k:  # k of them, uniformly without replacement, afresh at each step
                    records = records[torch.randperm(records.numel(), generator=self.generator)[:k]]
                if self.rank_of_user is not None and self.rank_of_user[u] != self.rank:
                    continue  # another rank's user (drawn all the same: the ranks' generators stay in step)
                batch.append(records)
                counts.append(records.numel())
            self.told.append(torch.tensor(counts, dtype=torch.long))
            yield torch.cat(batch).tolist() if batch else []


class UserLevelDataLoader(DPDataLoader):
    """A :class:`~fxdp.data.DPDataLoader` sampling users (see the module docstring): ``sample_rate`` is the rate q
    at which each USER joins a batch; ``user_ids`` names each record's user (:func:`records_by_user`);
    ``max_records_per_user`` is k. Build one from an ordinary loader with :meth:`from_data_loader`.
    ``distributed=True``: each rank hands out its users' share of the batch (:mod:`fxdp.data.user_ranks`);
    :attr:`rank_of_user` says which rank trains each user. Not with ``padded_batches`` yet."""

    privacy_unit = "user"

    def __init__(self, dataset: Dataset, *, user_ids: UserIds, max_records_per_user: int, sample_rate: float,
                 steps: Optional[int] = None, distributed: bool = False, padded_batches: Union[bool, int] = False,
                 **kwargs: Any):
        if padded_batches:
            raise ValueError("fxdp: user-level sampling does not pad its batches yet; pass padded_batches=False")
        self.users = records_by_user(dataset, user_ids)
        self.max_records_per_user = max_records_per_user
        self.rank_of_user: Optional[torch.Tensor] = None  # across processes: the rank that trains each user
        super().__init__(dataset, sample_rate=sample_rate, steps=steps, distributed=distributed, **kwargs)

    def _batch_sampler(self, num_samples, sample_rate, steps, generator, rank, world_size):
        sampler = UserPoissonBatchSampler(self.users, sample_rate, steps, self.max_records_per_user, generator)
        if world_size > 1:  # the same users on every rank (checked), each trained by the rank assigned to it
            check_same_users(self.users, rank, world_size)
            self.rank_of_user = assign_users(self.users, world_size, self.max_records_per_user)
            sampler = UserPoissonBatchSampler(self.users, sample_rate, steps, self.max_records_per_user, generator,
                                              rank=rank, rank_of_user=self.rank_of_user)
        return sampler

    @property
    def num_users(self) -> int:
        return len(self.users)

    @property
    def expected_users(self) -> int:
        """The expected number of users per batch (``q`` times the number of users), rounded, at least 1: the
        ``"mean"`` loss normaliser of user-level training. Across processes, of the global batch (every rank counts
        every user), as one process would divide."""
        return max(1, round(self.sample_rate * self.num_users))

    @property
    def max_records_of_a_user(self) -> int:
        """The largest number of records one user has in the dataset (for the group-privacy comparison)."""
        return max(int(m.numel()) for m in self.users)

    def __iter__(self):
        if self.batch_observer is None:
            warnings.warn("fxdp: this UserLevelDataLoader samples users but no user-level DP optimizer observes its "
                          "batches: a model trained on them with an example-level optimizer would clip each record "
                          "alone, which the user-level ε does not cover. Use make_private(privacy_unit='user', ...), "
                          "or set loader.batch_observer = optimizer.observe_batch of a UserLevelDPOptimizer",
                          stacklevel=2)
        elif "users" not in inspect.signature(self.batch_observer).parameters:
            raise TypeError(
                "fxdp: this UserLevelDataLoader samples users, but its batch observer "
                f"({getattr(self.batch_observer, '__qualname__', self.batch_observer)!r}) does not take the batch's "
                "users: it is an example-level optimizer, which would clip each record alone. Build the optimizer "
                "with make_private(privacy_unit='user', user_ids=...) (a UserLevelDPOptimizer)")
        return super().__iter__()

    def _observed(self, batches, observer):
        first = True
        told = self.batch_sampler.told
        for batch in batches:
            counts = told.popleft()
            observer(empty=is_empty_batch(batch), new_epoch=first, users=counts)
            first = False
            yield batch

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, generator: Optional[torch.Generator] = None,
                         distributed: bool = False, *, user_ids: UserIds = None, max_records_per_user: int = None,
                         padded_batches: Union[bool, int] = False, batch_first: bool = True
                         ) -> "UserLevelDataLoader":
        """A user-level loader over ``data_loader``'s dataset: ``len(data_loader)`` steps per epoch at user rate
        ``q = 1 / len(data_loader)`` (so an epoch samples each user once in expectation); its collate function,
        workers and generator are kept."""
        steps = len(data_loader)
        if steps == 0:
            raise ValueError("fxdp: UserLevelDataLoader.from_data_loader: the loader has no batches")
        if user_ids is None or max_records_per_user is None:
            raise ValueError("fxdp: privacy_unit='user' needs user_ids (each record's user) and max_records_per_user "
                             "(k, the most records of one user in a step)")
        return cls(data_loader.dataset, user_ids=user_ids, max_records_per_user=max_records_per_user,
                   sample_rate=1.0 / steps, steps=steps, collate_fn=_unwrapped_collate(data_loader.collate_fn),
                   generator=generator if generator is not None else data_loader.generator, distributed=distributed,
                   padded_batches=padded_batches, batch_first=batch_first, **loader_options(data_loader))
