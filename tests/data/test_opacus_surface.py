"""fxdp.data's Opacus surface: EmptyBatchCollate learning its template (Opacus's CollateFnWithEmpty),
wrap_collate_with_empty, switch_generator, from_data_loader keeping the loader's generator, the
UniformWithReplacementSampler names, DPDataLoader(drop_last=)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from fxdp.data import (DistributedUniformWithReplacementSampler, DPDataLoader, EmptyBatchCollate,
                       UniformWithReplacementSampler, switch_generator, wrap_collate_with_empty)


def test_the_template_is_learnt_from_the_first_batch_and_structures_kept():
    collate = wrap_collate_with_empty(collate_fn=default_collate)
    assert isinstance(collate, EmptyBatchCollate)
    batch = collate([{"x": torch.ones(3), "y": torch.tensor(2)}, {"x": torch.zeros(3), "y": torch.tensor(1)}])
    assert batch["x"].shape == (2, 3)
    for _ in range(2):
        empty = collate([])
        assert set(empty) == {"x", "y"} and empty["x"].shape == (0, 3) and empty["y"].shape == (0,)
        assert empty["x"].dtype == torch.float32 and empty["y"].dtype == torch.int64


def test_an_empty_first_batch_gives_the_declared_shapes_with_a_warning(caplog):
    collate = EmptyBatchCollate(default_collate, sample_empty_shapes=[(0, 3, 4), (0,)],
                                dtypes=[torch.float64, torch.int32])
    with caplog.at_level(logging.WARNING, logger="fxdp.data.loader"):
        empty = collate([])
    assert [t.shape for t in empty] == [(0, 3, 4), (0,)] and [t.dtype for t in empty] == [torch.float64, torch.int32]
    assert "First batch is empty" in caplog.text
    assert EmptyBatchCollate(default_collate)([]) == []


def test_batch_second_and_random_empty_batches_and_no_collate():
    second = EmptyBatchCollate(default_collate, batch_first=False)
    second([torch.ones(4, 5)])  # one sample of (T=4, features=5)
    assert second([]).shape == (4, 0, 5)
    rand = EmptyBatchCollate(default_collate, rand_on_empty=True)
    rand([torch.ones(3, dtype=torch.long)])
    one = rand([])
    assert one.shape == (1, 3) and bool(((one == 0) | (one == 1)).all())
    samples = [torch.ones(2), torch.zeros(2)]
    assert EmptyBatchCollate(None)(samples) == samples


def test_a_batch_type_without_an_empty_form_is_refused_when_empty():
    collate = EmptyBatchCollate(lambda samples: "a string")
    assert collate([torch.ones(2)]) == "a string"
    with pytest.raises(TypeError, match="Unsupported batch type str"):
        collate([])


def test_the_loaders_empty_first_batch_has_the_datasets_shapes(caplog):
    x, y = torch.randn(10, 7), torch.randint(0, 3, (10,))
    loader = DPDataLoader(TensorDataset(x, y), sample_rate=0.05, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="fxdp.data.loader"):
        first = next(iter(loader))
    assert first[0].shape == (0, 7) and first[1].shape == (0,) and first[1].dtype == torch.int64
    assert "First batch is empty" in caplog.text


def read(loader):
    return torch.cat([x for (x,) in loader])


def test_from_data_loader_keeps_the_loaders_generator_unless_given_one():
    dataset = TensorDataset(torch.arange(80.0).unsqueeze(1))
    runs = []
    for _ in range(2):
        original = DataLoader(dataset, batch_size=8, generator=torch.Generator().manual_seed(5))
        runs.append(read(DPDataLoader.from_data_loader(original)))
    assert torch.equal(runs[0], runs[1])
    original = DataLoader(dataset, batch_size=8, generator=torch.Generator().manual_seed(5))
    other = read(DPDataLoader.from_data_loader(original, generator=torch.Generator().manual_seed(6)))
    assert not torch.equal(other, runs[0])


def test_switch_generator_of_a_shuffling_loader_and_refusal_of_a_sequential_one():
    dataset = TensorDataset(torch.arange(40.0).unsqueeze(1))
    plain = read(DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)))
    loader = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9))
    switched = read(switch_generator(data_loader=loader, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(plain, switched)
    with pytest.raises(ValueError, match="draws nothing at random"):
        switch_generator(data_loader=DataLoader(dataset, batch_size=4), generator=torch.Generator())


def test_uniform_with_replacement_sampler_is_poisson_and_yields_index_tensors():
    sampler = UniformWithReplacementSampler(num_samples=1000, sample_rate=0.05,
                                            generator=torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert len(sampler) == len(batches) == 20 and all(b.dtype == torch.long for b in batches)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    assert abs(sizes.mean().item() - 50) < 5 * (50 ** 0.5) / (20 ** 0.5) and len(set(sizes.tolist())) > 1


def test_distributed_sampler_shares_are_disjoint_by_rank(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda: 3)
    shares = []
    for rank in range(3):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        sampler = DistributedUniformWithReplacementSampler(total_size=300, sample_rate=0.1,
                                                           generator=torch.Generator().manual_seed(rank))
        shares.append({int(i) for batch in sampler for i in batch})
        assert len(sampler) == 10 and all(int(i) % 3 == rank for i in shares[-1])
    assert not (shares[0] & shares[1]) and not (shares[1] & shares[2])


def test_drop_last_is_accepted_and_ignored_with_a_warning():
    dataset = TensorDataset(torch.randn(20, 2))
    with pytest.warns(UserWarning, match="ignores drop_last=True"):
        loader = DPDataLoader(dataset, sample_rate=0.5, drop_last=True)
    assert len(loader) == 2
    DPDataLoader.from_data_loader(DataLoader(dataset, batch_size=3, drop_last=True))  # accepted as Opacus does
