"""Book-keeping of Hugging Face transformers' ``Conv1D`` (GPT-2's projections): ``x @ weight + bias`` with the
weight stored ``(in, out)``, a Linear layer whose per-sample weight gradient is ``A_i^T G_i``, book-kept as one
with A and G swapped (the norms are those of the transpose). Registered by class path, so fxdp never imports
transformers."""

from __future__ import annotations

import torch

from fxdp.grad_sample.linear import is_transformers_conv1d
from fxdp.sinks.bookkeeping.linear import LinearWeight, plan_matmul
from fxdp.sinks.bookkeeping.registry import LayerBookkeeping
from fxdp.sinks.bookkeeping.uses import Summed


def _transposed_linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight.t(), bias)


class TransformersConv1DBookkeeping(LayerBookkeeping):
    def applies(self, module):
        # its rule is transformers_conv1d_grad_sample, and the weight (in, out) and bias (out,) are its forward's
        return is_transformers_conv1d(module)

    def plan(self, module, a, g, prefer):
        d_in, d_out = tuple(module.weight.shape)
        return plan_matmul(type(module).__name__, a, g, d_in, d_out, prefer)

    def uses(self, captured, sink):
        out = {}
        for p in captured.params:
            if p is captured.module.bias:  # summed over the middle positions, as a Linear layer's
                out[p] = Summed(sink.bias_sum(captured.g), captured.scale)
            else:  # weight (in, out): its per-sample gradient A_i^T G_i is a Linear one with A and G swapped
                out[p] = LinearWeight(captured.g, captured.a.to(captured.g.dtype), captured.method, captured.scale)
        return out

    def functional_forward(self, module, x):
        return _transposed_linear, (module.weight, module.bias)
