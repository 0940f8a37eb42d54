"""Cyclic Poisson sampling: the sampling that banded matrix factorization's amplified accounting assumes.

The dataset is split once into ``partitions`` (b) disjoint parts; step ``t`` Poisson-samples from part
``t mod b`` only: each of its samples joins the batch independently with probability ``sample_rate`` (q).
So a sample can take part only in steps ``b`` apart, and in at most ``ceil(steps / b)`` of them
(Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization", Algorithm 2).

The split: every sample gets a part drawn uniformly at random and independently of every other sample (one
draw per sample when the sampler is built, kept for the whole run; ``partition_of`` restores a saved one).
Independent labels, not an equal split, so that adding or removing one sample leaves every other sample's
part unchanged, as the add/remove neighbouring of the accounting needs. A part's expected size is
``len(dataset) / b``, and a batch's expected size ``q * len(dataset) / b`` (which ``"mean"`` divides by).

Across processes (``distributed=True``, what ``make_private`` builds for DDP and FSDP2) the law is the same: as for
Poisson sampling (:class:`fxdp.data.DPDataLoader`), rank 0 draws a seed that every rank receives, every rank draws
the same parts and the same coins from it, and rank ``r`` keeps the indices ``i`` of each batch with
``i % world_size == r``: the union of the ranks' batches is the batch one process draws from that seed.

Every pass over the loader starts the cycle at part 0, and holds a whole number of cycles
(``steps`` a multiple of ``b``): :attr:`CyclicPoissonDataLoader.cycle_position` is the part of the batch
handed out last, which the banded MF noise checks at every step (a pass left early would break the cycle).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from fxdp.data.loader import DPDataLoader, _unwrapped_collate, loader_options


class CyclicPoissonBatchSampler(Sampler[List[int]]):
    """``steps`` batches of dataset indices: batch ``t`` holds each index of part ``t mod partitions``
    independently with probability ``sample_rate`` (see the module docstring). ``generator`` draws the parts
    (when ``partition_of`` is not given) and then the batches."""

    def __init__(self, num_samples: int, sample_rate: float, steps: int, partitions: int, *,
                 generator: Optional[torch.Generator] = None, partition_of: Optional[torch.Tensor] = None,
                 rank: int = 0, world_size: int = 1):
        if num_samples <= 0:
            raise ValueError(f"fxdp: CyclicPoissonBatchSampler needs a non-empty dataset, got {num_samples} samples")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"fxdp: sample_rate must be in (0, 1], got {sample_rate}")
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"fxdp: partitions must be an int >= 1, got {partitions!r}")
        if not isinstance(steps, int) or steps < 0 or steps % partitions:
            raise ValueError(f"fxdp: a cyclic Poisson pass holds a whole number of cycles: steps must be a multiple of "
                             f"partitions={partitions}, got steps={steps!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"fxdp: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if world_size > 1 and generator is None:
            raise ValueError("fxdp: with world_size > 1 every rank must draw the same parts and coins: pass a "
                             "torch.Generator seeded alike on every rank (CyclicPoissonDataLoader(distributed=True) "
                             "does)")
        if partition_of is None:
            partition_of = torch.randint(partitions, (num_samples,), generator=generator,
                                         device=generator.device if generator is not None else None).cpu()
        partition_of = torch.as_tensor(partition_of)
        if (partition_of.shape != (num_samples,) or partition_of.is_floating_point()
                or bool(((partition_of < 0) | (partition_of >= partitions)).any())):
            raise ValueError(f"fxdp: partition_of must hold one part in [0, {partitions}) per sample "
                             f"({num_samples}), got a tensor of shape {tuple(partition_of.shape)}")
        self.num_samples, self.sample_rate, self.steps = int(num_samples), float(sample_rate), int(steps)
        self.partitions, self.generator = partitions, generator
        self.rank, self.world_size = int(rank), int(world_size)
        self.partition_of = partition_of.to(torch.int64)

    @property
    def partition_fingerprint(self) -> str:
        """A digest of which sample is in which part (a resumed run must keep the same assignment)."""
        return hashlib.sha256(self.partition_of.numpy().tobytes()).hexdigest()[:32]

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        for step in range(self.steps):
            device = self.generator.device if self.generator is not None else None
            coins = torch.rand(self.num_samples, generator=self.generator, device=device).cpu() < self.sample_rate
            indices = (coins & (self.partition_of == step % self.partitions)).nonzero().flatten()
            if self.world_size > 1:  # this rank's share of the batch one process draws
                indices = indices[indices % self.world_size == self.rank]
            yield indices.tolist()


class CyclicPoissonDataLoader(DPDataLoader):
    """A :class:`DPDataLoader` whose batches are cyclic Poisson samples (see the module docstring): what
    ``BandedMatrixFactorization`` noise needs, and what :class:`fxdp.accounting.CyclicPoissonBandedMFAccountant`
    accounts for.

    Args:
        sample_rate: q, the probability that a sample of the step's part joins its batch.
        partitions: b, at least the banded MF noise's bands.
        steps: batches per pass, a multiple of ``partitions`` (default ``partitions * round(1 / sample_rate)``:
            each sample expected in one batch per pass).
        partition_of: a saved assignment of samples to parts (:attr:`partition_of` of the loader of an earlier
            run), to resume it; drawn from ``generator`` otherwise.

    ``distributed=True``: each rank's share of the batches one process draws (see the module docstring); the
    expected batch size is the global one. Not with padded batches yet.
    """

    def __init__(self, dataset: Dataset, *, sample_rate: float, partitions: int, steps: Optional[int] = None,
                 partition_of: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
                 distributed: bool = False, padded_batches: bool = False, **loader_kwargs: Any):
        if padded_batches:
            raise ValueError("fxdp: CyclicPoissonDataLoader does not support padded_batches yet; use it without "
                             "padding")
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"fxdp: partitions must be an int >= 1, got {partitions!r}")
        self.partitions = partitions
        self._partition_of = partition_of
        self.cycle_position: Optional[int] = None  # the part of the batch handed out last
        if steps is None and 0 < sample_rate <= 1:
            steps = partitions * max(1, round(1.0 / sample_rate))
        super().__init__(dataset, sample_rate=sample_rate, steps=steps, generator=generator, distributed=distributed,
                         **loader_kwargs)

    def _batch_sampler(self, num_samples, sample_rate, steps, generator, rank, world_size) -> CyclicPoissonBatchSampler:
        return CyclicPoissonBatchSampler(num_samples, sample_rate, steps, self.partitions, generator=generator,
                                         partition_of=self._partition_of, rank=rank, world_size=world_size)

    @property
    def partition_of(self) -> torch.Tensor:
        """Each sample's part (keep it to resume a run: ``partition_of=`` of a new loader)."""
        return self.batch_sampler.partition_of

    @property
    def partition_fingerprint(self) -> str:
        return self.batch_sampler.partition_fingerprint

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * len(dataset) / partitions``: a part's expected size times the rate."""
        return self.sample_rate * len(self.dataset) / self.partitions

    def __iter__(self):
        for k, batch in enumerate(super().__iter__()):
            self.cycle_position = k % self.partitions  # (a pass starts its cycle at part 0)
            yield batch

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, generator: Optional[torch.Generator] = None,
                         distributed: bool = False, *, partitions: int = 1, **kwargs: Any) -> "CyclicPoissonDataLoader":
        """A cyclic Poisson loader over ``data_loader``'s dataset with about its batch size: ``len(data_loader)``
        (rounded up to a multiple of ``partitions``) steps per pass and ``sample_rate = partitions / steps``, so a
        batch's expected size is ``len(dataset) / steps`` and each sample is expected in one batch per pass."""
        if isinstance(data_loader.dataset, IterableDataset):
            raise TypeError(f"fxdp: CyclicPoissonDataLoader needs a map-style dataset; "
                            f"{type(data_loader.dataset).__name__} is an IterableDataset")
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"fxdp: partitions must be an int >= 1, got {partitions!r}")
        steps = -(-max(1, len(data_loader)) // partitions) * partitions
        return cls(data_loader.dataset, sample_rate=partitions / steps, partitions=partitions, steps=steps,
                   collate_fn=_unwrapped_collate(data_loader.collate_fn), distributed=distributed,
                   generator=generator if generator is not None else data_loader.generator,
                   **kwargs, **loader_options(data_loader))
