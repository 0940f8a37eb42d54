"""``DPMultiheadAttention`` (``nn.MultiheadAttention`` under Opacus's name) and ``SequenceBias``.

``DPMultiheadAttention`` has torch's constructor, ``forward`` and state_dict (``in_proj_weight`` or
``q_proj_weight``/``k_proj_weight``/``v_proj_weight``, ``in_proj_bias``, ``bias_k``, ``bias_v``,
``out_proj.*``, the keys Opacus's layer writes too), so a checkpoint of either loads into the other.
"""

from __future__ import annotations

import torch
from torch import nn


class DPMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention``; fxdp computes its per-sample gradients as the stock module's."""


class SequenceBias(nn.Module):
    """Appends one learned step, ``bias`` of shape ``(embed_dim,)``, to every sequence of the batch:
    ``(L, N, E) -> (L + 1, N, E)``, or ``(N, L, E) -> (N, L + 1, E)`` with ``batch_first=True``.
    (What ``nn.MultiheadAttention``'s ``add_bias_kv`` does to the keys and values.)"""

    def __init__(self, embed_dim: int, batch_first: bool = False, *, device=None, dtype=None):
        super().__init__()
        self.embed_dim = embed_dim
        self.batch_first = batch_first
        self.bias = nn.Parameter(torch.empty(embed_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time, batch = (1, 0) if self.batch_first else (0, 1)
        shape = [1, 1, self.embed_dim]
        shape[batch] = x.shape[batch]
        return torch.cat([x, self.bias.view(1, 1, -1).expand(shape)], dim=time)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, batch_first={self.batch_first}"
