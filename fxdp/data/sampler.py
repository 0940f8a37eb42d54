"""Poisson sampling of batches: every sample joins each batch independently with probability q.

DP-SGD's privacy analysis (the RDP and PLD accountants) assumes exactly this: a batch is not a fixed
number of samples drawn without replacement, but the result of one coin flip per sample. So batch
sizes vary from step to step, and a batch can be empty.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch
from torch.utils.data import Sampler


class PoissonBatchSampler(Sampler[List[int]]):
    """Yields ``steps`` batches of dataset indices; index ``i`` is in a batch with probability
    ``sample_rate``, independently of every other index and every other batch.

    Across processes (``world_size > 1``) every rank must be given a generator seeded identically:
    the ranks then draw the same inclusion mask at each step, and rank ``r`` keeps the indices ``i``
    with ``i % world_size == r``. Each sample of the logical (global) batch is thus taken by exactly
    one rank, and is included with probability ``sample_rate`` overall.

    With ``generator=None`` (one process only) the masks come from torch's global random generator,
    so ``torch.manual_seed`` makes them reproducible.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int,
        *,
        generator: Optional[torch.Generator] = None,
        rank: int = 0,
        world_size: int = 1,
        same_draws_on_every_rank: bool = True,
    ):
        if num_samples <= 0:
            raise ValueError(f"PoissonBatchSampler needs a non-empty dataset, got num_samples={num_samples}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if world_size > 1 and generator is None and same_draws_on_every_rank:
            raise ValueError(
                "with world_size > 1 every rank must draw the same inclusion masks: pass a "
                "torch.Generator seeded with the same seed on every rank (DPDataLoader with "
                "distributed=True does this for you)"
            )
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps = int(steps)
        self.generator = generator
        self.rank = int(rank)
        self.world_size = int(world_size)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            # One uniform draw per sample, identical on every rank given the same generator state.
            device = self.generator.device if self.generator is not None else None
            included = torch.rand(self.num_samples, generator=self.generator, device=device) < self.sample_rate
            indices = included.nonzero().flatten().cpu()
            if self.world_size > 1:
                indices = indices[indices % self.world_size == self.rank]
            yield indices.tolist()


class UniformWithReplacementSampler(PoissonBatchSampler):
    """Opacus's name and signature for :class:`PoissonBatchSampler` in one process: ``steps`` batches
    (``round(1 / sample_rate)`` by default), each index included with probability ``sample_rate``;
    batches are tensors of indices, as Opacus yields them."""

    def __init__(self, *, num_samples: int, sample_rate: float, generator: Optional[torch.Generator] = None,
                 steps: Optional[int] = None):
        super().__init__(num_samples, sample_rate, round(1 / sample_rate) if steps is None else steps,
                         generator=generator)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for indices in super().__iter__():
            yield torch.tensor(indices, dtype=torch.long)


class DistributedUniformWithReplacementSampler(PoissonBatchSampler):
    """Opacus's distributed Poisson sampler: this rank's share (indices ``i`` with ``i % world_size == rank``,
    rank and world size from ``torch.distributed``) of ``round(1 / sample_rate)`` Poisson batches of a
    dataset of ``total_size``. Every sample belongs to exactly one rank and joins each logical batch
    independently with probability ``sample_rate``: this rank decides its own samples' draws, so the ranks'
    generators need not agree (an identically seeded one on every rank, as ``DPDataLoader(distributed=True)``
    uses, works too). ``shuffle`` and ``shuffle_seed`` (which samples go to which rank, in Opacus) are
    accepted and not needed: the partition by index is fixed, and the draws are random."""

    def __init__(self, *, total_size: int, sample_rate: float, shuffle: bool = True, shuffle_seed: int = 0,
                 generator: Optional[torch.Generator] = None):
        import torch.distributed as dist

        self.shuffle, self.shuffle_seed = shuffle, shuffle_seed
        self.total_size = int(total_size)
        super().__init__(total_size, sample_rate, round(1 / sample_rate), generator=generator,
                         rank=dist.get_rank(), world_size=dist.get_world_size(), same_draws_on_every_rank=False)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for indices in super().__iter__():
            yield torch.tensor(indices, dtype=torch.long)
