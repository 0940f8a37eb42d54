"""``BatchMemoryManager``: logical (Poisson) batches cut into physical batches that fit in memory.

The privacy accounting sees only the logical batches, which are sampled exactly as before; the
optimizer accumulates the clipped per-sample gradients of a logical batch's physical batches and
adds noise once, at the last of them.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Deque, Iterator, List, Tuple

from torch.utils.data import DataLoader, Sampler

from fxdp.data.loader import loader_options


class _SplittingBatchSampler(Sampler[List[int]]):
    """Cuts each index list of ``logical`` into lists of at most ``max_size`` indices; an empty
    logical batch gives one empty list. For every list it yields it appends to ``is_last`` whether
    that list ends its logical batch, and its length (read in the same order by the loader's iterator)."""

    def __init__(self, logical: Sampler, max_size: int, expected_logical_size: float):
        self.logical = logical
        self.max_size = max_size
        self.expected_logical_size = expected_logical_size
        self.is_last: Deque[Tuple[bool, int]] = collections.deque()

    def __len__(self) -> int:
        # An estimate: the number varies with the Poisson batch sizes.
        per_logical = max(1, math.ceil(self.expected_logical_size / self.max_size))
        return len(self.logical) * per_logical

    def __iter__(self) -> Iterator[List[int]]:
        self.is_last.clear()
        for indices in self.logical:
            indices = list(indices)
            starts = range(0, len(indices), self.max_size) if indices else [0]
            for start in starts:
                physical = indices[start : start + self.max_size]
                self.is_last.append((start + self.max_size >= len(indices), len(physical)))
                yield physical


class _PhysicalBatchLoader:
    """Iterates over a loader of physical batches, telling the optimizer before each one whether
    it ends a logical batch (step with noise) or not (only accumulate)."""

    def __init__(self, loader: DataLoader, sampler: _SplittingBatchSampler, optimizer: Any, logical: DataLoader):
        self._loader = loader
        self._sampler = sampler
        self._optimizer = optimizer
        self.dataset = logical.dataset
        self.sample_rate = getattr(logical, "sample_rate", None)
        self.logical_data_loader = logical

    def __len__(self) -> int:
        """The expected number of physical batches per epoch (it varies with the batch sizes)."""
        return len(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        # The sampler runs ahead of us when worker processes prefetch; batches come back in the
        # order it produced them, so its flags are read first in, first out.
        observer = getattr(self.logical_data_loader, "batch_observer", None)  # see DPDataLoader
        starts, first, logical_batches = True, True, 0
        cyclic = getattr(self.logical_data_loader, "partitions", None) is not None  # a CyclicPoissonDataLoader
        for batch in self._loader:
            is_last, size = self._sampler.is_last.popleft()
            if cyclic and starts:  # the part of the logical batch begun, as the cyclic loader's own pass notes it
                self.logical_data_loader.cycle_position = logical_batches % self.logical_data_loader.partitions
                logical_batches += 1
            if observer is not None and starts:  # a logical batch begins (empty: its one physical batch is)
                observer(empty=size == 0, new_epoch=first)
                first = False
            self._optimizer.signal_skip_step(do_skip=not is_last)
            starts = is_last
            yield batch


class BatchMemoryManager:
    """Context manager: ``with BatchMemoryManager(data_loader=dl, max_physical_batch_size=64,
    optimizer=opt) as loader:`` gives a loader whose batches have at most 64 samples.

    Each logical batch of ``data_loader`` (usually a :class:`~fxdp.data.DPDataLoader`) is cut into
    consecutive physical batches; before each one, ``optimizer.signal_skip_step(do_skip=True)`` says
    "accumulate only", and before the last one of a logical batch ``do_skip=False`` says "add noise
    and step". An empty logical batch gives one empty physical batch, so the optimizer still steps.
    The sampling, and hence the privacy accounting, is unchanged.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer: Any):
        if not isinstance(max_physical_batch_size, int) or max_physical_batch_size < 1:
            raise ValueError(
                f"max_physical_batch_size must be a positive int, got {max_physical_batch_size!r}"
            )
        if not callable(getattr(optimizer, "signal_skip_step", None)):
            raise TypeError(
                f"BatchMemoryManager needs the DP optimizer (one with signal_skip_step), got "
                f"{type(optimizer).__name__}; pass the optimizer PrivacyEngine.make_private returned"
            )
        if data_loader.batch_sampler is None:
            raise TypeError(
                "BatchMemoryManager needs a loader that batches with a batch sampler (a DPDataLoader "
                "or a DataLoader with batch_size set)"
            )
        if getattr(data_loader, "padding_base", 0):
            raise ValueError(
                "fxdp: BatchMemoryManager cannot cut the padded batches of a DPDataLoader with padded_batches into "
                "physical batches yet; build the loader (make_private) with padded_batches=False")
        self.data_loader = data_loader
        self.max_physical_batch_size = max_physical_batch_size
        self.optimizer = optimizer

    def __enter__(self) -> _PhysicalBatchLoader:
        logical = self.data_loader
        # this process's expected share of a logical batch (a distributed DPDataLoader splits it)
        share = getattr(logical, "sample_rate", 0.0) * len(logical.dataset) / getattr(logical, "world_size", 1)
        expected = share or _batch_size(logical)
        sampler = _SplittingBatchSampler(logical.batch_sampler, self.max_physical_batch_size, expected)
        physical = DataLoader(
            logical.dataset,
            batch_sampler=sampler,
            collate_fn=logical.collate_fn,
            in_order=True,  # the flags are matched to batches by order
            **loader_options(logical),
        )
        return _PhysicalBatchLoader(physical, sampler, self.optimizer, logical)

    def __exit__(self, *exc_info) -> bool:
        return False


def _batch_size(loader: DataLoader) -> float:
    return float(loader.batch_size or getattr(loader.batch_sampler, "batch_size", 1) or 1)
