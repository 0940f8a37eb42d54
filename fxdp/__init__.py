"""fxdp: compile PyTorch models for differentially private training (DP-SGD) with torch.fx.

The pipeline, in the order it runs::

    fxdp.tracing          trace the model, remembering each node's line in your code
    fxdp.passes.validate  layers DP-SGD cannot train (BatchNorm, ...), frozen and tied parameters
    fxdp.passes.inplace   in-place ops rewritten out of place
    fxdp.passes.batch_dim where the batch sits at every node; ops that move it or mix samples
    fxdp.passes.per_sample DP-aware ops (fxdp.runtime) that record per-sample gradients
"""

from fxdp import grad_sample, validators  # grad_sample registers the built-in per-sample rules
from fxdp.checker import check_per_sample_gradients_are_correct, per_sample_gradient_diagnostics
from fxdp.compiler import compile_for_dp, inspect, report
from fxdp.diagnostics import (
    BatchMixingError,
    CompileReport,
    Finding,
    Kind,
    NotPrivateError,
    PassError,
    Severity,
)
from fxdp.grad_sample.accumulate import zero_grad_sample
from fxdp.grad_sample.hooks import GradSampleModule
from fxdp.grad_sample.registry import register_grad_sampler
from fxdp.passes.batch_dim import find_batch_dim_violations
from fxdp.passes.batch_rules import register_batch_rule

__version__ = "0.1.0"

__all__ = [
    "BatchMixingError",
    "CompileReport",
    "Finding",
    "GradSampleModule",
    "Kind",
    "NotPrivateError",
    "PassError",
    "Severity",
    "check_per_sample_gradients_are_correct",
    "compile_for_dp",
    "find_batch_dim_violations",
    "grad_sample",
    "inspect",
    "per_sample_gradient_diagnostics",
    "register_batch_rule",
    "register_grad_sampler",
    "report",
    "validators",
    "zero_grad_sample",
]
