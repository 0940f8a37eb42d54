"""Poisson sampling and the memory manager: inclusion rates, batch-size statistics, empty batches,
the split across ranks, physical batches and the skip signals the optimizer receives.

Statistical checks use a fixed seed; each tolerance is a stated number of standard deviations of
the quantity tested, so a correct sampler passes for essentially any seed and a wrong one (fixed
batch sizes, a wrong rate, shared or missing indices) fails."""

from __future__ import annotations

import math
import warnings
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fxdp.data import BatchMemoryManager, DPDataLoader, EmptyBatchCollate, PoissonBatchSampler


def masks(sampler: PoissonBatchSampler) -> torch.Tensor:
    """(steps, num_samples) 0/1 matrix of which index was in which batch."""
    rows = []
    for batch in sampler:
        row = torch.zeros(sampler.num_samples)
        row[batch] = 1.0
        assert row.sum() == len(batch), "an index appeared twice in one batch"
        rows.append(row)
    return torch.stack(rows)


class IndexDataset(Dataset):
    """Sample i is the tensor [i] with label i: batches tell which indices they hold."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i


# -- the sampler -------------------------------------------------------------------------------------


def test_each_sample_is_included_at_rate_q():
    n, q, steps = 1000, 0.1, 200
    m = masks(PoissonBatchSampler(n, q, steps, generator=torch.Generator().manual_seed(0)))
    # Overall rate: the mean of n*steps Bernoulli(q); 5 standard deviations.
    sd = math.sqrt(q * (1 - q) / (n * steps))
    assert abs(m.mean().item() - q) < 5 * sd
    # Every sample at the same rate: its count is Binomial(steps, q); the sum of squared standardised
    # deviations is ~ chi-square with n degrees of freedom (mean n, sd sqrt(2n)); 5 sd. A sampler that
    # favours some indices (or visits each exactly once per epoch) lands far outside.
    counts = m.sum(0)
    chi2 = (((counts - steps * q) ** 2) / (steps * q * (1 - q))).sum().item()
    assert abs(chi2 - n) < 5 * math.sqrt(2 * n)


def test_batch_sizes_vary_binomially_and_samples_are_independent():
    n, q, steps = 1000, 0.1, 400
    m = masks(PoissonBatchSampler(n, q, steps, generator=torch.Generator().manual_seed(1)))
    sizes = m.sum(1)
    # Mean batch size q*n (sd of the mean: sqrt(n q (1-q) / steps) = 0.47); 5 sd.
    assert abs(sizes.mean().item() - q * n) < 5 * math.sqrt(n * q * (1 - q) / steps)
    # Batch sizes vary like Binomial(n, q): variance n q (1-q) = 90. The sample variance of 400 draws
    # has relative sd about sqrt(2/399) = 0.07; allow 35% (5 sd). Fixed-size batches have variance 0.
    variance = sizes.var().item()
    assert abs(variance / (n * q * (1 - q)) - 1) < 0.35
    # Two different samples are together in a batch with probability q^2 (independence). Over
    # n(n-1)/2 pairs and `steps` batches the mean co-inclusion has sd well below 1e-4; allow 5e-4.
    together = m.T @ m
    off_diagonal = (together.sum() - together.diagonal().sum()) / (n * (n - 1) * steps)
    assert abs(off_diagonal.item() - q * q) < 5e-4
    # Consecutive batches are independent too: a sample is in both with probability q^2.
    consecutive = (m[1:] * m[:-1]).mean().item()
    assert abs(consecutive - q * q) < 5 * math.sqrt(q * q / (n * (steps - 1)))


def test_ranks_share_the_mask_and_split_it_exactly_once():
    n, q, steps, world = 103, 0.3, 50, 4
    whole = masks(PoissonBatchSampler(n, q, steps, generator=torch.Generator().manual_seed(7)))
    per_rank = [
        masks(PoissonBatchSampler(n, q, steps, generator=torch.Generator().manual_seed(7), rank=r, world_size=world))
        for r in range(world)
    ]
    # Every included sample is taken by exactly one rank, and only included samples are taken.
    assert torch.equal(sum(per_rank), whole)
    for r, m in enumerate(per_rank):
        taken = m.nonzero()[:, 1]
        assert (taken % world == r).all(), f"rank {r} took an index of another rank"


def test_ranks_need_a_shared_generator():
    with pytest.raises(ValueError, match="seeded with the same seed on every rank"):
        PoissonBatchSampler(10, 0.5, 3, rank=1, world_size=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_samples=0, sample_rate=0.5, steps=1), "non-empty"),
        (dict(num_samples=5, sample_rate=0.0, steps=1), r"sample_rate must be in \(0, 1\]"),
        (dict(num_samples=5, sample_rate=1.5, steps=1), r"sample_rate must be in \(0, 1\]"),
        (dict(num_samples=5, sample_rate=0.5, steps=1, rank=2, world_size=2), "rank < world_size"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoissonBatchSampler(**kwargs, generator=torch.Generator())


def test_global_seed_makes_default_sampling_reproducible():
    torch.manual_seed(3)
    first = list(PoissonBatchSampler(50, 0.2, 5))
    torch.manual_seed(3)
    assert list(PoissonBatchSampler(50, 0.2, 5)) == first


# -- the loader --------------------------------------------------------------------------------------


def collate_with_marker(samples):
    x, y = torch.utils.data.default_collate(samples)
    return {"x": x, "y": y, "marker": torch.ones(len(samples), dtype=torch.bool)}


def test_from_data_loader_keeps_options_and_sets_rate_and_length():
    ds = TensorDataset(torch.randn(100, 3), torch.arange(100))
    original = DataLoader(ds, batch_size=7, collate_fn=collate_with_marker, num_workers=0, pin_memory=False,
                          timeout=0, drop_last=False)
    dl = DPDataLoader.from_data_loader(original, generator=torch.Generator().manual_seed(0))
    assert len(original) == 15
    assert dl.sample_rate == pytest.approx(1 / 15)
    assert len(dl) == 15
    assert dl.dataset is ds
    batches = list(dl)
    assert len(batches) == 15
    assert all(set(b) == {"x", "y", "marker"} for b in batches)  # the loader's collate_fn is used
    assert len({len(b["y"]) for b in batches}) > 1  # Poisson: the sizes vary


def test_from_data_loader_keeps_worker_options():
    ds = TensorDataset(torch.randn(40, 2), torch.arange(40))
    original = DataLoader(ds, batch_size=4, num_workers=2, prefetch_factor=3, persistent_workers=True, timeout=30)
    dl = DPDataLoader.from_data_loader(original, generator=torch.Generator().manual_seed(0))
    assert (dl.num_workers, dl.prefetch_factor, dl.persistent_workers, dl.timeout) == (2, 3, True, 30)
    with_workers = [y.tolist() for _, y in dl]
    alone = DPDataLoader.from_data_loader(DataLoader(ds, batch_size=4), generator=torch.Generator().manual_seed(0))
    assert with_workers == [y.tolist() for _, y in alone]  # workers load the same Poisson batches
    assert len(with_workers) == 10


class TupleDataset(Dataset):
    """A dataset of plain tuples (image, label, caption) rather than a TensorDataset."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return torch.full((2, 5, 5), float(i), dtype=torch.float16), i, f"sample {i}"


