"""The per-sample engines: what computes per-sample gradients for a model, one file each.

- ``fx`` — the compiled graph (:func:`fxdp.compile_for_dp`): a DP-aware op per parametrised call
  (:mod:`fxdp.runtime`);
- ``fx+whole-model`` (:mod:`~fxdp.engines.whole_model`) — a traced model with an op the per_sample
  pass cannot handle runs as one DP-aware op, with the layouts the batch_dim pass found;
- ``hooks`` (:mod:`~fxdp.engines.hooks`) — :class:`GradSampleModule`, per-layer rules on module hooks
  (also the fallback for a model torch.fx cannot trace);
- ``ew`` (:mod:`~fxdp.engines.ew`) — PyTorch's ExpandedWeights, batch first, for the layers it knows;
- ``functorch`` (:mod:`~fxdp.engines.functorch`) — the whole model under the generic rule, one tensor out;
- ``no_op`` (:mod:`~fxdp.engines.no_op`) — computes nothing; the user fills ``p.grad_sample``.

Every engine's wrapper (:class:`~fxdp.engines.base.GradSampleModuleBase`) holds a gradient sink
(``fxdp_sink``) and follows the conventions of :mod:`fxdp.grad_sample.accumulate`. Which engine a
model gets is decided in one place, :mod:`fxdp.compiler` (``compile_for_dp``, ``wrap_model``); the
engines never import the compiler.
"""

from fxdp.diagnostics.report import GRAD_SAMPLE_MODES
from fxdp.engines.base import GradSampleModuleBase
from fxdp.engines.ew import ExpandedWeightsGradSampleModule
from fxdp.engines.fast_gradient_clipping import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from fxdp.engines.functorch import FunctorchGradSampleModule
from fxdp.engines.hooks import GradSampleHooks, GradSampleModule
from fxdp.engines.no_op import NoOpGradSampleModule
from fxdp.engines.whole_model import PerSampleModel

#: The wrapper class of each per-sample engine that does not compile (``"fx"`` is ``compile_for_dp``).
WRAPPERS = {"hooks": GradSampleModule, "ew": ExpandedWeightsGradSampleModule,
            "functorch": FunctorchGradSampleModule, "no_op": NoOpGradSampleModule}


def get_gsm_class(grad_sample_mode: str) -> type:
    """The wrapper class of an engine, by Opacus's ``grad_sample_mode`` names (``"ghost"``: the hooks engine
    with a book-keeping sink; ``"fx"``, the compiled graph, has no class: use ``compile_for_dp``)."""
    classes = {**WRAPPERS, "ghost": GradSampleModuleFastGradientClipping}
    if grad_sample_mode == "ghost_fsdp":
        raise ValueError("fxdp: grad_sample_mode='ghost_fsdp' has no wrapper class: FSDP must run the model itself "
                         "(it gathers each unit's parameters around its forward and backward). Pass the model sharded "
                         "with torch.distributed.fsdp.fully_shard to PrivacyEngine.make_private (grad_sample_mode "
                         "'fx', 'ghost' or 'ghost_fsdp'); see docs/distributed.md")
    if grad_sample_mode not in classes:
        raise ValueError(f"fxdp: grad_sample_mode {grad_sample_mode!r} has no wrapper class; valid: "
                         + ", ".join(repr(m) for m in classes) + " ('fx' is fxdp.compile_for_dp)")
    return classes[grad_sample_mode]


def check_grad_sample_mode(grad_sample_mode: str) -> None:
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(
            f"fxdp: unknown grad_sample_mode {grad_sample_mode!r}; valid modes are "
            + ", ".join(repr(m) for m in GRAD_SAMPLE_MODES)
        )


__all__ = [
    "DPLossFastGradientClipping",
    "DPTensorFastGradientClipping",
    "GradSampleHooksFastGradientClipping",
    "GradSampleModuleFastGradientClipping",
    "get_gsm_class",
    "GRAD_SAMPLE_MODES",
    "ExpandedWeightsGradSampleModule",
    "FunctorchGradSampleModule",
    "GradSampleHooks",
    "GradSampleModule",
    "GradSampleModuleBase",
    "NoOpGradSampleModule",
    "PerSampleModel",
    "WRAPPERS",
    "check_grad_sample_mode",
]
