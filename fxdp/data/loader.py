"""``DPDataLoader``: a DataLoader whose batches are Poisson samples of its dataset."""

from __future__ import annotations

import collections.abc
import contextlib
import random
import logging
import warnings
from typing import Any, Callable, Counter, Optional, Sequence, Union

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler
from torch.utils.data.dataloader import default_collate

from fxdp.data.padding import PaddedBatch, PaddingCollate, padding_base
from fxdp.data.sampler import PoissonBatchSampler

_LOG = logging.getLogger(__name__)

# DataLoader options that a Poisson loader decides itself: the batches come from its sampler.
_SAMPLING_OPTIONS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class EmptyBatchCollate:
    """Wraps a collate function so that an empty list of samples gives an empty batch (Opacus's
    ``CollateFnWithEmpty``).

    The empty batch has the structure, trailing shapes and dtypes a batch of one would have (a
    tuple of tensors stays a tuple of tensors, each of shape ``(0, *sample_shape)``): the model runs
    on it, backward gives no per-sample gradient, and the optimizer still adds its noise. Its template:

    - with ``dataset`` (what :class:`DPDataLoader` passes), computed once from ``dataset[0]`` when the
      loader is built (so the wrapper pickles small for worker processes);
    - otherwise learnt from the first non-empty batch; an empty batch before any is a list of empty
      tensors of ``sample_empty_shapes`` and ``dtypes`` (``[]`` without them), with a logged warning.

    ``collate_fn=None`` returns the list of samples as it is. ``batch_first=False`` puts the empty batch
    dimension second. ``rand_on_empty=True`` replaces an empty batch by one random sample of 0s and 1s
    (data-independent, so no privacy cost; its clipped gradient is added to the noise of that step).
    """

    def __init__(self, collate_fn: Optional[Callable[[list], Any]], dataset: Optional[Dataset] = None, *,
                 sample_empty_shapes: Optional[Sequence[Sequence[int]]] = None,
                 dtypes: Optional[Sequence[torch.dtype]] = None, rand_on_empty: bool = False,
                 batch_first: bool = True):
        self.collate_fn = collate_fn
        self.sample_empty_shapes = sample_empty_shapes
        self.dtypes = dtypes
        self.rand_on_empty = rand_on_empty
        self.batch_first = batch_first
        if dataset is None:
            self.template = None
        else:
            with random_state_kept():  # a dataset or collate function drawing random numbers leaves the sampling as it was
                self.template = self._collate([dataset[0]])
        self._seen_batch = False  # (for the warning about an empty first batch)

    @property
    def empty_batch(self) -> Any:
        return None if self.template is None else _empty_like_batch(self.template, self._empty_rows())

    def _collate(self, samples: list) -> Any:
        return samples if self.collate_fn is None else self.collate_fn(samples)

    def _empty_rows(self):
        return _random_row if self.rand_on_empty else (_no_row if self.batch_first else _no_row_second)

    def __call__(self, samples: list) -> Any:
        if len(samples) > 0:
            batch = self._collate(samples)
            self._seen_batch = True
            if self.template is None:
                self.template = _first_row(batch)
            return batch
        if self.template is not None:
            if not _is_structure(self.template):
                # no empty form fxdp knows; and an empty batch must never be a real sample (it would be
                # trained on without being accounted)
                raise TypeError(f"Unsupported batch type {type(self.template).__name__} for an empty Poisson batch: "
                                "the collate function must return tensors, or dicts, lists or tuples of them")
            if not self._seen_batch:
                self._seen_batch = True
                _LOG.warning("First batch is empty (Poisson sampling): its empty tensors have the shapes and dtypes "
                             "of dataset[0]'s batch")
            return _empty_like_batch(self.template, self._empty_rows())
        _LOG.warning("First batch is empty: the empty batch is %s, as sample_empty_shapes and dtypes give "
                     "(build the loader from the dataset, or pass them, for the shapes of a real batch)",
                     "a list of empty tensors" if self.sample_empty_shapes else "[]")
        if not self.sample_empty_shapes:
            return []
        dtypes = self.dtypes or [torch.get_default_dtype()] * len(self.sample_empty_shapes)
        return [torch.zeros(tuple(shape), dtype=dtype) for shape, dtype in zip(self.sample_empty_shapes, dtypes)]