Pair = namedtuple("Pair", "features target")


class DictDataset(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"features": torch.zeros(4, dtype=torch.float64), "pair": Pair(torch.zeros(3), torch.tensor(i))}


def test_empty_batches_are_yielded_with_the_samples_shape_and_dtype():
    ds = TensorDataset(torch.randn(30, 3, 4), torch.randint(0, 10, (30,)))
    dl = DPDataLoader(ds, sample_rate=1e-6, steps=4, generator=torch.Generator().manual_seed(0))
    batches = list(dl)
    assert len(batches) == 4  # empty batches are not skipped
    for x, y in batches:
        assert x.shape == (0, 3, 4) and x.dtype == torch.float32
        assert y.shape == (0,) and y.dtype == torch.int64
    # A model runs on it: the optimizer gets its (empty) step.
    out = torch.nn.Linear(4, 2)(batches[0][0])
    assert out.shape == (0, 3, 2)


def test_empty_batch_of_tuples_and_dicts():
    (x, y, captions), = list(DPDataLoader(TupleDataset(), sample_rate=1e-6, steps=1))
    assert x.shape == (0, 2, 5, 5) and x.dtype == torch.float16
    assert y.shape == (0,) and y.dtype == torch.int64
    (_, _, non_empty_captions), = list(DPDataLoader(TupleDataset(), sample_rate=1.0, steps=1))
    assert len(captions) == 0 and type(captions) is type(non_empty_captions)
    (batch,) = list(DPDataLoader(DictDataset(), sample_rate=1e-6, steps=1))
    assert batch["features"].shape == (0, 4) and batch["features"].dtype == torch.float64
    assert isinstance(batch["pair"], Pair)
    assert batch["pair"].features.shape == (0, 3) and batch["pair"].target.shape == (0,)


