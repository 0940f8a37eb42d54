"""User-level sampling (fxdp.data.users): each user joins a step with probability q, independently of the other
users and of their number of records; a sampled user brings min(n_u, k) of their records, chosen uniformly; the
loader tells the optimizer each batch's users and refuses an example-level optimizer."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from fxdp.data.users import UserLevelDataLoader, UserPoissonBatchSampler, records_by_user
from fxdp.optim import DPOptimizer, UserLevelDPOptimizer

Q = 0.1
STEPS = 4000
# 120 users with 1..50 records (user u has 1 + (u * 7) % 50), records of the users interleaved in the dataset
COUNTS = [1 + (u * 7) % 50 for u in range(120)]
USER_IDS = [u for r in range(50) for u, n in enumerate(COUNTS) if r < n]


def _draws(k=5, seed=0):
    users = records_by_user(range(len(USER_IDS)), USER_IDS)
    sampler = UserPoissonBatchSampler(users, Q, STEPS, k, generator=torch.Generator().manual_seed(seed))
    batches = list(sampler)
    return users, batches, list(sampler.told)


def test_each_user_joins_with_probability_q_whatever_their_record_count():
    users, batches, _ = _draws()
    owner = torch.tensor(USER_IDS)
    joined = torch.zeros(len(users))
    for batch in batches:
        joined[torch.unique(owner[torch.tensor(batch, dtype=torch.long)])] += 1 if batch else 0
    # each user's count of steps is Binomial(STEPS, Q): sd = sqrt(4000 * 0.1 * 0.9) = 19. With 120 users, a fixed
    # seed and a bound of 4.5 sd per user, a correct sampler fails with probability below 120 * 6.8e-6 < 1e-3.
    sd = math.sqrt(STEPS * Q * (1 - Q))
    z = (joined - STEPS * Q) / sd
    assert float(z.abs().max()) < 4.5, z
    # not sampled more often with more records: the users with 26-50 records against those with 1-25, whose
    # mean rates each have sd sqrt(Q (1 - Q) / (STEPS * 60)); the difference is within 4 sd of 0
    many = torch.tensor([n > 25 for n in COUNTS])
    rate = joined / STEPS
    difference = float(rate[many].mean() - rate[~many].mean())
    sd_difference = math.sqrt(Q * (1 - Q) / STEPS * (1 / int(many.sum()) + 1 / int((~many).sum())))
    assert abs(difference) < 4 * sd_difference


def test_users_join_independently():
    """Pairs: two users are in a step together with probability Q^2 (independence), summed over the pairs of
    users 0..19: 190 pairs, each Binomial(STEPS, Q^2); their total's sd is at most sqrt(190 * STEPS * Q^2) * sqrt(19)
    (positive correlation between pairs sharing a user bounds the variance by 19 times the independent one)."""
    users, batches, told = _draws()
    owner = torch.tensor(USER_IDS)
    together = 0
    for batch in batches:
        present = set(torch.unique(owner[torch.tensor(batch, dtype=torch.long)]).tolist()) if batch else set()
        inside = [u for u in range(20) if u in present]
        together += len(inside) * (len(inside) - 1) // 2
    expected = 190 * STEPS * Q * Q
    assert abs(together - expected) < 4 * math.sqrt(190 * STEPS * Q * Q * 19)
    # the number of users per step is Binomial(120, Q): its variance 120 Q (1 - Q) = 10.8, estimated from 4000
    # steps with sd about 10.8 * sqrt(2 / 3999) = 0.24; a correlated sampler would move it
    sizes = torch.tensor([len(c) for c in told], dtype=torch.float64)
    assert abs(float(sizes.mean()) - 120 * Q) < 4 * math.sqrt(120 * Q * (1 - Q) / STEPS)
    assert abs(float(sizes.var()) - 120 * Q * (1 - Q)) < 4 * 120 * Q * (1 - Q) * math.sqrt(2 / (STEPS - 1))


def test_a_sampled_user_brings_min_n_k_distinct_records_chosen_uniformly():
    k = 5
    users, batches, told = _draws(k=k)
    owner = torch.tensor(USER_IDS)
    big = max(range(len(users)), key=lambda u: users[u].numel())  # 50 records
    chosen = torch.zeros(len(USER_IDS))
    times = 0
    for batch, counts in zip(batches, told):
        batch = torch.tensor(batch, dtype=torch.long)
        assert int(counts.sum()) == batch.numel()
        start = 0
        for c in counts.tolist():  # grouped by user, one user's records together, each at most once
            records = batch[start:start + c]
            u = int(owner[records[0]])
            assert bool((owner[records] == u).all()) and records.unique().numel() == c
            assert c == min(users[u].numel(), k)
            if u == big:
                times += 1
                chosen[records] += 1
            start += c
    # each of the big user's 50 records is chosen with probability k / 50 when the user is sampled
    picks = chosen[users[big]]
    p = k / users[big].numel()
    sd = math.sqrt(times * p * (1 - p))
    assert float(((picks - times * p) / sd).abs().max()) < 4.5  # 50 records: a false alarm below 50 * 6.8e-6


def _loader(q=0.5, k=2, steps=20, seed=0):
    x = torch.arange(12, dtype=torch.float32).reshape(12, 1)
    dataset = TensorDataset(x, torch.zeros(12, dtype=torch.long))
    ids = [i % 4 for i in range(12)]  # 4 users of 3 records each
    return UserLevelDataLoader(dataset, user_ids=ids, max_records_per_user=k, sample_rate=q, steps=steps,
                               generator=torch.Generator().manual_seed(seed)), ids


def test_the_loader_tells_the_optimizer_each_batchs_users():
    loader, ids = _loader()
    told = []
    loader.batch_observer = lambda *, empty, new_epoch=False, users=None: told.append((empty, users))
    for x, _ in loader:
        empty, users = told[-1]  # told as the batch is handed out
        owners = [ids[int(v)] for v in x.flatten()]
        assert int(users.sum()) == len(owners) and empty == (len(owners) == 0)
        start = 0
        for c in users.tolist():
            assert len(set(owners[start:start + c])) == 1 and c <= 2
            start += c
    assert len(told) == 20 and any(e for e, _ in told)  # some steps with no user: empty batches, told as such


def test_user_ids_as_a_field_or_a_function():
    records = [{"x": i, "author": f"a{i % 3}"} for i in range(7)]
    by_field = records_by_user(records, "author")
    by_function = records_by_user(records, lambda r: r["author"])
    assert [m.tolist() for m in by_field] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [m.tolist() for m in by_function] == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="user_ids holds 3 ids for a dataset of 7 records"):
        records_by_user(records, [0, 1, 2])


def test_an_example_level_optimizer_is_refused():
    loader, _ = _loader()
    model = torch.nn.Linear(1, 1)
    plain = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2)
    loader.batch_observer = plain.observe_batch
    with pytest.raises(TypeError, match="does not take the batch's users: it is an example-level optimizer, which "
                                        "would clip each record alone"):
        next(iter(loader))
    user_level = UserLevelDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                      max_grad_norm=1.0, expected_batch_size=2)
    loader.batch_observer = user_level.observe_batch
    next(iter(loader))
    assert user_level._user_counts is not None


def test_options_it_cannot_take_are_refused():
    dataset = TensorDataset(torch.zeros(4, 1))
    with pytest.raises(ValueError, match="user-level sampling does not pad its batches yet"):
        UserLevelDataLoader(dataset, user_ids=[0, 0, 1, 1], max_records_per_user=1, sample_rate=0.5,
                            padded_batches=True)
    with pytest.raises(ValueError, match="max_records_per_user must be an int >= 1, got 0"):
        UserLevelDataLoader(dataset, user_ids=[0, 0, 1, 1], max_records_per_user=0, sample_rate=0.5)


def test_with_worker_processes_each_batch_is_told_with_its_own_users():
    """Workers load batches ahead of the one handed out: the users told are still those of the batch handed out."""
    x = torch.arange(40, dtype=torch.float32).reshape(40, 1)
    ids = [i % 9 for i in range(40)]  # 9 users of 4 or 5 records
    loader = UserLevelDataLoader(TensorDataset(x), user_ids=ids, max_records_per_user=3, sample_rate=0.4, steps=12,
                                 generator=torch.Generator().manual_seed(1), num_workers=2)
    told = []
    loader.batch_observer = lambda *, empty, new_epoch=False, users=None: told.append(users)
    for (batch,) in loader:
        owners = [ids[int(v)] for v in batch.flatten()]
        users = told[-1]
        assert int(users.sum()) == len(owners)
        start = 0
        for c in users.tolist():
            assert len(set(owners[start:start + c])) == 1
            start += c
        # the next user's records are another user's
        starts = torch.cumsum(users, 0)[:-1].tolist()
        assert all(owners[s - 1] != owners[s] for s in starts)
    assert len(told) == 12