def wrap_collate_with_empty(*, collate_fn: Optional[Callable[[list], Any]], sample_empty_shapes=None,
                            dtypes=None, rand_on_empty: bool = False, batch_first: bool = True) -> EmptyBatchCollate:
    """``collate_fn`` wrapped so that an empty list of samples gives an empty batch (:class:`EmptyBatchCollate`)."""
    return EmptyBatchCollate(collate_fn, sample_empty_shapes=sample_empty_shapes, dtypes=dtypes,
                             rand_on_empty=rand_on_empty, batch_first=batch_first)


def _first_row(batch: Any) -> Any:
    """A batch of one cut from ``batch`` (the template of its empty batch), structures kept."""
    if isinstance(batch, torch.Tensor):
        return batch[:1].clone() if batch.dim() > 0 else batch
    if isinstance(batch, collections.abc.Mapping):
        return type(batch)({key: _first_row(value) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_first_row(value) for value in batch))
    if isinstance(batch, collections.abc.Sequence) and not isinstance(batch, (str, bytes)):
        if any(_is_structure(item) for item in batch):
            return type(batch)(_first_row(item) for item in batch)
        return type(batch)(batch[:1])
    return batch


def _no_row(t: torch.Tensor) -> torch.Tensor:
    return t[:0].clone()


def _no_row_second(t: torch.Tensor) -> torch.Tensor:
    """The empty batch of a batch-second layout: a sample's shape is ``t.shape[1:]``; batch goes second."""
    sample = t.shape[1:]
    return t.new_zeros((*sample[:1], 0, *sample[1:])) if sample else t.new_zeros((0,))


def _random_row(t: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, 2, t[:1].shape).to(t.dtype)


@contextlib.contextmanager
def random_state_kept():
    """Run a block that may draw random numbers (a dataset's augmentation, a collator's masking) and leave
    torch's, Python's and NumPy's global generators as they were: a Poisson sampler drawing from torch's
    then draws the batches it would have drawn without the block."""
    python_state = random.getstate()
    numpy = None
    try:
        import numpy
        numpy_state = numpy.random.get_state()
    except ImportError:
        pass
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def first_samples_batch(data_loader: DataLoader, size: int = 2) -> Any:
    """A batch of the dataset's first ``size`` samples (fewer if it has fewer), made by the loader's own collate
    function, as the loader would hand it out, without iterating the loader: its sampler and every global random
    generator are left as they were (:func:`random_state_kept`), so the batches training then draws are
    those it would draw without this one. ``None`` for a dataset without ``__getitem__`` and ``__len__``."""
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or data_loader.batch_sampler is None:
        return None  # no sample to pick, or a loader that hands out samples without batching them
    try:
        count = min(size, len(dataset))
    except TypeError:
        return None
    if count == 0:
        return None
    collate_fn = _unwrapped_collate(data_loader.collate_fn)
    with random_state_kept():
        return collate_fn([dataset[i] for i in range(count)])


def _is_structure(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, collections.abc.Mapping)) or (
        isinstance(x, collections.abc.Sequence) and not isinstance(x, (str, bytes))
    )


def _empty_like_batch(batch: Any, rows: Callable[[torch.Tensor], torch.Tensor] = _no_row) -> Any:
    """The batch of one ``batch`` with every batch dimension cut to length zero (``rows`` makes each
    tensor's empty batch)."""
    if isinstance(batch, torch.Tensor):
        return rows(batch)
    if isinstance(batch, collections.abc.Mapping):
        return type(batch)({key: _empty_like_batch(value, rows) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_empty_like_batch(value, rows) for value in batch))
    if isinstance(batch, collections.abc.Sequence) and not isinstance(batch, (str, bytes)):
        if any(_is_structure(item) for item in batch):  # a structure of batched fields
            return type(batch)(_empty_like_batch(item, rows) for item in batch)
        return type(batch)()  # a batched field of plain values (strings): one per sample
    return batch


