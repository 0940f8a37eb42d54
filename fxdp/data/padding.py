"""Poisson batches padded to a few fixed sizes with masked rows, so that a compiled step (``torch.compile``, a CUDA
graph) sees few shapes.

A Poisson batch's size varies from step to step (:mod:`fxdp.data.sampler`). With padding, the batch of ``n``
samples is handed out with ``bucket - n`` more rows at its end, every one of them zeros (of the batch's trailing
shape and dtype: data-independent, whatever the dataset holds); the loader says how many rows are real
(``DPDataLoader.real_rows``) and tells the DP optimizer, which drops the padding rows before clipping: their
records are zeroed by selection (``GradientSink.drop_samples``), their clip factors are 0, and they count for
nothing. The sampling is unchanged (the accountant sees the same Poisson batches at the same rate) and so is the
update: a per-sample gradient of a real row does not depend on the other rows, and the gradient of a ``"mean"``
loss is divided by the *expected* batch size, never by the rows the model ran on.

The sizes (:func:`bucket_size`): a *base* size, by default the smallest multiple of 8 at or above the 99.9%
quantile of the batch size (``Binomial(len(dataset), sample_rate)``, :func:`base_bucket_size`), so that about one
batch in a thousand or fewer is larger; such a batch gets the base doubled as often as it takes (never
truncated: truncation would change the sampling, and with it the privacy analysis). An empty batch is padded to
the base too (every row masked). So training sees the base size and, rarely, twice it.
"""

from __future__ import annotations

import collections.abc
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

# The default base size: at or above this quantile of the batch size, rounded up to a multiple of this.
BASE_QUANTILE = 0.999
BASE_MULTIPLE = 8

_PADDABLE = (torch.Tensor, collections.abc.Mapping, list, tuple)


def base_bucket_size(num_samples: int, sample_rate: float, *, quantile: float = BASE_QUANTILE,
                     multiple: int = BASE_MULTIPLE) -> int:
    """The smallest multiple of ``multiple`` at or above the ``quantile`` of ``Binomial(num_samples, sample_rate)``
    (the size of a Poisson batch), at least ``multiple``. Computed exactly, in float64 from log-probabilities."""
    if num_samples <= 0 or not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"base_bucket_size needs num_samples > 0 and 0 < sample_rate <= 1, got {num_samples} and "
                         f"{sample_rate}")
    if sample_rate == 1.0:
        top = num_samples
    else:
        k = torch.arange(num_samples + 1, dtype=torch.float64)
        n, q = float(num_samples), float(sample_rate)
        log_pmf = (torch.lgamma(torch.tensor(n + 1.0, dtype=torch.float64)) - torch.lgamma(k + 1)
                   - torch.lgamma(n - k + 1) + k * math.log(q) + (n - k) * math.log1p(-q))
        cdf = torch.cumsum(log_pmf.exp(), 0)
        reached = (cdf >= quantile).nonzero()
        top = int(reached[0]) if reached.numel() else num_samples
    return max(multiple, multiple * math.ceil(top / multiple))


def bucket_size(rows: int, base: int) -> int:
    """The padded size of a batch of ``rows`` real rows: ``base``, doubled until it holds them all."""
    size = base
    while size < rows:
        size *= 2
    return size


def padding_base(padded_batches: Union[bool, int], num_samples: int, sample_rate: float) -> int:
    """The base size ``padded_batches`` asks for (``True``: :func:`base_bucket_size`; an int: itself); 0 for off."""
    if padded_batches is False or padded_batches is None:
        return 0
    if padded_batches is True:
        return base_bucket_size(num_samples, sample_rate)
    if isinstance(padded_batches, int) and padded_batches > 0:
        return padded_batches
    raise ValueError(f"padded_batches must be False (no padding), True (a base size chosen from the expected batch "
                     f"size) or a positive int (the base size), got {padded_batches!r}")


def padded_batches_for(padded_batches: Optional[Union[bool, int]], *, compiled: bool = False,
                       poisson_sampling: bool = True, criterion: bool = False) -> Union[bool, int]:
    """What ``make_private(padded_batches=...)`` asks for: ``None`` (its default) is fxdp's choice, which is padding
    where the model is compiled (``compile=``: a compiled step then sees a few shapes, not one per batch size) and
    padding is possible (Poisson sampling, no ``criterion``), and no padding otherwise."""
    if padded_batches is not None:
        return padded_batches
    return compiled and poisson_sampling and not criterion


def check_padding_supported(*, poisson_sampling: bool, criterion: bool, across_processes: bool) -> None:
    """Refuse, saying what to do, what ``make_private`` cannot pad yet."""
    if not poisson_sampling:
        raise ValueError("fxdp: padded_batches pads Poisson batches; with poisson_sampling=False the loader is kept as "
                         "it is. Pass poisson_sampling=True, or padded_batches=False")
    if criterion:
        raise ValueError("fxdp: padded_batches with criterion (the per-sample loss wrapper) is not supported yet; "
                         "pass padded_batches=False, or compute the loss yourself")
    if across_processes:
        raise ValueError("fxdp: padded_batches is not supported across processes (DDP, FSDP) yet; pass "
                         "padded_batches=False")