def test_empty_batch_collate_delegates_non_empty_batches():
    collate = EmptyBatchCollate(collate_with_marker, TensorDataset(torch.randn(3, 2), torch.arange(3)))
    out = collate([(torch.ones(2), torch.tensor(1)), (torch.zeros(2), torch.tensor(0))])
    assert out["x"].shape == (2, 2) and out["marker"].all()
    assert collate([])["marker"].shape == (0,)


def test_loader_refuses_what_it_cannot_sample():
    ds = TensorDataset(torch.randn(5, 2))
    with pytest.raises(TypeError, match="do not pass batch_size, shuffle"):
        DPDataLoader(ds, sample_rate=0.5, batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match="non-empty dataset"):
        DPDataLoader(TensorDataset(torch.randn(0, 2)), sample_rate=0.5)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(2)

    with pytest.raises(TypeError, match="IterableDataset"):
        DPDataLoader.from_data_loader(DataLoader(Stream(), batch_size=2))


def test_distributed_without_process_group_warns_and_samples_alone():
    ds = TensorDataset(torch.randn(20, 2))
    with pytest.warns(UserWarning, match="torch.distributed is not initialised"):
        dl = DPDataLoader(ds, sample_rate=0.5, steps=2, distributed=True)
    assert (dl.rank, dl.world_size) == (0, 1)


def test_distributed_with_a_process_group_broadcasts_the_seed():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ds = IndexDataset(60)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dl = DPDataLoader(ds, sample_rate=0.2, steps=5, distributed=True)
        assert (dl.rank, dl.world_size, dl.distributed) == (0, 1, True)
        assert dl.batch_sampler.generator is not None  # sampled from the shared seed
        assert len(list(dl)) == 5
    finally:
        dist.destroy_process_group()


def _rank_main(rank, world, store_path, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)  # different global generators: the broadcast seed must still agree
        dl = DPDataLoader(IndexDataset(50), sample_rate=0.4, steps=6, distributed=True)
        batches = [y.tolist() for _, y in dl]
        results.put((rank, dl.world_size, dl.batch_sampler.generator.initial_seed(), batches))
    finally:
        dist.destroy_process_group()


def test_two_processes_share_the_seed_and_split_each_batch(tmp_path):
    import multiprocessing

    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(r, 2, tmp_path / "store", results)) for r in range(2)]
    for p in processes:
        p.start()
    out = sorted(results.get(timeout=120) for _ in processes)
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0
    (r0, w0, seed0, batches0), (r1, w1, seed1, batches1) = out
    assert (r0, r1, w0, w1) == (0, 1, 2, 2)
    assert seed0 == seed1  # rank 0's seed, broadcast
    # The masks a single process draws from that seed, split by index parity.
    whole = list(PoissonBatchSampler(50, 0.4, 6, generator=torch.Generator().manual_seed(seed0)))
    for mine0, mine1, batch in zip(batches0, batches1, whole):
        assert mine0 == [i for i in batch if i % 2 == 0]
        assert mine1 == [i for i in batch if i % 2 == 1]


# -- the memory manager ------------------------------------------------------------------------------


class RecordingOptimizer:
    """Stands in for the DP optimizer: records the skip signals it receives."""

    def __init__(self):
        self.signals = []

    def signal_skip_step(self, do_skip=True):
        self.signals.append(do_skip)


def logical_and_physical(n, q, steps, max_physical, seed, **loader_kwargs):
    ds = IndexDataset(n)
    logical = [y.tolist() for _, y in DPDataLoader(ds, sample_rate=q, steps=steps,
                                                   generator=torch.Generator().manual_seed(seed))]
    dl = DPDataLoader(ds, sample_rate=q, steps=steps, generator=torch.Generator().manual_seed(seed), **loader_kwargs)
    opt = RecordingOptimizer()
    physical = []
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=max_physical, optimizer=opt) as loader:
        for _, y in loader:
            physical.append((y.tolist(), opt.signals[-1]))
    assert len(opt.signals) == len(physical)  # one signal before every physical batch
    return logical, physical


@pytest.mark.parametrize("num_workers", [0, 2])
def test_memory_manager_splits_logical_batches_and_signals_skips(num_workers):
    logical, physical = logical_and_physical(200, 0.2, 6, 16, seed=0, num_workers=num_workers)
    assert all(len(indices) <= 16 for indices, _ in physical)
    # Regroup physical batches at each "step now" signal: exactly the logical batches come back.
    regrouped, current = [], []
    for indices, do_skip in physical:
        current += indices
        if not do_skip:
            regrouped.append(current)
            current = []
    assert current == []
    assert regrouped == logical
    # Within a logical batch of size b: ceil(b / 16) physical batches, all but the last skipped.
    expected = []
    for batch in logical:
        k = max(1, math.ceil(len(batch) / 16))
        expected += [True] * (k - 1) + [False]
    assert [do_skip for _, do_skip in physical] == expected


