"""fxdp: compile PyTorch models for differentially private training (DP-SGD) with torch.fx.

The pipeline, in the order it runs::

    fxdp.frontends         the model as a graph: torch.fx first, torch.export second; each node keeps
                           the line of your code that made it
    fxdp.passes.validate   layers DP-SGD cannot train (BatchNorm, ...), frozen and tied parameters
    fxdp.passes.inplace    in-place ops rewritten out of place
    fxdp.passes.batch_dim  where the batch sits at every node; ops that move it or mix samples
    fxdp.passes.per_sample DP-aware ops (fxdp.runtime) that record per-sample gradients
    fxdp.passes.loss       your loss, judged by the same batch rules on the first step (or traced from the
                           criterion): ops that mix samples, normalisers the whole batch sets

then a per-sample engine (fxdp.engines) chosen by fxdp.compiler: the compiled graph ("fx"), the whole
model as one DP-aware op ("fx+whole-model"), or one that does not compile ("hooks", "ew", "functorch",
"no_op"). docs/pipeline.md ("Words") lists what each word means.
What compiled code calls at run time (the DP-aware ops, the guards, the compiled module class) is
fxdp.runtime; the per-layer per-sample rules are fxdp.grad_sample, the gradient sinks they feed fxdp.sinks, and
fxdp.layers registers each layer family's per-sample rule, book-keeping and batch rule side by side.

Training privately: fxdp.PrivacyEngine (fxdp.privacy_engine) combines the compiled model, the DP optimizer
(fxdp.optim), Poisson sampling (fxdp.data) and the accountant (fxdp.accounting); fxdp.audit measures an
empirical lower bound on epsilon from one training run; fxdp.distributed trains across processes.
fxdp.validators is Opacus's ModuleValidator (it uses the front end and the inplace pass); fxdp.diagnostics
holds the reports and findings. Every error fxdp raises on purpose is in fxdp.errors.

Three leaf modules stay at the top because every stage reads them and they import nothing of the
pipeline: fxdp.meta (every node.meta key), fxdp.layout (where the batch sits: BatchLayout) and
fxdp.registry (the type registry that walks the MRO).
"""

from fxdp import errors, grad_sample, layers, validators  # layers registers the built-in layer families
from fxdp.checker import check_per_sample_gradients_are_correct, per_sample_gradient_diagnostics
from fxdp.compiler import compile_for_dp, inspect, report
from fxdp.diagnostics import CompileReport, Finding, Kind, Severity
from fxdp.engines import GradSampleModule
from fxdp.grad_sample.accumulate import zero_grad_sample
from fxdp.grad_sample.moe import register_moe_block
from fxdp.grad_sample.registry import register_grad_sampler
from fxdp.layers import register_layer
from fxdp.passes.batch_dim import find_batch_dim_violations
from fxdp.passes.batch_rules import register_batch_rule
from fxdp.data import BatchMemoryManager, DPDataLoader
from fxdp.optim import DPOptimizer
from fxdp.per_sample_loss import per_sample_mean
from fxdp.runtime.loss_probe import shared
from fxdp.privacy_engine import PrivacyEngine, PrivacyEngineAdaptiveClipping
from fxdp import accounting, audit  # noqa: E402  (fxdp.accounting.RDPAccountant, fxdp.audit.one_run)

__version__ = "0.1.0"

# The errors are fxdp.errors.X (``except fxdp.errors.NotPrivateError``), not names of this module.
__all__ = [
    "BatchMemoryManager",
    "CompileReport",
    "DPDataLoader",
    "DPOptimizer",
    "Finding",
    "GradSampleModule",
    "Kind",
    "PrivacyEngine",
    "PrivacyEngineAdaptiveClipping",
    "Severity",
    "accounting",
    "audit",
    "check_per_sample_gradients_are_correct",
    "compile_for_dp",
    "errors",
    "find_batch_dim_violations",
    "grad_sample",
    "inspect",
    "per_sample_gradient_diagnostics",
    "per_sample_mean",
    "register_batch_rule",
    "register_grad_sampler",
    "register_layer",
    "register_moe_block",
    "report",
    "shared",
    "validators",
    "zero_grad_sample",
]