@dataclass
class PaddedBatch:
    """What :class:`PaddingCollate` makes (in a worker process, if the loader has them): the padded batch and how
    many of its rows are real. The loader unwraps it before handing the batch out."""

    batch: Any
    real_rows: int
    size: int

    def pin_memory(self) -> "PaddedBatch":  # (the loader's pinning thread calls it)
        from torch.utils.data._utils.pin_memory import pin_memory
        return PaddedBatch(pin_memory(self.batch), self.real_rows, self.size)


class PaddingCollate:
    """Wraps a collate function (a DPDataLoader's :class:`~fxdp.data.loader.EmptyBatchCollate`): the batch of a
    list of ``n`` samples, padded with rows of zeros to :func:`bucket_size` ``(n, base)`` rows, as a
    :class:`PaddedBatch`. Every tensor of the batch must hold one row per sample, at dimension 0 (dimension 1 of
    a tensor of two dimensions or more with ``batch_first=False``); anything else is refused, naming it."""

    def __init__(self, collate_fn: Callable[[list], Any], base: int, batch_first: bool = True):
        self.collate_fn = collate_fn
        self.base = int(base)
        self.batch_first = batch_first

    def __call__(self, samples: list) -> PaddedBatch:
        rows = len(samples)
        size = bucket_size(rows, self.base)
        template = getattr(self.collate_fn, "template", None)  # (an EmptyBatchCollate's batch of dataset[0])
        if rows == 0 and template is not None:  # cut from the template at the batch dimension, whatever the layout
            batch = map_rows(template, lambda t, where: _no_rows(t, self.batch_first, where))
        else:
            batch = self.collate_fn(samples)
        return PaddedBatch(pad_batch(batch, rows, size, self.batch_first), rows, size)


def pad_batch(batch: Any, rows: int, size: int, batch_first: bool = True) -> Any:
    """``batch`` (a tensor, or a dict, list or tuple of them) with each tensor's ``rows`` rows followed by
    ``size - rows`` rows of zeros, structures kept."""
    return map_rows(batch, lambda t, where: _padded(t, rows, size, batch_first, where))


def map_rows(batch: Any, fn: Callable[[torch.Tensor, str], torch.Tensor], where: str = "batch") -> Any:
    """``batch`` with ``fn(tensor, where)`` applied to each of its tensors, structures kept (``where``: the tensor's
    place in the batch, for errors). Anything but tensors, dicts, lists and tuples of them is refused."""
    if isinstance(batch, torch.Tensor):
        return fn(batch, where)
    if isinstance(batch, collections.abc.Mapping):
        return type(batch)({key: map_rows(value, fn, f"{where}[{key!r}]") for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_rows(value, fn, f"{where}.{name}") for name, value in zip(batch._fields, batch)))
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(v, _PADDABLE) for v in batch):
        return type(batch)(map_rows(value, fn, f"{where}[{i}]") for i, value in enumerate(batch))
    raise TypeError(f"fxdp: padded_batches cannot pad {where}, a {type(batch).__name__}: a padded batch's rows must "
                    "be tensors (or dicts, lists or tuples of them) with one row per sample, so that the padding rows "
                    "can be zeros. Have the collate function return tensors, or turn padded_batches off")


def _rows_at_batch_dim(t: torch.Tensor, rows: int, batch_first: bool, where: str):
    """``(t, its batch dimension)``, after checking that ``t`` holds ``rows`` rows there."""
    dim = 0 if batch_first or t.dim() < 2 else 1
    if t.dim() == 0 or t.shape[dim] != rows:
        raise TypeError(f"fxdp: padded_batches cannot pad {where}, a tensor of shape {tuple(t.shape)}, for a batch of "
                        f"{rows} samples: every tensor of a padded batch must hold one row per sample at dimension "
                        f"{dim} (batch_first={batch_first}). Have the collate function return only per-sample "
                        "tensors, or turn padded_batches off")
    return t, dim


def _no_rows(template: torch.Tensor, batch_first: bool, where: str) -> torch.Tensor:
    """The batch of one ``template`` cut to no row at its batch dimension."""
    t, dim = _rows_at_batch_dim(template, 1, batch_first, where)
    return t.narrow(dim, 0, 0)


def _padded(t: torch.Tensor, rows: int, size: int, batch_first: bool, where: str) -> torch.Tensor:
    t, dim = _rows_at_batch_dim(t, rows, batch_first, where)
    if size == rows:
        return t
    shape = list(t.shape)
    shape[dim] = size - rows
    return torch.cat([t, t.new_zeros(shape)], dim)  # zeros: the padding rows hold nothing of the dataset