def test_memory_manager_steps_on_an_empty_logical_batch():
    logical, physical = logical_and_physical(50, 1e-6, 3, 8, seed=0)
    assert logical == [[], [], []]
    assert physical == [([], False)] * 3


def test_memory_manager_keeps_batches_that_fit():
    logical, physical = logical_and_physical(100, 0.05, 10, 1000, seed=2)
    assert [indices for indices, _ in physical] == logical
    assert all(do_skip is False for _, do_skip in physical)


def test_memory_manager_loader_reports_rate_and_expected_length():
    dl = DPDataLoader(IndexDataset(1000), sample_rate=0.1, steps=10)
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=32, optimizer=RecordingOptimizer()) as loader:
        assert loader.sample_rate == 0.1
        assert len(loader) == 10 * math.ceil(100 / 32)


def test_memory_manager_refuses_a_plain_optimizer_and_bad_sizes():
    dl = DPDataLoader(IndexDataset(10), sample_rate=0.5, steps=1)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match="needs the DP optimizer .*got SGD"):
        BatchMemoryManager(data_loader=dl, max_physical_batch_size=4, optimizer=plain)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="max_physical_batch_size must be a positive int"):
            BatchMemoryManager(data_loader=dl, max_physical_batch_size=bad, optimizer=RecordingOptimizer())


# -- the memory manager with the real DP optimizer ---------------------------------------------------


def small_classifier(bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8, bias=bias), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=bias))


def private_run(max_physical, noise_multiplier, *, q=0.3, steps=4, seed=0, grad_sample_mode="fx", bias=True):
    """Parameters after `steps` logical steps of DP-SGD on a small classifier, with the logical batches
    fed whole (max_physical=None) or cut by the memory manager. Sampling and noise are seeded, so two
    runs see the same logical batches and (noise once per logical step) the same noise."""
    import fxdp
    from fxdp.sinks.contract import sink_of
    from fxdp.optim import DPOptimizer

    model = small_classifier(bias)
    data = TensorDataset(torch.randn(60, 6) * 5, torch.randint(0, 3, (60,)))  # large inputs: all clipped
    if grad_sample_mode == "fx":
        dp_model = fxdp.compile_for_dp(model, example_inputs=torch.zeros(2, 6))
    else:
        dp_model = fxdp.GradSampleModule(model)
    loader = DPDataLoader(data, sample_rate=q, steps=steps, generator=torch.Generator().manual_seed(seed))
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=noise_multiplier,
                            max_grad_norm=0.1, expected_batch_size=max(1, round(q * len(data))), sink=sink_of(dp_model),
                            generator=torch.Generator().manual_seed(seed + 1))

    def train(batches):
        for x, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(dp_model(x), y).backward()
            optimizer.step()

    if max_physical is None:
        train(loader)
    else:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=max_physical, optimizer=optimizer) as pl:
            train(pl)
    assert optimizer.steps == steps  # one optimizer step per logical batch, however it was cut
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("grad_sample_mode", ["fx", "hooks"])
@pytest.mark.parametrize("noise_multiplier", [0.0, 1.0])
def test_physical_steps_accumulate_to_one_logical_step(noise_multiplier, grad_sample_mode):
    whole = private_run(None, noise_multiplier, grad_sample_mode=grad_sample_mode)
    for max_physical in (1, 5, 7):
        cut = private_run(max_physical, noise_multiplier, grad_sample_mode=grad_sample_mode)
        for a, b in zip(whole, cut):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and training did something (so equality is not trivially "nothing moved")
    initial = list(small_classifier().parameters())
    assert any(not torch.equal(a, b) for a, b in zip(whole, initial))


@pytest.mark.parametrize("grad_sample_mode", ["fx", "hooks"])
def test_empty_logical_batches_still_step_with_noise_under_the_memory_manager(grad_sample_mode):
    # bias=False: the per-sample rule of a Linear bias does not take an empty batch yet (reported)
    initial = list(small_classifier(bias=False).parameters())
    after = private_run(4, 1.0, q=1e-6, steps=3, bias=False, grad_sample_mode=grad_sample_mode)  # every logical batch is empty
    assert all(not torch.equal(a, b) for a, b in zip(after, initial))  # the noise moved every parameter
