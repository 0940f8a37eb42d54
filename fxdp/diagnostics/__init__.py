"""Diagnostics are data: findings, reports, errors, op names and source locations.

This package imports nothing else from fxdp, so every other module can use it.

- :mod:`~fxdp.diagnostics.findings` — :class:`Finding`, :class:`PassReport`, :class:`PassResult`, rendering;
- :mod:`~fxdp.diagnostics.report`   — :class:`CompileReport`, the per-sample engines' names;
- :mod:`~fxdp.diagnostics.errors`   — every error class, one hierarchy under :class:`FxdpError` (public as
  :mod:`fxdp.errors`);
- :mod:`~fxdp.diagnostics.naming`   — :func:`op_name`, how findings name an op;
- :mod:`~fxdp.diagnostics.source`   — :class:`SourceLocation`, the user's line behind a node or a traceback.
"""

from fxdp.diagnostics.errors import (
    ROOT_NAME,
    AlreadyCompiledError,
    AlreadyPrivateError,
    BatchDimAnalysisError,
    BatchMixingError,
    FxdpError,
    GradientCheckpointingError,
    IllegalModuleConfigurationError,
    LayerBatchError,
    MissingBatchRuleError,
    ModelChangedError,
    ModuleFixWarning,
    NotPrivateError,
    NotYetSupportedModuleError,
    PassError,
    PerSampleError,
    StepRefusedError,
    PrivacySettingError,
    SampleMixingError,
    SampleMixingModuleError,
    SelfCheckError,
    UnsupportedInputError,
    ExportModeError,
    ExportShapeError,
    ShouldReplaceModuleError,
    TrainabilityChangedError,
    UnsupportedError,
    UnsupportedModuleError,
    UnsupportedOutputError,
    UnverifiedModelError,
    error_from_finding,
    expect_module,
)
from fxdp.diagnostics.findings import Finding, Kind, PassReport, PassResult, Severity, render_findings
from fxdp.diagnostics.naming import op_name
from fxdp.diagnostics.report import ENGINES, GRAD_SAMPLE_MODES, WHOLE_MODEL, CompileReport
from fxdp.diagnostics.source import (
    SourceLocation,
    location_from_stack_trace,
    location_from_traceback,
    location_of_caller,
    relative_path,
)

__all__ = [
    "AlreadyCompiledError",
    "AlreadyPrivateError",
    "BatchDimAnalysisError",
    "BatchMixingError",
    "CompileReport",
    "ENGINES",
    "Finding",
    "FxdpError",
    "GRAD_SAMPLE_MODES",
    "GradientCheckpointingError",
    "IllegalModuleConfigurationError",
    "Kind",
    "LayerBatchError",
    "MissingBatchRuleError",
    "ModelChangedError",
    "ModuleFixWarning",
    "NotPrivateError",
    "NotYetSupportedModuleError",
    "PassError",
    "PassReport",
    "PassResult",
    "PerSampleError",
    "StepRefusedError",
    "PrivacySettingError",
    "SampleMixingError",
    "SampleMixingModuleError",
    "SelfCheckError",
    "UnsupportedInputError",
    "ExportModeError",
    "ExportShapeError",
    "ROOT_NAME",
    "Severity",
    "ShouldReplaceModuleError",
    "SourceLocation",
    "TrainabilityChangedError",
    "UnsupportedError",
    "UnsupportedModuleError",
    "UnsupportedOutputError",
    "UnverifiedModelError",
    "WHOLE_MODEL",
    "error_from_finding",
    "expect_module",
    "location_from_stack_trace",
    "location_from_traceback",
    "location_of_caller",
    "op_name",
    "relative_path",
    "render_findings",
]
