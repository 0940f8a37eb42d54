"""The compile report: what ``compile_for_dp`` / ``inspect`` learned about a model, and which per-sample
engine computes its per-sample gradients, and why. The names of the per-sample engines are defined here,
once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

from tabulate import tabulate

from fxdp.diagnostics.errors import BatchMixingError, NotPrivateError, UnsupportedModelError
from fxdp.diagnostics.findings import Finding, Kind, PassReport, Severity, render_findings
from fxdp.diagnostics.source import SourceLocation

REPORT_ATTR = "fxdp_report"  # where a model compile_for_dp returns keeps its CompileReport

#: The per-sample engines a user names with ``grad_sample_mode``:
#: ``fx`` — the compiled graph, a DP-aware op per parametrised call;
#: ``hooks``, ``ew``, ``functorch``, ``no_op`` — the per-sample engines that do not compile (``hooks`` is
#: also the fallback for a model torch.fx cannot trace).
GRAD_SAMPLE_MODES = ("fx", "hooks", "ew", "functorch", "no_op")

#: The per-sample engine the compiler may choose besides those: traced and analysed, but the whole model
#: runs as one DP-aware op with the generic rule (an op the per_sample pass cannot handle).
WHOLE_MODEL = "fx+whole-model"

#: The engine of a model with PyTorch Geometric message-passing layers: one sample is one graph (fxdp/graphs).
GRAPHS = "graphs"

#: The per-sample engines a report can name.
ENGINES = GRAD_SAMPLE_MODES + (WHOLE_MODEL, GRAPHS)


@dataclass(frozen=True)
class CompileReport:
    """Everything ``compile_for_dp`` / ``inspect`` learned about a model."""

    model: str  # class name of the user's model
    traced: bool
    passes: Tuple[PassReport, ...] = ()
    fallback_reason: Optional[str] = None  # why the engine is not the compiled graph ("fx")
    fallback_location: Optional[SourceLocation] = None
    engine: str = "fx"  # one of ENGINES
    notes: Tuple[str, ...] = field(default=())
    # the front end that built the graph: "torch.fx" (symbolic tracing), "torch.export" (captured when
    # torch.fx failed; front_end_reason says why it failed), None when there is no graph (hooks)
    front_end: Optional[str] = None
    front_end_reason: Optional[str] = None

    @property
    def mode(self) -> str:
        """The engine's name (the field was called ``mode`` before engines had precise names)."""
        return self.engine

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
        if self.traced and self.front_end not in (None, "torch.fx"):
            lines.append(f"traced: yes ({self.front_end}); engine: {self.engine}")
            if self.front_end_reason:
                lines.append(f"front end: {self.front_end}, because {self.front_end_reason}")
        elif self.traced:
            lines.append(f"traced: yes (torch.fx); engine: {self.engine}")
        elif self.engine == GRAPHS:
            lines.append("traced: no; engine: graphs (GraphGradSampleModule, one sample per graph)")
        else:
            lines.append("traced: no, falling back to the hooks engine (GradSampleModule)")
        if self.fallback_reason:
            where = f" at {self.fallback_location}" if self.fallback_location else ""
            lines.append(f"{'engine' if self.engine == GRAPHS else 'fallback'} reason{where}: {self.fallback_reason}")
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


# The validation taxonomy (the kinds of a module validators report)
VALIDATION_KINDS = (Kind.CANNOT_BE_PRIVATE, Kind.SHOULD_BE_REPLACED, Kind.ILLEGAL_CONFIGURATION, Kind.NOT_YET_SUPPORTED)


def refuse_if_not_private(reports: Sequence[PassReport], when: str = "") -> None:
    """Raise :class:`~fxdp.diagnostics.errors.BatchMixingError` (an op mixes samples),
    :class:`~fxdp.diagnostics.errors.UnsupportedModelError` (modules validation reports, nothing else) or
    :class:`~fxdp.diagnostics.errors.NotPrivateError` with the error findings of ``reports``, if there are any;
    ``when`` ends the header (the input shapes they were found for)."""
    errors = [f for r in reports for f in r.findings if f.severity is Severity.ERROR]
    if not errors:
        return
    mixing = [f for f in errors if f.kind is Kind.MIXES_SAMPLES]
    header = (
        "The model mixes samples across the batch dimension, so it cannot be trained with DP-SGD: "
        "each sample's computation must not read another sample's data."
        if mixing else
        "The model cannot be trained with DP-SGD as it is. Fix the findings below "
        "(fxdp.validators.ModuleValidator.fix(model) replaces BatchNorm and in-place flags)."
    ) + when
    modules_only = all(f.kind in VALIDATION_KINDS for f in errors)  # what Opacus's validator would report
    raise (BatchMixingError if mixing else UnsupportedModelError if modules_only else NotPrivateError)(errors, header)
