"""Users across processes (fxdp.data.user_ranks): which rank trains which user, and each rank's share of a user
sample, checked without processes: samplers of ranks 0..W-1 seeded alike must together hand out exactly the batches
one process draws from that seed, each user's records all on the user's rank."""

from __future__ import annotations

import pytest
import torch

from fxdp.data.user_ranks import assign_users, users_fingerprint
from fxdp.data.users import UserPoissonBatchSampler, records_by_user

# 30 users of 1 to 9 records (the records of each user scattered over the dataset)
_COUNTS = torch.randint(1, 10, (30,), generator=torch.Generator().manual_seed(0))
_IDS = torch.repeat_interleave(torch.arange(30), _COUNTS)[torch.randperm(int(_COUNTS.sum()),
                                                                          generator=torch.Generator().manual_seed(1))]
USERS = records_by_user(list(range(len(_IDS))), _IDS.tolist())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ranks_shares_are_the_one_process_batch(world):
    k, steps = 4, 40
    owners = assign_users(USERS, world, k)
    alone = UserPoissonBatchSampler(USERS, 0.3, steps, k, torch.Generator().manual_seed(7))
    ranks = [UserPoissonBatchSampler(USERS, 0.3, steps, k, torch.Generator().manual_seed(7), rank=r,
                                     rank_of_user=owners) for r in range(world)]
    user_of = {i: u for u, records in enumerate(USERS) for i in records.tolist()}
    nonempty = 0
    for step, (batch, *shares) in enumerate(zip(alone, *ranks)):
        assert sorted(sum(shares, [])) == sorted(batch)  # the same records, each on one rank
        nonempty += bool(batch)
        told = [ranks[r].told.popleft() for r in range(world)]
        for r, (share, counts) in enumerate(zip(shares, told)):
            assert all(int(owners[user_of[i]]) == r for i in share)
            assert int(counts.sum()) == len(share)
            start = 0
            for c in counts.tolist():  # grouped by user, each user's records together
                assert len({user_of[i] for i in share[start:start + c]}) == 1
                start += c
        # the users told by the ranks together are the one process's, with as many records each
        assert sorted(torch.cat(told).tolist()) == sorted(alone.told.popleft().tolist())
    assert nonempty > steps // 2


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k", [1, 3, 9])
def test_users_are_dealt_evenly_by_the_records_they_bring(world, k):
    owners = assign_users(USERS, world, k)
    assert owners.shape == (len(USERS),) and set(owners.tolist()) <= set(range(world))
    users = torch.bincount(owners, minlength=world)
    assert int(users.max() - users.min()) <= 1
    loads = torch.tensor([min(m.numel(), k) for m in USERS])
    per_rank = torch.zeros(world, dtype=torch.long).index_add_(0, owners, loads)
    assert int(per_rank.max() - per_rank.min()) <= k
    assert torch.equal(assign_users(list(USERS), world, k), owners)  # a function of the users alone


def test_the_fingerprint_tells_other_groupings_apart():
    same = records_by_user(list(range(len(_IDS))), _IDS.tolist())
    assert users_fingerprint(same) == users_fingerprint(USERS)
    moved = _IDS.clone()
    moved[0] = (moved[0] + 1) % 30  # one record of another user
    assert users_fingerprint(records_by_user(list(range(len(_IDS))), moved.tolist())) != users_fingerprint(USERS)
