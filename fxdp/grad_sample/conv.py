"""Per-sample gradients of ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``.

The weight gradient of a convolution is itself computed by the convolution backward kernel. Folding
the batch into the groups — input ``(1, N*C, *S)``, output gradient ``(1, N*O, *S')``, weight
``(N*O, C/G, *K)``, ``groups = N*G`` — makes that one kernel call return every sample's weight
gradient at once, with no ``unfold`` matrix of size ``N * C*prod(K) * prod(S')``, in about the time of
the ordinary (summed) weight gradient (docs/per_sample.md, "Why some code paths look as they do", has the
measurement against unfold + einsum).

Padding: non-zero padding modes (reflect, replicate, circular) and asymmetric ``padding="same"``
are applied to the activations with ``F.pad`` first; the convolution then runs with padding 0,
exactly as the module's own forward does (:mod:`fxdp.grad_sample.conv_padding`, which book-keeping shares).

Registered for ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` in :mod:`fxdp.layers.conv`.
"""

from __future__ import annotations

from typing import Dict, List, Union

import torch
from torch import nn

from fxdp.grad_sample.conv_padding import pad_activations

_Conv = Union[nn.Conv1d, nn.Conv2d, nn.Conv3d]


def conv_grad_sample(
    module: _Conv, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    x = activations[0]
    n = x.shape[0]
    ret: Dict[nn.Parameter, torch.Tensor] = {}
    if module.weight.requires_grad:
        x, padding = pad_activations(module, x)
        weight_shape = module.weight.shape
        out_channels = weight_shape[0]
        folded_input = x.reshape(1, n * x.shape[1], *x.shape[2:])
        folded_grad = backprops.reshape(1, n * out_channels, *backprops.shape[2:])
        # only its shape is read when just the weight gradient is requested
        folded_weight = backprops.new_empty((n * out_channels, *weight_shape[1:]))
        _, weight_grad, _ = torch.ops.aten.convolution_backward(
            folded_grad,
            folded_input.to(backprops.dtype),
            folded_weight,
            None,
            list(module.stride),
            list(padding),
            list(module.dilation),
            False,
            [0] * len(padding),
            module.groups * n,
            [False, True, False],
        )
        ret[module.weight] = weight_grad.reshape(n, *weight_shape)
    if module.bias is not None and module.bias.requires_grad:
        ret[module.bias] = backprops.reshape(n, backprops.shape[1], -1).sum(-1)
    return ret
