"""Every error fxdp raises on purpose, in one hierarchy; users read them as :mod:`fxdp.errors`.

``FxdpError`` is the root. ``NotPrivateError`` is "this model cannot be trained privately as it is",
whatever the engine and whether ``strict`` is on, so ``except fxdp.errors.NotPrivateError`` catches all of
them:

- :class:`BatchMixingError` — an op lets samples influence each other;
- :class:`SelfCheckError` — a per-sample engine that cannot read the model's code checked it on a real batch
  and found per-sample gradients it cannot trust (:class:`SampleMixingError`, :class:`LayerBatchError`), or
  could not check it (:class:`UnverifiedModelError`, strict or not);
- :class:`UnsupportedError` and its validators' taxonomy, each mapping to one :class:`Kind` so that
  validation errors and the validate pass's findings speak the same language:
  :class:`UnsupportedModuleError` (the module cannot be made private, e.g. BatchNorm in training; also
  what ``strict`` validation raises, carrying every error in ``errors``; :class:`SampleMixingModuleError`, also a
  NotImplementedError, when a per-sample engine is built on a model with BatchNorm in training;
  :class:`UnsupportedModelError`, compile_for_dp's refusal when validation's findings are all it has),
  :class:`ShouldReplaceModuleError` (works once replaced by a drop-in), :class:`IllegalModuleConfigurationError`
  (its configuration breaks DP-SGD), :class:`NotYetSupportedModuleError` (could be supported, is not yet).

The others say fxdp could not finish its own work: :class:`PassError` (a pass failed unexpectedly; the
original exception is ``__cause__``) and :class:`BatchDimAnalysisError` (the batch-dimension analysis
could not run; :class:`MissingBatchRuleError` under ``strict`` for an op without a batch rule).
:class:`ExportShapeError` is raised when a model captured with torch.export gets inputs its graph has
no room for (a sequence length other than the example's). :class:`PerSampleError` is raised while a model
runs: a per-sample gradient could not be computed correctly for an op or a batch (the generic rule failed,
a rule returned the wrong shape, the DP optimizer found gradients it cannot clip, ...).
:class:`ModelChangedError` (and :class:`TrainabilityChangedError`) says a model changed after it was
compiled in a way fxdp cannot follow; :class:`AlreadyCompiledError` and :class:`AlreadyPrivateError` refuse
a model given twice.

:class:`ModuleFixWarning` lists what ``ModuleValidator.fix`` replaced; :class:`NonFiniteSampleWarning` says
a DP step dropped samples whose per-sample gradient is not finite; :func:`expect_module` is the
TypeError for an entry point given something that is not a module.
"""

from __future__ import annotations

import inspect
from typing import Iterable, Optional, Sequence, Tuple

from fxdp.diagnostics.findings import Finding, Kind, Severity, render_findings
from fxdp.diagnostics.naming import op_name
from fxdp.diagnostics.source import SourceLocation


class FxdpError(Exception):
    """The root of every error fxdp raises on purpose."""


class PassError(FxdpError, RuntimeError):
    """A pass failed; ``__cause__`` holds the original exception."""

    def __init__(self, pass_name: str, cause: BaseException):
        self.pass_name = pass_name
        super().__init__(f"fxdp pass '{pass_name}' failed: {type(cause).__name__}: {cause}")


class BatchDimAnalysisError(FxdpError, RuntimeError):
    """The batch-dimension analysis could not run (untraceable model, inputs that do not fit, ...)."""


class MissingBatchRuleError(BatchDimAnalysisError):
    """Strict mode: a per-sample tensor reached an op that has no batch rule."""


class PerSampleError(FxdpError, RuntimeError):
    """fxdp could not compute a correct per-sample gradient for this op / batch (while the model ran,
    in backward, or when the DP optimizer read them); the message says which and what to do."""


class StepRefusedError(PerSampleError, ValueError):
    """The DP optimizer refuses a step before anything moves (no per-sample gradient since the last step,
    ``zero_grad()`` missing, several batches for one step, non-finite per-sample gradients, ...). Also a
    ValueError, which Opacus's optimizer raises in these cases, so code written for Opacus catches it."""


