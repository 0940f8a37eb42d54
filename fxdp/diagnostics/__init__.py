"""Diagnostics are data: findings, reports, errors, op names and source locations.

This package imports nothing else from fxdp, so every other module can use it.

- :mod:`~fxdp.diagnostics.findings` — :class:`Finding`, :class:`PassReport`, :class:`PassResult`, rendering;
- :mod:`~fxdp.diagnostics.report`   — :class:`CompileReport`, the per-sample engines' names;
- :mod:`~fxdp.diagnostics.errors`   — every error class, one hierarchy under :class:`FxdpError` (public as
  :mod:`fxdp.errors`);
- :mod:`~fxdp.diagnostics.naming`   — :func:`op_name`, how findings name an op;
- :mod:`~fxdp.diagnostics.source`   — :class:`SourceLocation`, the user's line behind a node or a traceback.
"""

from fxdp.diagnostics import errors
from fxdp.diagnostics.errors import *  # noqa: F401,F403  (every error class: errors.__all__)
from fxdp.diagnostics.errors import ROOT_NAME, error_from_finding, expect_module
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

__all__ = [*errors.__all__, "CompileReport", "ENGINES", "Finding", "GRAD_SAMPLE_MODES", "Kind", "PassReport",
           "PassResult", "ROOT_NAME", "Severity", "SourceLocation", "WHOLE_MODEL", "error_from_finding",
           "expect_module", "location_from_stack_trace", "location_from_traceback", "location_of_caller",
           "op_name", "relative_path", "render_findings"]
