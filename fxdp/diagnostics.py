"""Diagnostics are data: what a pass found or changed, where in the user's code, and how to fix it.

Producing findings (the passes) is kept apart from rendering them (``str()`` of a report, tabulate).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch.fx
from tabulate import tabulate

from fxdp.tracing import SourceLocation


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
        return str(self.location) if self.location is not None else "?"


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


class PassError(RuntimeError):
    """A pass failed; ``__cause__`` holds the original exception."""

    def __init__(self, pass_name: str, cause: BaseException):
        self.pass_name = pass_name
        super().__init__(f"fxdp pass '{pass_name}' failed: {type(cause).__name__}: {cause}")


class NotPrivateError(ValueError):
    """The model cannot be trained with DP-SGD as it is; ``findings`` says why and where."""

    def __init__(self, findings, header: str):
        self.findings = tuple(findings)
        super().__init__(header + "\n" + render_findings(self.findings))


class BatchMixingError(NotPrivateError):
    """The model lets samples influence each other; no DP guarantee survives that."""


_FINDING_HEADERS = ["pass", "severity", "kind", "node", "op", "where", "message", "how to fix"]


def render_findings(findings) -> str:
    rows = [
        [f.pass_name, f.severity.value, f.kind.value, f.node, f.op, f.where, f.message, f.fix]
        for f in findings
    ]
    if not rows:
        return "(no findings)"
    return tabulate(rows, headers=_FINDING_HEADERS, tablefmt="simple", maxcolwidths=[None, None, None, 24, 24, 36, 60, 50])


@dataclass(frozen=True)
class CompileReport:
    """Everything ``compile_for_dp`` / ``inspect`` learned about a model."""

    model: str  # class name of the user's model
    traced: bool
    passes: Tuple[PassReport, ...] = ()
    fallback_reason: Optional[str] = None  # why the hooks engine is used instead of the graph
    fallback_location: Optional[SourceLocation] = None
    mode: str = "fx"
    notes: Tuple[str, ...] = field(default=())

    @property
    def fell_back(self) -> bool:
        return self.fallback_reason is not None

    @property
    def findings(self) -> Tuple[Finding, ...]:
        return tuple(f for p in self.passes for f in p.findings)

    @property
    def changes(self) -> Tuple[Finding, ...]:
        return tuple(c for p in self.passes for c in p.changes)

    @property
    def errors(self) -> Tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity is Severity.ERROR)

    def pass_report(self, name: str) -> PassReport:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass named {name!r} in this report; passes: {[p.name for p in self.passes]}")

    def __str__(self) -> str:
        lines = [f"fxdp compile report for {self.model}"]
        if self.traced:
            lines.append(f"traced: yes (torch.fx); engine: {self.mode}")
        else:
            lines.append("traced: no, falling back to the hooks engine (GradSampleModule)")
        if self.fallback_reason:
            where = f" at {self.fallback_location}" if self.fallback_location else ""
            lines.append(f"fallback reason{where}: {self.fallback_reason}")
        lines.extend(self.notes)
        if self.passes:
            summary = [
                [p.name, len(p.changes), len(p.findings),
                 sum(f.severity is Severity.ERROR for f in p.findings)]
                for p in self.passes
            ]
            lines += ["", tabulate(summary, headers=["pass", "changes", "findings", "errors"], tablefmt="simple")]
        if self.changes:
            lines += ["", "Changes:", render_findings(self.changes)]
        if self.findings:
            lines += ["", "Findings:", render_findings(self.findings)]
        elif self.passes:
            lines += ["", "Findings: none"]
        return "\n".join(lines)
