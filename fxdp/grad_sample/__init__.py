"""Per-sample gradient rules ("grad samplers") and the generic rule.

- ``registry``: the one registry, :func:`register_grad_sampler` / :func:`find_grad_sampler`;
- one module per layer family with hand-written rules: ``linear``, ``conv``, ``embedding``, ``norms``;
- ``moe``: sparse mixture-of-experts blocks as one unit, each sample re-run alone (:func:`register_moe_block`);
- ``recurrent``: stock LSTM / GRU / RNN as Linear-like projections over time steps (run step by step by
  :mod:`fxdp.runtime.recurrent`, one capture per projection);
- ``transformer``: stock attention, transformer layers and stacks run as torch runs them with gradients, each
  projection, feed-forward layer and norm a capture of its own (the packed in-projection a Linear view);
- ``broadcast``: a parameter added to per-sample data (a position table): the output gradient, summed;
- ``generic``: THE generic rule for everything else (vmap of a vjp, a loop where vmap cannot run);
- ``accumulate``: :func:`compute_grad_samples` (rule lookup, generic fallback, loss reduction),
  :func:`zero_grad_sample`.

The gradient sinks, which receive what the rules compute, are :mod:`fxdp.sinks`; this package imports
nothing from them (book-keeping there reads the rules registered here).

The built-in rules are registered for their layer classes by the layer families, :mod:`fxdp.layers` (one module
per family, each with the layer's book-keeping and batch rule beside its per-sample rule); ``import fxdp`` imports
them.
"""

from __future__ import annotations

from fxdp.grad_sample.registry import find_grad_sampler, register_grad_sampler, rule_name
from fxdp.grad_sample.accumulate import compute_grad_samples, zero_grad_sample
from fxdp.grad_sample.generic import functional_grad_samples, generic_grad_sampler
from fxdp.grad_sample.moe import moe_block_grad_sampler, register_moe_block

__all__ = [
    "register_grad_sampler",
    "find_grad_sampler",
    "rule_name",
    "compute_grad_samples",
    "zero_grad_sample",
    "generic_grad_sampler",
    "functional_grad_samples",
    "moe_block_grad_sampler",
    "register_moe_block",
]
