"""A convolution's padding as its ``forward`` applies it, shared by its per-sample rule
(:mod:`fxdp.grad_sample.conv`) and its book-keeping (:mod:`fxdp.sinks.bookkeeping.conv`), which both run the
convolution backward kernel on the layer's input and so must pad it exactly as the forward did: non-zero padding
modes (reflect, replicate, circular) and asymmetric ``padding="same"`` with ``F.pad`` first, then the convolution
with padding 0; zero padding, symmetric, left to the convolution itself."""

from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

_Conv = Union[nn.Conv1d, nn.Conv2d, nn.Conv3d]


def conv_padding(module: _Conv) -> List[Tuple[int, int]]:
    """(before, after) padding of each spatial dimension, as the module's forward applies it."""
    nd = len(module.kernel_size)
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return [(0, 0)] * nd
        # "same": total d*(k-1), the odd element goes after, as in torch's own "same" convolution
        pads = []
        for d, k in zip(module.dilation, module.kernel_size):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in module.padding]


def pad_activations(module: _Conv, x: torch.Tensor) -> Tuple[torch.Tensor, Sequence[int]]:
    """The input padded as the forward pads it, and the padding left for the convolution itself."""
    pads = conv_padding(module)
    symmetric = all(before == after for before, after in pads)
    if symmetric and (module.padding_mode == "zeros" or not any(before for before, _ in pads)):
        return x, [before for before, _ in pads]
    flat = [p for before_after in reversed(pads) for p in before_after]  # F.pad wants the last dim first
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, flat, mode=mode), [0] * len(pads)
