"""Per-sample gradients of ``nn.Embedding`` and ``nn.EmbeddingBag``.

Sample ``n``'s weight gradient is a ``(V, D)`` matrix whose row ``v`` sums the output gradients at
the positions where sample ``n`` looked up ``v``. All samples are filled by one ``index_add_`` into a
``(N*V, D)`` buffer at rows ``n*V + index``.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn


def _scatter_rows(
    num_samples: int,
    num_rows: int,
    sample_ids: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """``out[s, v] = sum of values[j] with sample_ids[j] == s and indices[j] == v``, shape (S, V, D)."""
    rows = sample_ids * num_rows + indices
    out = values.new_zeros(num_samples * num_rows, values.shape[-1])
    out.index_add_(0, rows, values)
    if scale_grad_by_freq:
        # the frequency is counted within the sample's own batch of one
        counts = values.new_zeros(num_samples * num_rows).index_add_(0, rows, values.new_ones(rows.shape[0]))
        out = out / counts.clamp(min=1).unsqueeze(1)
    return out.view(num_samples, num_rows, values.shape[-1])


def embedding_grad_sample(
    module: nn.Embedding, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    if module.max_norm is not None:
        raise NotImplementedError(
            f"fxdp: no per-sample gradient rule for {type(module).__name__} with max_norm="
            f"{module.max_norm}: max_norm rescales the embedding rows in place during the forward pass, "
            "so each sample would see different weights. Use max_norm=None (DP-SGD already bounds "
            "each sample's gradient), or register your own rule with fxdp.register_grad_sampler."
        )
    if not module.weight.requires_grad:
        return {}
    indices = activations[0]
    n = indices.shape[0]
    num_rows, dim = module.weight.shape
    flat = indices.reshape(n, -1)
    sample_ids = torch.arange(n, device=indices.device).repeat_interleave(flat.shape[1])
    grad = _scatter_rows(
        n, num_rows, sample_ids, flat.reshape(-1), backprops.reshape(-1, dim), module.scale_grad_by_freq
    )
    if module.padding_idx is not None:
        grad[:, module.padding_idx] = 0
    return {module.weight: grad}


def _bag_inputs(activations: List[torch.Tensor]):
    """(input, offsets, per_sample_weights) from the activations: offsets are the integer tensor,
    per-sample weights the floating-point one, in whichever order they were passed."""
    indices = activations[0]
    offsets: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    for a in activations[1:]:
        if not isinstance(a, torch.Tensor):
            continue
        if a.is_floating_point():
            weights = a
        else:
            offsets = a
    return indices, offsets, weights


def embedding_bag_grad_sample(
    module: nn.EmbeddingBag, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Each bag (a row of the output) is one sample: rows of a 2D input, or the bags of a 1D input
    delimited by ``offsets``."""
    if module.mode not in ("sum", "mean"):
        raise NotImplementedError(
            f"fxdp: no per-sample gradient rule for {type(module).__name__} with mode={module.mode!r}; "
            "modes 'sum' and 'mean' are supported. Use one of those, or register your own rule with "
            "fxdp.register_grad_sampler."
        )
    if module.max_norm is not None:
        raise NotImplementedError(
            f"fxdp: no per-sample gradient rule for {type(module).__name__} with max_norm="
            f"{module.max_norm}: max_norm rescales the embedding rows in place during the forward pass. "
            "Use max_norm=None, or register your own rule with fxdp.register_grad_sampler."
        )
    if not module.weight.requires_grad:
        return {}
    indices, offsets, weights = _bag_inputs(activations)
    num_rows, dim = module.weight.shape
    device = indices.device
    num_bags = backprops.shape[0]
    if indices.dim() == 2:
        bag_ids = torch.arange(num_bags, device=device).repeat_interleave(indices.shape[1])
        indices = indices.reshape(-1)
        if weights is not None:
            weights = weights.reshape(-1)
    else:
        if offsets is None:
            raise ValueError(f"fxdp: {type(module).__name__} got a 1D input without offsets")
        if module.include_last_offset:
            # the last offset ends the last bag; entries after it are not used
            end = int(offsets[num_bags])
            indices = indices[:end]
            if weights is not None:
                weights = weights[:end]
        positions = torch.arange(indices.shape[0], device=device, dtype=offsets.dtype)
        bag_ids = (torch.searchsorted(offsets[:num_bags], positions, right=True) - 1).long()
    included = torch.ones_like(indices, dtype=torch.bool)
    if module.padding_idx is not None:
        # entries equal to padding_idx are left out of their bag (and of its size, for "mean")
        included = indices != module.padding_idx
    entry_weights = included.to(backprops.dtype)
    if weights is not None:
        entry_weights = entry_weights * weights.to(backprops.dtype)
    if module.mode == "mean":
        sizes = backprops.new_zeros(num_bags).index_add_(0, bag_ids, included.to(backprops.dtype))
        entry_weights = entry_weights / sizes.clamp(min=1)[bag_ids]
    values = backprops[bag_ids] * entry_weights.unsqueeze(1)
    grad = _scatter_rows(num_bags, num_rows, bag_ids, indices, values, module.scale_grad_by_freq)
    return {module.weight: grad}
