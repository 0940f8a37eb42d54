"""GradientSink.grouped_squared_norms: ||sum of a group's per-sample gradients||^2, exactly, from the
materialising sink (index_add) and from the contract's default (one clipped sum per group), which any sink
without its own form (the audit's canary sink, the sharded one) answers with."""

from __future__ import annotations

import torch
from torch import nn

from fxdp.sinks.contract import GradientSink, GradSampleSink


def test_grouped_norms_from_rows_and_from_the_default_agree_with_the_sums():
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.zeros(3, 4, dtype=torch.float64)), nn.Parameter(torch.zeros(3, dtype=torch.float64))
    w.grad_sample = torch.randn(7, 3, 4, dtype=torch.float64)
    b.grad_sample = torch.randn(7, 3, dtype=torch.float64)
    groups = torch.tensor([2, 0, 0, 1, 2, 2, 0])  # not in order
    sink = GradSampleSink()
    rows = sink.grouped_squared_norms([w, b], groups, 3)
    default = GradientSink.grouped_squared_norms(sink, [w, b], groups, 3)
    for p in (w, b):
        expected = torch.stack([p.grad_sample[groups == u].sum(0).pow(2).sum() for u in range(3)])
        torch.testing.assert_close(rows[p], expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(default[p], expected, rtol=1e-12, atol=1e-12)
