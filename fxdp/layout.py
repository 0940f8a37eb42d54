"""Where the batch dimension sits in a tensor: the value the batch_dim pass writes for every node
(``node.meta[fxdp.meta.BATCH_LAYOUT]``) and the per_sample pass hands to the runtime (each site holds
the layouts of its call's tensors).

Kinds:

- ``batched``: the batch is dimension ``dim`` (``BatchLayout.at(1)`` for a time-major ``(T, N, d)``);
- ``broadcast``: the tensor has size 1 at ``dim`` and is broadcast against batched tensors (position
  ids of shape ``(1, T)``): every sample sees the same values;
- ``unbatched``: no batch dimension at all (parameters, constants, masks of shape ``(T, T)``);
- ``merged``: the batch was merged with neighbouring dimensions into dimension ``dim`` (``(N*T, d)``
  after a reshape). ``inner`` is the product of the sizes merged to the right of the batch, so that
  dimension ``dim`` has size ``outer * N * inner``;
- ``packed``: the samples' entries one after another in dimension ``dim``, grouped by another tensor
  (the flat indices of ``EmbeddingBag(input, offsets)``, whose offsets start each sample's bag). Only
  an op whose batch rule knows the grouping reads it; any other op loses the batch there;
- ``unknown``: no rule could tell (reported as unverified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

BATCHED = "batched"
BROADCAST = "broadcast"
UNBATCHED = "unbatched"
MERGED = "merged"
PACKED = "packed"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class BatchLayout:
    kind: str
    dim: Optional[int] = None
    inner: int = 1

    @staticmethod
    def at(dim: int) -> "BatchLayout":
        return BatchLayout(BATCHED, dim)

    @staticmethod
    def broadcast(dim: int) -> "BatchLayout":
        return BatchLayout(BROADCAST, dim)

    @staticmethod
    def merged(dim: int, inner: int) -> "BatchLayout":
        return BatchLayout(MERGED, dim, inner)

    @staticmethod
    def packed(dim: int = 0) -> "BatchLayout":
        return BatchLayout(PACKED, dim)

    @property
    def is_batched(self) -> bool:
        """True when the tensor carries per-sample data (batched or merged)."""
        return self.kind in (BATCHED, MERGED)

    def __str__(self) -> str:
        if self.kind == BATCHED:
            return f"batch@{self.dim}"
        if self.kind == MERGED:
            return f"merged@{self.dim}(inner={self.inner})"
        if self.kind in (BROADCAST, PACKED):
            return f"{self.kind}@{self.dim}"
        return self.kind

    def to_batch_first(self, t: torch.Tensor, batch_size: int) -> torch.Tensor:
        """View ``t`` with the batch as dimension 0 (merged factors stay as extra dimensions)."""
        if self.kind == BATCHED:
            return t if self.dim == 0 else t.movedim(self.dim, 0)
        if self.kind == MERGED:
            d = self.dim % t.dim()
            size = t.shape[d]
            outer = size // (batch_size * self.inner)
            if outer * batch_size * self.inner != size:
                raise ValueError(
                    f"fxdp: dimension {d} of size {size} was recorded as the batch merged with "
                    f"factors (outer, N={batch_size}, inner={self.inner}), which do not divide it; "
                    "the shapes at run time differ from the ones analysed. Pass example_inputs "
                    "with the shapes you train on."
                )
            t = t.reshape(*t.shape[:d], outer, batch_size, self.inner, *t.shape[d + 1:])
            return t.movedim(d + 1, 0)
        if self.kind == BROADCAST:
            shape = list(t.shape)
            shape[self.dim] = batch_size
            return t.expand(shape).movedim(self.dim, 0)
        if self.kind == UNBATCHED:
            return t.unsqueeze(0).expand(batch_size, *t.shape)
        if self.kind == PACKED:  # as it is: the rule that reads it groups its entries by sample
            return t
        raise ValueError(f"fxdp: cannot locate the batch in a tensor whose layout is {self}")

    def from_batch_first(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_batch_first` (for batched and merged layouts): put the batch back."""
        if self.kind == BATCHED:
            return t.movedim(0, self.dim)
        if self.kind == MERGED:
            d = self.dim % (t.dim() - 2)
            t = t.movedim(0, d + 1)
            return t.reshape(*t.shape[:d], -1, *t.shape[d + 3:])
        raise ValueError(f"fxdp: {self} has no batch dimension to restore")


UNBATCHED_LAYOUT = BatchLayout(UNBATCHED)
UNKNOWN_LAYOUT = BatchLayout(UNKNOWN)