def is_empty_batch(batch: Any) -> bool:
    """Whether ``batch`` holds no sample, as :class:`EmptyBatchCollate` makes one: every batched tensor with
    no row, every batched field of plain values empty. ``False`` where it cannot tell (a batch of a type of
    the user's)."""
    if isinstance(batch, torch.Tensor):
        return batch.dim() > 0 and batch.shape[0] == 0
    if isinstance(batch, collections.abc.Mapping):
        values = list(batch.values())
    elif isinstance(batch, collections.abc.Sequence) and not isinstance(batch, (str, bytes)):
        if not any(_is_structure(item) for item in batch):
            return len(batch) == 0  # a batched field of plain values: one per sample
        values = list(batch)
    else:
        return False
    fields = [v for v in values if _is_structure(v)]
    return bool(fields) and all(is_empty_batch(v) for v in fields)


class DPDataLoader(DataLoader):
    """A DataLoader for DP-SGD: each of its ``steps`` batches contains every sample of ``dataset``
    independently with probability ``sample_rate`` (Poisson sampling), as the privacy accounting
    assumes. Batch sizes vary around ``sample_rate * len(dataset)``; an empty batch is yielded as
    empty tensors of the right trailing shape and dtype, so the optimizer still steps with noise.

    Build one from an ordinary loader with :meth:`from_data_loader`. Other keyword arguments
    (``num_workers``, ``pin_memory``, ...) are passed to :class:`torch.utils.data.DataLoader`.

    ``batch_observer``: a callable told about each batch as it is handed out,
    ``batch_observer(empty=..., new_epoch=...)`` (whether it holds no sample; whether it is the first of this
    pass over the loader). ``make_private`` sets it to the DP optimizer's ``observe_batch``, so that a step
    knows how many batches it covers and whether its batch was empty.

    ``distributed=True`` (under an initialised ``torch.distributed``): rank 0 draws a seed and
    broadcasts it, every rank draws the same inclusion masks from it and keeps its share of each
    batch (indices ``i`` with ``i % world_size == rank``). The logical batch is the union over ranks;
    each rank's share has expected size ``sample_rate * len(dataset) / world_size``.

    ``padded_batches`` (off by default): ``True`` pads every batch with rows of zeros to a fixed size chosen from the
    expected batch size, an int ``B`` to ``B``; a batch larger than that gets the size doubled until it fits, an
    empty batch is padded too (:mod:`fxdp.data.padding`). Then the first :attr:`real_rows` rows of the batch
    handed out are its samples and the rest padding (:attr:`row_mask`), the batch observer is also told
    ``real_rows`` and ``padded_to`` (the DP optimizer drops the padding rows before clipping: they contribute no
    gradient, no norm and no count), and :attr:`padded_sizes` counts the sizes handed out. Every tensor the collate
    function makes must hold one row per sample, at dimension 0 (dimension 1 of a tensor of two dimensions or
    more with ``batch_first=False``). Not with ``distributed=True`` yet.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sample_rate: float,
        steps: Optional[int] = None,
        collate_fn: Optional[Callable[[list], Any]] = None,
        generator: Optional[torch.Generator] = None,
        distributed: bool = False,
        drop_last: bool = False,
        padded_batches: Union[bool, int] = False,
        batch_first: bool = True,
        **loader_kwargs: Any,
    ):
        if drop_last:  # (Opacus's signature) a Poisson batch is never cut short
            warnings.warn("DPDataLoader ignores drop_last=True: Poisson batches vary in size and none is dropped",
                          stacklevel=2)
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "DPDataLoader needs a map-style dataset (with __getitem__ and __len__) to sample each "
                f"item independently; got the IterableDataset {type(dataset).__name__}"
            )
        given = [name for name in _SAMPLING_OPTIONS if name in loader_kwargs]
        if given:
            raise TypeError(
                f"DPDataLoader chooses its batches by Poisson sampling; do not pass {', '.join(given)} "
                "(set sample_rate instead)"
            )
        num_samples = len(dataset)
        if num_samples == 0:
            raise ValueError("DPDataLoader needs a non-empty dataset")
        if distributed and padded_batches:
            raise ValueError("fxdp: padded_batches is not supported with distributed=True yet (each rank would pad "
                             "its own share); pass padded_batches=False")
        if steps is None:
            steps = round(1.0 / sample_rate)
        rank, world_size = 0, 1
        if distributed:
            rank, world_size, generator = _distributed_setup(generator)
        self.sample_rate = float(sample_rate)
        self.distributed = distributed
        self.rank = rank
        self.world_size = world_size
        batch_sampler = self._batch_sampler(num_samples, sample_rate, steps, generator, rank, world_size)
        # the base size of a padded batch (0: batches are not padded)
        self.padding_base = padding_base(padded_batches, num_samples, self.sample_rate)
        # (the empty batch of an unpadded loader is batch first, as it always was)
        collate = EmptyBatchCollate(collate_fn or default_collate, dataset,
                                    batch_first=batch_first or not self.padding_base)
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=PaddingCollate(collate, self.padding_base, batch_first) if self.padding_base else collate,
            **loader_kwargs,
        )
        self.batch_first = batch_first
        self.real_rows: Optional[int] = None  # of the padded batch handed out last: its first real_rows rows
        self._padded_to = 0  # that batch's padded size
        self.padded_sizes: Counter[int] = collections.Counter()  # padded size -> batches handed out with it
        self.batch_observer: Optional[Callable[..., None]] = None
        # a callable that hands out a batch in its place (the compiled model's loss probe, which follows what the
        # loss computes from the labels on the first step: fxdp.runtime.loss_probe)
        self.batch_probe: Optional[Callable[[Any], Any]] = None

    def _batch_sampler(self, num_samples: int, sample_rate: float, steps: int, generator: Optional[torch.Generator],
                       rank: int, world_size: int) -> PoissonBatchSampler:
        """The sampler of the batches (a subclass samples otherwise: :class:`fxdp.data.CyclicPoissonDataLoader`)."""
        return PoissonBatchSampler(num_samples, sample_rate, steps, generator=generator, rank=rank,
                                   world_size=world_size)

    @property
    def row_mask(self) -> Optional[torch.Tensor]:
        """Of the padded batch handed out last: a bool tensor (on the CPU), True at its real rows (the first
        :attr:`real_rows`) and False at its padding rows. ``None`` when batches are not padded.

        The loss needs no mask (the optimizer drops the padding rows). To leave them out of its value, select
        (``torch.where(mask, per_row, 0)``: a padding row's loss may be NaN) and keep dividing by the rows the model
        ran on, as a ``"mean"`` loss is read: dividing by the real rows makes every per-sample gradient
        ``padded size / real rows`` times too large (docs/training.md, "Padded batches")."""
        if self.real_rows is None:
            return None
        return torch.arange(self._padded_to) < self.real_rows

    def __iter__(self):
        batches = super().__iter__()
        if self.padding_base:
            if self.batch_observer is None:
                warnings.warn("fxdp: this DPDataLoader pads its batches (padded_batches) but no DP optimizer observes "
                              "them, so nothing drops the padding rows: a model trained on these batches would take "
                              "them for samples. Set loader.batch_observer = optimizer.observe_batch (make_private "
                              "does), or build the loader without padded_batches", stacklevel=2)
            batches = self._unpadded_info(batches)
        batches = batches if self.batch_observer is None else self._observed(batches, self.batch_observer)
        return batches if self.batch_probe is None else map(self.batch_probe, batches)

    def _unpadded_info(self, batches):
        """The padded batches, their real rows noted (:attr:`real_rows`) as each is handed out."""
        for padded in batches:
            if not isinstance(padded, PaddedBatch):  # (the collate function was replaced after the loader was built)
                raise TypeError(f"fxdp: a DPDataLoader with padded_batches got a {type(padded).__name__} from its "
                                "collate function instead of a padded batch: do not replace the loader's collate_fn")
            self.real_rows, self._padded_to = padded.real_rows, padded.size
            self.padded_sizes[padded.size] += 1
            yield padded.batch

    def _observed(self, batches, observer):
        first = True
        for batch in batches:  # told as the batch is handed out (workers may have loaded it long before)
            if self.padding_base:
                observer(empty=self.real_rows == 0, new_epoch=first, real_rows=self.real_rows,
                         padded_to=self._padded_to)
            else:
                observer(empty=is_empty_batch(batch), new_epoch=first)
            first = False
            yield batch

    @classmethod
    def from_data_loader(
        cls, data_loader: DataLoader, generator: Optional[torch.Generator] = None, distributed: bool = False, *,
        padded_batches: Union[bool, int] = False, batch_first: bool = True,
    ) -> "DPDataLoader":
        """A Poisson loader over ``data_loader``'s dataset with ``sample_rate = 1 / len(data_loader)``
        and as many batches per epoch as ``data_loader`` has; its collate function, workers, pinning
        and timeouts are kept, and its ``generator`` when ``generator`` is None. (So the expected batch
        size is ``len(dataset) / len(data_loader)``, about the original batch size.) ``padded_batches`` and
        ``batch_first``: as for the constructor."""
        if isinstance(data_loader.dataset, IterableDataset):
            raise TypeError(
                "DPDataLoader.from_data_loader needs a loader over a map-style dataset; "
                f"{type(data_loader.dataset).__name__} is an IterableDataset"
            )
        steps = len(data_loader)
        if steps == 0:
            raise ValueError("DPDataLoader.from_data_loader: the loader has no batches (empty dataset?)")
        return cls(
            data_loader.dataset,
            sample_rate=1.0 / steps,
            steps=steps,
            collate_fn=_unwrapped_collate(data_loader.collate_fn),
            generator=generator if generator is not None else data_loader.generator,
            distributed=distributed,
            padded_batches=padded_batches,
            batch_first=batch_first,
            **loader_options(data_loader),
        )


def switch_generator(*, data_loader: DataLoader, generator: Optional[torch.Generator]) -> DataLoader:
    """``data_loader`` with its random sampling drawn from ``generator`` instead: a shuffling loader (its
    ``RandomSampler``) or a Poisson one. A loader that draws nothing at random cannot switch: ValueError."""
    batch_sampler = data_loader.batch_sampler
    if isinstance(batch_sampler, PoissonBatchSampler):
        batch_sampler.generator = generator
        return data_loader
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, RandomSampler) or type(batch_sampler) is not BatchSampler:
        raise ValueError(f"switch_generator: the loader samples with {type(sampler or batch_sampler).__name__}, "
                         "which draws nothing at random; only a shuffling loader (shuffle=True) or a Poisson "
                         "one has a generator to switch")
    sampler = RandomSampler(sampler.data_source, replacement=sampler.replacement,
                            num_samples=sampler._num_samples, generator=generator)
    return DataLoader(data_loader.dataset, batch_sampler=BatchSampler(sampler, batch_sampler.batch_size,
                                                                      batch_sampler.drop_last),
                      collate_fn=data_loader.collate_fn, generator=generator, **loader_options(data_loader))


def _unwrapped_collate(collate_fn: Callable) -> Callable:
    """The user's collate function inside a DPDataLoader's (padding, empty batches)."""
    if isinstance(collate_fn, PaddingCollate):
        collate_fn = collate_fn.collate_fn
    return collate_fn.collate_fn if isinstance(collate_fn, EmptyBatchCollate) else collate_fn


def loader_options(data_loader: DataLoader) -> dict:
    """The options of ``data_loader`` that do not decide which samples form a batch."""
    options = dict(
        num_workers=data_loader.num_workers,
        pin_memory=data_loader.pin_memory,
        timeout=data_loader.timeout,
        worker_init_fn=data_loader.worker_init_fn,
        multiprocessing_context=data_loader.multiprocessing_context,
        prefetch_factor=data_loader.prefetch_factor,
        persistent_workers=data_loader.persistent_workers,
        pin_memory_device=data_loader.pin_memory_device,
    )
    return options


def _distributed_setup(generator: Optional[torch.Generator]):
    """(rank, world_size, a generator seeded identically on every rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        warnings.warn(
            "DPDataLoader(distributed=True) but torch.distributed is not initialised: sampling for a "
            "single process. Call torch.distributed.init_process_group first.",
            stacklevel=3,
        )
        return 0, 1, generator
    # Rank 0's draw decides the seed, so the ranks agree even if their generators differ.
    seed = [int(torch.randint(0, 2**62, (1,), generator=generator).item())]
    dist.broadcast_object_list(seed, src=0)
    shared = torch.Generator().manual_seed(seed[0])
    return dist.get_rank(), dist.get_world_size(), shared
