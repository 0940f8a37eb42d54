"""Cyclic Poisson sampling: each batch from its step's part only, the split fixed for the whole run, a sample's
steps a whole number of cycles apart across passes, and the loader's rates and sizes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fxdp.data import CyclicPoissonBatchSampler, CyclicPoissonDataLoader, DPDataLoader


def dataset(n=200):
    return TensorDataset(torch.arange(n, dtype=torch.float32)[:, None])


def test_each_batch_comes_from_its_steps_part_and_the_split_is_kept_across_passes():
    loader = CyclicPoissonDataLoader(dataset(), sample_rate=0.5, partitions=4,
                                     generator=torch.Generator().manual_seed(1))
    part = loader.partition_of.clone()
    steps_of = {}  # sample -> the global steps it took part in
    for epoch in range(3):
        for k, (x,) in enumerate(loader):
            assert loader.cycle_position == k % 4
            samples = x[:, 0].long()
            assert (part[samples] == k % 4).all()
            for s in samples.tolist():
                steps_of.setdefault(s, []).append(epoch * len(loader) + k)
    assert torch.equal(loader.partition_of, part)
    gaps = [b - a for steps in steps_of.values() for a, b in zip(steps, steps[1:])]
    assert gaps and min(gaps) >= 4 and all(g % 4 == 0 for g in gaps)


def test_the_rate_within_a_part_is_the_sample_rate():
    """Over many steps, a part's sample joins its step's batch with rate q: 5-sigma binomial bound."""
    n, q, partitions = 400, 0.3, 2
    sampler = CyclicPoissonBatchSampler(n, q, 400, partitions, generator=torch.Generator().manual_seed(0))
    sizes = torch.bincount(sampler.partition_of, minlength=partitions)
    drawn = sum(len(batch) for batch in sampler)
    trials = int(sum(sizes[t % partitions] for t in range(400)))
    assert abs(drawn - q * trials) <= 5 * (trials * q * (1 - q)) ** 0.5


def test_from_data_loader_keeps_the_batch_size_and_steps_a_whole_number_of_cycles():
    plain = DataLoader(dataset(), batch_size=30)  # 7 batches
    loader = CyclicPoissonDataLoader.from_data_loader(plain, partitions=3)
    assert len(loader) == 9 and loader.sample_rate == pytest.approx(3 / 9)
    assert loader.expected_batch_size == pytest.approx(200 / 9)


def test_a_saved_split_is_restored():
    first = CyclicPoissonDataLoader(dataset(), sample_rate=0.5, partitions=4)
    again = CyclicPoissonDataLoader(dataset(), sample_rate=0.5, partitions=4, partition_of=first.partition_of)
    assert torch.equal(again.partition_of, first.partition_of)
    assert again.partition_fingerprint == first.partition_fingerprint


def test_what_is_refused():
    with pytest.raises(ValueError, match="multiple of partitions=4"):
        CyclicPoissonDataLoader(dataset(), sample_rate=0.5, partitions=4, steps=6)
    with pytest.raises(ValueError, match="one part in"):
        CyclicPoissonDataLoader(dataset(), sample_rate=0.5, partitions=2, partition_of=torch.full((200,), 2))
    with pytest.raises(ValueError, match="padded_batches"):
        CyclicPoissonDataLoader(dataset(), sample_rate=0.5, partitions=2, padded_batches=True)
    assert isinstance(CyclicPoissonDataLoader(dataset(), sample_rate=0.5, partitions=2), DPDataLoader)


def test_across_processes_the_ranks_shares_are_the_batches_of_one_process():
    """Two ranks with generators seeded alike: the same parts, and each batch of one process split between them
    (rank r keeps the indices i with i % 2 == r), disjoint: the same global law."""
    alone = CyclicPoissonBatchSampler(50, 0.4, 12, 3, generator=torch.Generator().manual_seed(5))
    ranks = [CyclicPoissonBatchSampler(50, 0.4, 12, 3, generator=torch.Generator().manual_seed(5), rank=r,
                                       world_size=2) for r in range(2)]
    assert all(torch.equal(r.partition_of, alone.partition_of) for r in ranks)
    batches = list(alone)
    assert sum(map(len, batches)) > 0
    for batch, share0, share1 in zip(batches, *ranks):
        assert all(i % 2 == 0 for i in share0) and all(i % 2 == 1 for i in share1)
        assert sorted(share0 + share1) == batch
    with pytest.raises(ValueError, match="seeded alike on every rank"):
        CyclicPoissonBatchSampler(50, 0.4, 12, 3, rank=0, world_size=2)