class ModelChangedError(FxdpError, RuntimeError):
    """A model changed after it was compiled or wrapped (a layer or parameter replaced, a frozen parameter made
    trainable) in a way fxdp cannot follow in place: compile it again (or call make_private again)."""


class TrainabilityChangedError(ModelChangedError):
    """A parameter frozen at compile time is trainable now, and the compiled graph records no
    per-sample gradient for (some of) its uses (the compiled model is compiled again before a forward where
    that happens; this guard is what remains should the graph's code run without it)."""


class PrivacySettingError(FxdpError, ValueError):
    """A DP optimizer's setting (noise multiplier, clipping bound, expected batch size, ...) is not one a private
    step can run with; raised when it is set, and again before a step if it was changed behind the setter."""


class UnsupportedInputError(FxdpError, TypeError):
    """A model or layer was called with inputs an engine cannot locate the batch in (a non-tensor where the
    batch was recorded, tensor keyword arguments under the hooks engine, an output without a tensor)."""


class EmptyBatchError(FxdpError, ValueError, RuntimeError):
    """A check that compares per-sample gradients with the samples run one at a time was given a batch with
    no sample: there is nothing to compare (a RuntimeError too, as Opacus's checker raises)."""


class ExportShapeError(FxdpError, ValueError):
    """A model captured with torch.export (fxdp/frontends/export.py) was called with inputs whose shapes its
    graph cannot run: a size the model's code took from the example inputs (a sequence length)."""


class ExportModeError(FxdpError, RuntimeError):
    """A model captured with torch.export in training mode, whose graph keeps dropout that is not a layer
    (inside attention) switched on, was called in eval mode: its outputs would still be dropped out."""


class GradientCheckpointingError(FxdpError, ValueError):
    """A model with gradient (activation) checkpointing switched on (``model.gradient_checkpointing_enable()``) was
    given to fxdp: its layers re-run their forward inside backward, which fxdp's engines do not follow."""


class AlreadyCompiledError(FxdpError, ValueError):
    """A model that fxdp already compiled or wrapped was given to it again."""


class AlreadyPrivateError(FxdpError, ValueError):
    """A model whose parameters another live ``PrivacyEngine`` already made private was given to
    ``make_private`` again: each PrivacyEngine's accountant would count only its own steps."""


class NotPrivateError(FxdpError, ValueError):
    """The model cannot be trained with DP-SGD as it is; ``findings`` says why and where."""

    def __init__(self, findings, header: str):
        self.findings = tuple(findings)
        super().__init__(header + "\n" + render_findings(self.findings))


class BatchMixingError(NotPrivateError):
    """The model lets samples influence each other; no DP guarantee survives that."""


class SelfCheckError(NotPrivateError):
    """A per-sample engine's check of the model on a real batch found per-sample gradients it cannot trust."""


class SampleMixingError(SelfCheckError, BatchMixingError):
    """A sample's output changed when only another sample's input changed."""


class UnverifiedModelError(SelfCheckError):
    """The per-sample engine could not verify the model on a batch (see the message for why, and what to do): it
    is not trained on per-sample gradients nobody checked, whatever ``strict`` says."""


class LayerBatchError(SelfCheckError):
    """A hooked layer saw its input or output with the batch somewhere the per-sample engine does not assume."""


class UnsupportedOutputError(FxdpError, RuntimeError):
    """The loss depends on an output of a hooked layer whose gradient the per-sample rules never see."""


ROOT_NAME = "<model>"  # how the root module is named in errors and findings


def expect_module(obj, call: str) -> None:
    """Raise a TypeError naming what ``call`` (e.g. ``"fxdp.inspect(model, ...)"``) was given instead of
    an ``nn.Module``, and what to pass."""
    from torch import nn

    if isinstance(obj, nn.Module):
        return
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        given = f"the class {op_name(obj)} itself, not an instance; pass one, e.g. {obj.__name__}(...)"
    elif inspect.isroutine(obj):
        given = (f"the function {getattr(obj, '__qualname__', obj)!r}; wrap it in an nn.Module whose "
                 "forward calls it, with its parameters registered on the module")
    elif obj is None:
        given = "None"
    else:
        cls = type(obj)
        name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
        given = f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"
    raise TypeError(f"{call} expects a torch.nn.Module, got {given}")


