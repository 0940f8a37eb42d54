"""What one capture contributed to one parameter (one *use*): enough for its per-sample squared norms, its
clipped sum and, if asked, its per-sample gradient. A registration (:mod:`~fxdp.sinks.bookkeeping.registry`)
returns one per parameter; the families' own uses (Linear and Conv weights, Embedding tables) are in their
files, the two every family shares here: per-sample gradients already materialised, and a bias's sums."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

from fxdp.diagnostics.errors import PerSampleError


class Use:
    """One capture's contribution to one parameter. ``scale``: the factor G still carries to be a summed
    loss's (a mean loss's ``N``), folded into norms (``scale^2``) and clip factors instead of copying G.

    A subclass answers :meth:`clipped_sum` and :meth:`grad_samples`; :meth:`squared_norms` defaults to the
    norms of :meth:`grad_samples`, which a cheaper form should replace."""

    batch_size: int
    scale: float = 1.0

    def squared_norms(self) -> torch.Tensor:  # (N,), this use alone
        return self.grad_samples().flatten(1).pow(2).sum(1)

    def clipped_sum(self, c: torch.Tensor) -> torch.Tensor:  # sum_i c_i g_i, shaped as the parameter (or flat)
        raise NotImplementedError

    def drop_samples(self, dropped: torch.Tensor) -> None:
        """Zero the rows of the samples ``dropped`` marks in every floating-point tensor this use keeps batch first
        (A, G, per-sample gradients), so that their clipped sum is 0 (0 times an inf would be NaN). New tensors
        replace them: another use may share one. A use that caches something formed from them drops it too."""
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0 \
                    and value.shape[0] == self.batch_size:
                setattr(self, name, value.masked_fill(dropped.to(value.device).view(-1, *[1] * (value.dim() - 1)), 0))

    def grad_samples(self) -> torch.Tensor:  # (N, *p.shape)
        raise NotImplementedError


class Materialised(Use):
    """Per-sample gradients formed already (a layer without a book-keeping form, or one whose per-sample
    gradient is smaller than its A and G)."""

    def __init__(self, grad_samples: torch.Tensor):
        self.gs = grad_samples
        self.batch_size = grad_samples.shape[0]

    def grad_samples(self):
        return self.gs

    def clipped_sum(self, c):
        return torch.tensordot(c.to(self.gs.dtype), self.gs, dims=1)


class Summed(Use):
    """A bias: its per-sample gradient is ``scale *`` G summed over every non-batch, non-channel position."""

    def __init__(self, per_sample: torch.Tensor, scale: float = 1.0):
        self.gs = per_sample  # (N, p), already materialised: as small as the bias
        self.scale = scale
        self.batch_size = per_sample.shape[0]

    def grad_samples(self):
        return self.gs * self.scale if self.scale != 1.0 else self.gs

    def squared_norms(self):
        return self.gs.pow(2).sum(1) * self.scale ** 2

    def clipped_sum(self, c):
        return (c * self.scale).to(self.gs.dtype) @ self.gs


def memory_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors alive at the same time exactly when they read the same elements of the same
    memory, hence hold the same values (G is never written after it is delivered)."""
    return t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride()


@dataclass
class Segment:
    """One backward pass's record of one parameter: its per-sample squared norms and the uses that
    produce its clipped sum. ``norms`` is None where the sink was told that only grouped norms are read
    (user-level training: :meth:`~fxdp.sinks.contract.GradientSink.set_grouped_norms_only`)."""

    norms: Optional[torch.Tensor]
    uses: List[Use]

    @property
    def rows(self) -> int:
        """Its number of per-sample rows (every use has the same: :func:`same_batch`)."""
        return self.uses[0].batch_size


def same_batch(param: nn.Parameter, uses: List[Use]) -> int:
    if len(uses) == 1:
        return uses[0].batch_size
    sizes = {u.batch_size for u in uses}
    if len(sizes) != 1:
        raise PerSampleError(
            f"fxdp: parameter of shape {tuple(param.shape)} was used with batches of {sorted(sizes)} samples in "
            "one backward pass; per-sample norms need one batch per backward. Call backward once per batch"
        )
    return sizes.pop()
