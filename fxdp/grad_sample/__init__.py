"""Per-sample gradient rules ("grad samplers") and the code that turns them into ``p.grad_sample``.

- ``registry``: the one registry, :func:`register_grad_sampler` / :func:`find_grad_sampler`;
- ``accumulate``: :func:`compute_grad_samples` (rule lookup, generic fallback, loss reduction),
  :func:`accumulate_grad_samples`, :func:`zero_grad_sample`;
- one module per layer family with hand-written rules: ``linear``, ``conv``, ``embedding``,
  ``norms``; ``functorch_rule`` is the generic rule for everything else.

Importing this package registers the built-in rules (the imports below are what registers them).
"""

from __future__ import annotations

from fxdp.grad_sample.registry import find_grad_sampler, register_grad_sampler, rule_name
from fxdp.grad_sample.accumulate import accumulate_grad_samples, compute_grad_samples, zero_grad_sample
from fxdp.grad_sample import conv, embedding, linear, norms  # noqa: F401  (registers the built-in rules)
from fxdp.grad_sample.functorch_rule import functional_grad_samples, functorch_grad_sampler

__all__ = [
    "register_grad_sampler",
    "find_grad_sampler",
    "rule_name",
    "compute_grad_samples",
    "accumulate_grad_samples",
    "zero_grad_sample",
    "functorch_grad_sampler",
    "functional_grad_samples",
]