class NonFiniteSampleWarning(UserWarning):
    """A DP step dropped samples whose per-sample gradient is not finite (inf or NaN): each contributes nothing to
    the step, as if clipped to 0, which keeps the step private; the noise is added as always."""


class ModuleFixWarning(UserWarning):
    """What ``ModuleValidator.fix`` replaced or changed: ``changes`` holds (module, before, after)."""

    def __init__(self, changes: Sequence[Tuple[str, str, str]], example_inputs_given: bool = True):
        self.changes = tuple(changes)
        lines = [f"  `{name}`: {before} -> {after}" for name, before, after in self.changes]
        hint = "" if example_inputs_given else (
            " (without example_inputs; pass them to choose each replacement by the shape its layer sees)")
        super().__init__(f"ModuleValidator.fix changed {len(self.changes)} module(s){hint}:\n" + "\n".join(lines))


class UnsupportedError(NotPrivateError):
    """Base of the validators' taxonomy: a module DP-SGD cannot train as it is.

    ``module_name`` and ``module_type`` may be left out by a validator: the caller (``ModuleValidator``
    or the validate pass) fills them in, since it knows where the module sits in the model.
    """

    kind: Kind = Kind.CANNOT_BE_PRIVATE

    def __init__(
        self,
        message: str,
        *,
        module_name: Optional[str] = None,
        module_type: Optional[type] = None,
        fix: str = "",
        location: Optional[SourceLocation] = None,
        op: Optional[str] = None,
    ):
        ValueError.__init__(self, message)  # str() is describe(), not a findings table
        self.message = message
        self.module_name = module_name
        self.module_type = module_type
        self.fix = fix
        self.location = location
        self._op = op  # what the graph node runs, when the error comes from a node, not a module

    @property
    def errors(self) -> Tuple["UnsupportedError", ...]:
        return (self,)

    @property
    def findings(self) -> Tuple[Finding, ...]:  # as NotPrivateError's, so one handler reads both
        return tuple(e.to_finding() for e in self.errors)

    def locate(self, module_name: str, module_type: Optional[type]) -> "UnsupportedError":
        """Fill in the module's name and type where the validator left them out."""
        if self.module_name is None:
            self.module_name = module_name
        if self.module_type is None:
            self.module_type = module_type
        return self

    @property
    def type_name(self) -> str:
        return self._op or op_name(self.module_type)

    def describe(self) -> str:
        """One line: which module, where, what is wrong, how to fix it."""
        head = f"`{self.module_name}` ({self.type_name})" if self.module_name else self.type_name
        if self.location is not None:
            head += f" at {self.location}"
        text = f"{head}: {self.message}"
        if self.fix:
            text += f" How to fix: {self.fix}"
        return text

    def __str__(self) -> str:
        return self.describe()

    def to_finding(self, pass_name: str = "validate", *, node: Optional[str] = None,
                   op: Optional[str] = None) -> Finding:
        return Finding(
            pass_name=pass_name,
            node=node if node is not None else (self.module_name or ROOT_NAME),
            op=op if op is not None else self.type_name,
            kind=self.kind,
            severity=Severity.ERROR,
            message=self.message,
            fix=self.fix,
            location=self.location,
        )


class UnsupportedModuleError(UnsupportedError):
    """The module cannot be made private; also the error strict validation raises for all errors."""

    kind = Kind.CANNOT_BE_PRIVATE

    def __init__(self, message: str = "", *, errors: Sequence[UnsupportedError] = (), **kwargs):
        super().__init__(message, **kwargs)
        self._errors = tuple(errors)

    @property
    def errors(self) -> Tuple[UnsupportedError, ...]:
        return self._errors or (self,)

    @classmethod
    def aggregate(cls, errors: Iterable[UnsupportedError], header: str = "") -> "UnsupportedModuleError":
        """One error that lists all of ``errors`` (raised by ``strict`` validation)."""
        errors = tuple(errors)
        header = header or (
            f"{len(errors)} problem(s) prevent training this model with DP-SGD "
            f"(fxdp.validators.ModuleValidator.fix fixes the common ones):"
        )
        return cls(header, errors=errors)

    def describe(self) -> str:
        if not self._errors:
            return super().describe()
        return "\n".join([self.message] + [f"  - {e.describe()}" for e in self._errors])


