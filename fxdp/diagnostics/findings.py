"""Findings are data: what a pass found or changed, where in the user's code, and how to fix it.

Producing findings (the passes) is kept apart from rendering them (:func:`render_findings`, tabulate).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch.fx
from tabulate import tabulate

from fxdp.diagnostics.source import SourceLocation


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class Kind(str, enum.Enum):
    """What a finding is about. The first four are the validation taxonomy."""

    CANNOT_BE_PRIVATE = "cannot be made private"
    SHOULD_BE_REPLACED = "should be replaced"
    ILLEGAL_CONFIGURATION = "illegal configuration"
    NOT_YET_SUPPORTED = "not yet supported"
    MOVES_BATCH = "moves the batch"
    MIXES_SAMPLES = "mixes samples"
    UNVERIFIED = "unverified"
    NORMALISER = "normalised by the batch"  # a loss divided by a count or weight the whole batch sets
    REWRITE = "rewrite"
    NOTE = "note"


@dataclass(frozen=True)
class Finding:
    """One thing a pass has to say about one node (or module)."""

    pass_name: str
    node: str  # node name in the graph, or the module's qualified name
    op: str  # what the node runs: "nn.BatchNorm2d", "transpose", "operator.iadd", ...
    kind: Kind
    severity: Severity
    message: str
    fix: str = ""
    location: Optional[SourceLocation] = None
    path: Tuple[str, ...] = ()  # node names from the model input to this node, where relevant

    @property
    def where(self) -> str:
        """``file:line``, relative to the working directory where possible (``built at file:line`` for the
        line that constructed a layer torch's code calls)."""
        return self.location.where if self.location is not None else "?"


@dataclass(frozen=True)
class PassReport:
    """What one pass changed (``changes``) and found (``findings``)."""

    name: str
    changes: Tuple[Finding, ...] = ()
    findings: Tuple[Finding, ...] = ()

    @property
    def modified(self) -> bool:
        return bool(self.changes)


@dataclass(frozen=True)
class PassResult:
    graph_module: torch.fx.GraphModule
    report: PassReport


_FINDING_HEADERS = ["pass", "severity", "kind", "node", "op", "where", "message", "how to fix"]


def render_findings(findings) -> str:
    """A table of findings. ``file:line`` is never wrapped (it must stay clickable and searchable);
    the long text columns are."""
    rows = [
        [f.pass_name, f.severity.value, f.kind.value, f.node, f.op, f.where, f.message, f.fix]
        for f in findings
    ]
    if not rows:
        return "(no findings)"
    widths = [None, None, None, 24, 24, None, 60, 50]  # "where" (file:line) is never wrapped
    return tabulate(rows, headers=_FINDING_HEADERS, tablefmt="simple", maxcolwidths=widths)