class UnsupportedModelError(UnsupportedModuleError):
    """``compile_for_dp`` (and so ``make_private``) refusing a model whose modules validation reports (a BatchNorm
    in training mode, an unsupported layer): the findings table a :class:`NotPrivateError` carries, raised as an
    ``UnsupportedModuleError``, the class Opacus's ``make_private`` raises there, so code written for Opacus
    catches it."""

    def __init__(self, findings, header: str):
        super().__init__(header)
        self._findings = tuple(findings)
        self._text = header + "\n" + render_findings(self._findings)

    @property
    def findings(self) -> Tuple[Finding, ...]:
        return self._findings

    def describe(self) -> str:
        return self._text


class SampleMixingModuleError(UnsupportedModuleError, NotImplementedError):
    """A per-sample engine was built on a model with a module that mixes samples in the mode it is in (BatchNorm
    in training): refused when the engine is built, each such module in ``errors``. Also a NotImplementedError,
    which Opacus's ``GradSampleModule`` raises there, so code written for Opacus catches it."""


class ShouldReplaceModuleError(UnsupportedError):
    """The module works with DP-SGD only once replaced by an equivalent."""

    kind = Kind.SHOULD_BE_REPLACED


class BatchNormModuleError(UnsupportedModuleError, ShouldReplaceModuleError):
    """A BatchNorm that normalises with the batch's statistics, as ``ModuleValidator.validate`` reports it: it
    cannot be trained privately as it is (an ``UnsupportedModuleError``), and ``ModuleValidator.fix`` replaces it
    (also a ``ShouldReplaceModuleError``, what Opacus's validator reports for a BatchNorm, so code written for
    Opacus that looks for that class finds it)."""


class IllegalModuleConfigurationError(UnsupportedError):
    """The module (or model) is configured in a way DP-SGD cannot train."""

    kind = Kind.ILLEGAL_CONFIGURATION


class NotYetSupportedModuleError(UnsupportedError):
    """The module could be trained privately, but fxdp does not support it yet."""

    kind = Kind.NOT_YET_SUPPORTED


_ERROR_FOR_KIND = {
    Kind.CANNOT_BE_PRIVATE: UnsupportedModuleError,
    Kind.SHOULD_BE_REPLACED: ShouldReplaceModuleError,
    Kind.ILLEGAL_CONFIGURATION: IllegalModuleConfigurationError,
    Kind.NOT_YET_SUPPORTED: NotYetSupportedModuleError,
}


def error_from_finding(finding: Finding) -> UnsupportedError:
    """The taxonomy's error for a finding (``UnsupportedModuleError`` for kinds outside it)."""
    cls = _ERROR_FOR_KIND.get(finding.kind, UnsupportedModuleError)
    return cls(finding.message, module_name=finding.node, fix=finding.fix, location=finding.location,
               op=finding.op)


__all__ = [
    "AlreadyCompiledError",
    "AlreadyPrivateError",
    "BatchDimAnalysisError",
    "BatchMixingError",
    "BatchNormModuleError",
    "EmptyBatchError",
    "ExportModeError",
    "ExportShapeError",
    "FxdpError",
    "GradientCheckpointingError",
    "IllegalModuleConfigurationError",
    "LayerBatchError",
    "MissingBatchRuleError",
    "ModelChangedError",
    "ModuleFixWarning",
    "NonFiniteSampleWarning",
    "NotPrivateError",
    "NotYetSupportedModuleError",
    "PassError",
    "PerSampleError",
    "PrivacySettingError",
    "SampleMixingError",
    "SampleMixingModuleError",
    "SelfCheckError",
    "ShouldReplaceModuleError",
    "StepRefusedError",
    "TrainabilityChangedError",
    "UnsupportedError",
    "UnsupportedInputError",
    "UnsupportedModelError",
    "UnsupportedModuleError",
    "UnsupportedOutputError",
    "UnverifiedModelError",
]
