"""Check an engine's per-sample gradients on a real batch against the definition.

By definition ``p.grad_sample[i]`` is the gradient sample ``i`` would give alone, in a batch of one.
So run the batch once through the wrapped model and once per sample through a plain copy, and compare.
This catches what no static analysis can promise to: a layer whose batch dimension moved, an op that
mixes samples, a wrong custom rule, a parameter used where no hook sees it.

The loss is a fixed random projection of the output, ``l_i = <out_i, R>``, reduced over the batch by
mean or sum; both reductions are checked, since the engines must undo the mean's ``1/N``. Two things
are compared, per parameter: each row of ``p.grad_sample`` with the gradient of its sample run alone,
and the sum of the rows with the batch gradient ``p.grad`` (they differ when the model mixes samples,
even if every row is right for its sample alone, as the functorch engine's are by construction).

``module`` may also be a model ``compile_for_dp`` (or ``wrap_model``) returned: then that engine, as
compiled, is checked (a deep copy of it), with its own loss reduction. Cross-sample dependence is tested
too (:attr:`PerSampleGradientDiagnostics.cross_sample_dependence`): perturbing one sample's input must
leave every other sample's output unchanged.

The model runs as it is: random layers such as dropout draw different masks for the batch and for
each sample, so set their probability to 0 before checking (``compile_for_dp`` refuses a model in eval
mode, so ``model.eval()`` is no way out for the "fx" engine).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils import _pytree as pytree

from fxdp.compiler import compile_for_dp, wrap_model
from fxdp.engines import GradSampleModuleBase, PerSampleModel, check_grad_sample_mode
from fxdp.engines.selfcheck import SelfCheckError, cross_sample_dependence, preserved_state
from fxdp.grad_sample.accumulate import zero_grad_sample
from fxdp.grad_sample.generic import LOSS_REDUCTIONS

Inputs = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclass
class ParameterCheck:
    """How one parameter's ``grad_sample`` compared with the per-sample loop, for one reduction."""

    name: str
    reduction: str
    grad_sample_shape: Optional[Tuple[int, ...]]  # None when the engine set no grad_sample
    expected_shape: Tuple[int, ...]
    max_abs_diff: float = math.nan
    max_rel_diff: float = math.nan
    mismatched_samples: List[int] = field(default_factory=list)
    # Do the rows add up to the batch gradient p.grad (divided by N for "mean")? A model that mixes
    # samples fails here even when each row is right for its sample run alone (as the functorch
    # engine's are by construction). None: the engine sets no p.grad (ExpandedWeights).
    sums_to_batch_grad: Optional[bool] = None
    batch_grad_max_abs_diff: float = math.nan

    @property
    def missing_grad_sample(self) -> bool:
        return self.grad_sample_shape is None

    @property
    def shape_mismatch(self) -> bool:
        return not self.missing_grad_sample and self.grad_sample_shape != self.expected_shape

    @property
    def ok(self) -> bool:
        return (
            not self.missing_grad_sample
            and not self.shape_mismatch
            and not self.mismatched_samples
            and self.sums_to_batch_grad is not False
        )

    @property
    def problem(self) -> str:
        if self.missing_grad_sample:
            return "no grad_sample was set"
        if self.shape_mismatch:
            return f"grad_sample has shape {self.grad_sample_shape}, expected {self.expected_shape}"
        if self.mismatched_samples:
            return f"samples {_short_list(self.mismatched_samples)} differ from their batch-of-one gradient"
        if self.sums_to_batch_grad is False:
            return (
                "the per-sample gradients do not add up to the batch gradient p.grad (max abs diff "
                f"{self.batch_grad_max_abs_diff:.3g}): the model mixes samples across the batch dimension"
            )
        return ""

    def __str__(self) -> str:
        status = "ok" if self.ok else self.problem
        return (
            f"{self.name} [{self.reduction}]: {status} (max abs diff {self.max_abs_diff:.3g}, "
            f"max rel diff {self.max_rel_diff:.3g})"
        )


class PerSampleGradientDiagnostics(list):
    """The list of :class:`ParameterCheck` records; ``str()`` renders it as a table.

    ``cross_sample_dependence``: what the cross-sample test found (a sample's output changed when only
    another sample's input did), or None; ``cross_sample_untested``: why that test could not run, or None.
    """

    cross_sample_dependence: Optional[str] = None
    cross_sample_untested: Optional[str] = None
    engine_error: Optional[str] = None  # the engine refused the batch (its own checks), before any gradient
    engine_findings: tuple = ()  # that error's findings

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self) and self.cross_sample_dependence is None and self.engine_error is None

    @property
    def failures(self) -> List[ParameterCheck]:
        return [r for r in self if not r.ok]

    def __str__(self) -> str:
        from tabulate import tabulate

        rows = [
            (
                r.name,
                r.reduction,
                "missing" if r.grad_sample_shape is None else tuple(r.grad_sample_shape),
                tuple(r.expected_shape),
                f"{r.max_abs_diff:.3g}",
                f"{r.max_rel_diff:.3g}",
                _short_list(r.mismatched_samples) if r.mismatched_samples else "",
                {None: "n/a", True: "yes", False: "NO"}[r.sums_to_batch_grad],
                "ok" if r.ok else "FAIL",
            )
            for r in self
        ]
        headers = ("parameter", "reduction", "grad_sample", "expected", "max abs diff",
                   "max rel diff", "samples that differ", "sums to p.grad", "status")
        table = tabulate(rows, headers=headers)
        if self.engine_error is not None:
            table += f"\nthe engine refused the batch: {self.engine_error}"
        if self.cross_sample_dependence is not None:
            table += f"\ncross-sample dependence: {self.cross_sample_dependence}"
        elif self.cross_sample_untested is not None:
            table += f"\ncross-sample dependence: not tested ({self.cross_sample_untested})"
        return table


def check_per_sample_gradients_are_correct(
    x: Inputs,
    module: nn.Module,
    *,
    batch_first: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    grad_sample_mode: str = "fx",
) -> bool:
    """True when, for both loss reductions, every trainable parameter's ``grad_sample`` matches the
    gradients of the samples of ``x`` run one at a time (``|a - b| <= atol + rtol * |b|`` elementwise,
    ``b`` the batch-of-one gradient, as ``torch.allclose``), and its rows add up to ``p.grad``.
    ``x`` is a tensor or a tuple of the model's positional inputs, batched at dim 0 (1 with
    ``batch_first=False``). ``module`` itself is not modified: deep copies are checked.
    See :func:`per_sample_gradient_diagnostics` for what differs."""
    return per_sample_gradient_diagnostics(
        x, module, batch_first=batch_first, atol=atol, rtol=rtol, grad_sample_mode=grad_sample_mode
    ).ok


def per_sample_gradient_diagnostics(
    x: Inputs,
    module: nn.Module,
    *,
    batch_first: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    grad_sample_mode: str = "fx",
) -> PerSampleGradientDiagnostics:
    """One :class:`ParameterCheck` per trainable parameter and loss reduction (see the module doc)."""
    check_grad_sample_mode(grad_sample_mode)
    if grad_sample_mode == "no_op":
        raise ValueError(
            "fxdp: grad_sample_mode='no_op' computes no per-sample gradients (you set p.grad_sample "
            "yourself), so there is nothing to check; pass the mode that computes them."
        )
    inputs = _as_input_tuple(x)
    batch_dim = 0 if batch_first else 1
    n = _batch_size(inputs, batch_dim)
    names = [name for name, p in _model_of(module).named_parameters() if p.requires_grad]
    if not names:
        raise ValueError(
            f"fxdp: {type(module).__name__} has no trainable parameters (none with requires_grad=True), "
            "so it has no per-sample gradients to check."
        )
    compiled = _is_compiled(module)

    projections = None
    expected: Dict[str, torch.Tensor] = {}
    reference = _fresh_copy(module)
    for i in range(n):
        one = tuple(t.narrow(batch_dim, i, 1) for t in inputs)
        out = reference(*one)
        if projections is None:
            projections = _projections(out, batch_dim)
        _projected_loss(out, projections, batch_dim, "sum").backward()
        for name, p in _model_of(reference).named_parameters():
            if name not in names:
                continue
            if name not in expected:
                expected[name] = torch.zeros((n, *p.shape), dtype=p.dtype, device=p.device)
            if p.grad is not None:  # None: the sample does not reach this parameter
                expected[name][i] = p.grad.detach()
        reference.zero_grad(set_to_none=True)

    records = PerSampleGradientDiagnostics()
    with preserved_state(reference):
        records.cross_sample_dependence, records.cross_sample_untested = cross_sample_dependence(
            reference, inputs, {}, batch_dim)
    for reduction in ([_loss_reduction_of(module)] if compiled else LOSS_REDUCTIONS):
        if compiled:
            wrapped = _fresh_copy(module)
            model_copy = _model_of(wrapped)
        else:
            model_copy = _fresh_copy(module)
            wrapped = _wrap(model_copy, grad_sample_mode, inputs, batch_dim, reduction)
        _without_self_check(wrapped)
        try:
            out = wrapped(*inputs)
            _projected_loss(out, projections, batch_dim, reduction).backward()
        except SelfCheckError as exc:  # correct-or-error: the engine said so before handing out gradients
            records.engine_error, records.engine_findings = str(exc), exc.findings
            return records
        grad_samples, grads = _read_gradients(model_copy, wrapped)
        for name in names:
            record = _compare(name, reduction, grad_samples.get(name), expected[name], atol, rtol)
            if record.grad_sample_shape is not None and not record.shape_mismatch and grads.get(name) is not None:
                _compare_sum(record, grad_samples[name], grads[name], expected[name], atol, rtol)
            records.append(record)
    return records


def _without_self_check(wrapped: nn.Module) -> None:
    """The hooks engine tests the model on its first batch and refuses what it finds; here the check
    below does the same comparison on every sample and reports it, so that test is not run twice."""
    if getattr(wrapped, "verification", None) == "not yet run":
        wrapped.verify = False
        wrapped.verification = "off (fxdp.check_per_sample_gradients_are_correct compares every sample)"


def _is_compiled(module: nn.Module) -> bool:
    """A model compile_for_dp or wrap_model returned (it is checked as it is)."""
    return isinstance(module, (GradSampleModuleBase, PerSampleModel)) or hasattr(module, "fxdp_report")


def _model_of(module: nn.Module) -> nn.Module:
    """The module whose parameters carry the names the user knows: a wrapper's model, else the module."""
    if isinstance(module, GradSampleModuleBase):
        return module.module
    if isinstance(module, PerSampleModel):
        return module.module
    return module


def _loss_reduction_of(compiled: nn.Module) -> str:
    """The loss reduction a compiled model was made for (its wrapper's, or its DP-aware ops')."""
    for value in [compiled, *vars(compiled).values()]:
        reduction = getattr(value, "loss_reduction", None) if not isinstance(value, dict) else None
        if isinstance(reduction, str) and reduction in LOSS_REDUCTIONS:
            return reduction
    return "mean"


def _wrap(model: nn.Module, mode: str, inputs, batch_dim: int, reduction: str) -> nn.Module:
    """The engine compile_for_dp returns for this mode (its fallbacks included)."""
    example = inputs[0] if len(inputs) == 1 else inputs
    return compile_for_dp(model, example_inputs=example if mode == "fx" else None, batch_dim=batch_dim,
                          loss_reduction=reduction, grad_sample_mode=mode)


def _as_input_tuple(x: Inputs) -> Tuple[torch.Tensor, ...]:
    inputs = (x,) if isinstance(x, torch.Tensor) else tuple(x)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("fxdp: x must be a tensor or a tuple of tensors (the model's positional inputs)")
    return inputs


def _batch_size(inputs: Tuple[torch.Tensor, ...], batch_dim: int) -> int:
    sizes = set()
    for k, t in enumerate(inputs):
        if t.dim() <= batch_dim:
            raise ValueError(
                f"fxdp: input {k} has shape {tuple(t.shape)} and no batch dimension {batch_dim}"
            )
        sizes.add(t.shape[batch_dim])
    if len(sizes) > 1:
        raise ValueError(f"fxdp: the inputs disagree on the batch size (dimension {batch_dim}): {sorted(sizes)}")
    n = sizes.pop()
    if n == 0:
        raise ValueError(
            f"fxdp: the batch is empty (size 0 in dimension {batch_dim}); per-sample gradients need at "
            "least one sample to check."
        )
    return n


def _fresh_copy(module: nn.Module) -> nn.Module:
    model = copy.deepcopy(module)
    zero_grad_sample(model)
    model.zero_grad(set_to_none=True)
    return model


def _output_tensors(out) -> List[torch.Tensor]:
    leaves = pytree.tree_leaves(out)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise TypeError(
            f"fxdp: the model returned {type(out).__name__} with no floating-point tensor; the checker "
            "builds its loss from the model's floating-point outputs."
        )
    return tensors


def _projections(out_of_one, batch_dim: int) -> List[torch.Tensor]:
    """One fixed random tensor per output, shaped like a single sample's output."""
    generator = torch.Generator().manual_seed(0)
    projections = []
    for t in _output_tensors(out_of_one):
        if t.dim() <= batch_dim or t.shape[batch_dim] != 1:
            raise ValueError(
                f"fxdp: for a batch of one sample the model returned shape {tuple(t.shape)}, without a "
                f"batch dimension {batch_dim} of size 1; the checker needs outputs with the batch in the "
                "same dimension as the inputs."
            )
        shape = t.shape[:batch_dim] + t.shape[batch_dim + 1:]
        projections.append(torch.randn(shape, generator=generator, dtype=t.dtype).to(t.device))
    return projections


def _projected_loss(out, projections: List[torch.Tensor], batch_dim: int, reduction: str) -> torch.Tensor:
    tensors = _output_tensors(out)
    if len(tensors) != len(projections):
        raise ValueError(
            f"fxdp: the model returned {len(tensors)} floating-point tensors for the batch but "
            f"{len(projections)} for a single sample"
        )
    per_sample = 0
    for t, r in zip(tensors, projections):
        weighted = t * r.unsqueeze(batch_dim)
        per_sample = per_sample + weighted.movedim(batch_dim, 0).flatten(1).sum(1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def _read_gradients(model: nn.Module, wrapped: nn.Module):
    """({name: grad_sample}, {name: grad}), read from the copy's parameters, or from the wrapper's
    when it holds parameters of its own under the same names."""
    grad_samples: Dict[str, torch.Tensor] = {}
    grads: Dict[str, torch.Tensor] = {}
    sources = [model.named_parameters(), wrapped.named_parameters()]
    for named in sources:
        for name, p in named:
            name = name[len("_module."):] if name.startswith("_module.") else name
            gs = getattr(p, "grad_sample", None)
            if gs is not None and name not in grad_samples:
                grad_samples[name] = gs
            if p.grad is not None and name not in grads:
                grads[name] = p.grad
    return grad_samples, grads


def _compare_sum(record: ParameterCheck, grad_sample: torch.Tensor, grad: torch.Tensor, expected: torch.Tensor,
                 atol: float, rtol: float) -> None:
    n = expected.shape[0]
    scale = 1.0 / n if record.reduction == "mean" else 1.0
    total = grad_sample.detach().to(grad.dtype).sum(0) * scale
    diff = (total - grad).abs()
    # the rows' own tolerance, added up: rows within it can only miss the sum by this much
    bound = (n * atol + rtol * expected.abs().sum(0)) * scale
    record.batch_grad_max_abs_diff = _nan_aware_max(diff)
    record.sums_to_batch_grad = bool((diff <= bound).all())


def _compare(name: str, reduction: str, actual: Optional[torch.Tensor], expected: torch.Tensor,
             atol: float, rtol: float) -> ParameterCheck:
    record = ParameterCheck(
        name=name,
        reduction=reduction,
        grad_sample_shape=None if actual is None else tuple(actual.shape),
        expected_shape=tuple(expected.shape),
    )
    if actual is None or record.shape_mismatch:
        return record
    actual = actual.detach().to(expected.dtype)
    diff = (actual - expected).abs()
    close = diff <= atol + rtol * expected.abs()  # torch.allclose semantics; NaN is never close
    record.mismatched_samples = [i for i, ok in enumerate(close.flatten(1).all(1).tolist()) if not ok]
    record.max_abs_diff = _nan_aware_max(diff)
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / expected.abs())
    record.max_rel_diff = _nan_aware_max(rel)
    return record


def _nan_aware_max(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    if torch.isnan(t).any():
        return math.nan
    return t.max().item()


def _short_list(items: List[int], limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


# -- Opacus's per-sample test helpers (opacus.utils.per_sample_gradients_utils / module_utils) ----------------
#
# The same comparison as above with Opacus's conventions, so that tests written for Opacus run on fxdp: the
# loss is an L1 loss against zeros (over a PackedSequence output: the mean over samples of each one's mean, or
# the sum), the reference runs each sample alone in a batch of one, results are dicts by parameter name.


def clone_module(module: nn.Module) -> nn.Module:
    """An independent copy of ``module``."""
    return copy.deepcopy(module)


def is_batch_empty(batch) -> bool:
    """Whether a batch (a tensor, or a sequence of them whose first one carries the batch) has no entries."""
    return (batch if isinstance(batch, torch.Tensor) else batch[0]).numel() == 0


def are_state_dict_equal(sd1: Dict[str, torch.Tensor], sd2: Dict[str, torch.Tensor]) -> bool:
    """The same keys, and values ``allclose`` key by key."""
    return sd1.keys() == sd2.keys() and all(torch.allclose(sd1[k], sd2[k]) for k in sd1)


def get_grad_sample_modes(use_ew: bool = False) -> List[str]:
    """The engines that run the model as it is, as Opacus's tests sweep them (``"ew"`` with ``use_ew``)."""
    return ["hooks", "functorch"] + (["ew"] if use_ew else [])


def _sequences(packed: PackedSequence) -> List[torch.Tensor]:
    """Each sample's own ``(T_i, ...)`` sequence, in the caller's order."""
    padded, lengths = pad_packed_sequence(packed, batch_first=True)
    return [padded[i, :length] for i, length in enumerate(lengths.tolist())]


def _l1_loss(out, reduction: str) -> torch.Tensor:
    if isinstance(out, PackedSequence):
        if reduction == "sum":
            return out.data.abs().sum()
        rows = _sequences(out)
        return sum(r.abs().mean() for r in rows) / len(rows)
    return nn.functional.l1_loss(out, torch.zeros_like(out), reduction=reduction)


def _trainable(module: nn.Module) -> Dict[str, nn.Parameter]:
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def compute_microbatch_grad_sample(x, module: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                                   chunk_method=iter) -> Dict[str, torch.Tensor]:
    """Each sample's gradient, from the sample run alone (a batch of one), stacked batch first by name."""
    model = clone_module(module)
    if isinstance(x, PackedSequence):
        x = _sequences(x)  # each a (T_i, ...) sequence, run alone as a batch of one
    elif not batch_first and not isinstance(x, list):
        x = x.transpose(0, 1)
    grads: Dict[str, List[torch.Tensor]] = {name: [] for name in _trainable(model)}
    torch.manual_seed(0)
    for sample in chunk_method(x):
        model.zero_grad(set_to_none=True)
        inputs = sample if type(sample) is tuple else (sample.unsqueeze(0 if batch_first else 1),)
        _l1_loss(model(*inputs), loss_reduction).backward()
        for name, p in _trainable(model).items():
            grads[name].append(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
    return {name: torch.stack(g) for name, g in grads.items()}


def compute_engine_grad_sample(x, module: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                               grad_sample_mode: str = "hooks") -> Dict[str, torch.Tensor]:
    """``p.grad_sample`` by name, from the engine ``grad_sample_mode`` on a copy of ``module``."""
    model = clone_module(module)
    wrapped = wrap_model(model, grad_sample_mode, batch_first=batch_first, loss_reduction=loss_reduction)
    torch.manual_seed(0)
    wrapped.zero_grad()
    out = wrapped(*x) if type(x) is tuple else wrapped(x)  # a PackedSequence is a tuple too: one input
    _l1_loss(out, loss_reduction).backward()
    return {name: p.grad_sample for name, p in _trainable(model).items()}


def compute_grad_samples_microbatch_and_engine(x, module: nn.Module, batch_first: bool = True,
                                               loss_reduction: str = "mean", grad_sample_mode: str = "hooks",
                                               chunk_method=iter):
    """(reference, engine): :func:`compute_microbatch_grad_sample` and :func:`compute_engine_grad_sample`.

    Raises:
        RuntimeError: ``x`` has no samples.
        ValueError: the two disagree on which parameters have per-sample gradients.
    """
    if not isinstance(x, PackedSequence) and is_batch_empty(x):
        raise RuntimeError("fxdp: x has no samples; the per-sample reference needs at least one")
    reference = compute_microbatch_grad_sample(x, module, batch_first, loss_reduction, chunk_method)
    engine = compute_engine_grad_sample(x, module, batch_first, loss_reduction, grad_sample_mode)
    if reference.keys() != engine.keys():
        raise ValueError(f"fxdp: the reference and the engine disagree on the parameters: only in the reference "
                         f"{sorted(reference.keys() - engine.keys())}, only in the engine "
                         f"{sorted(engine.keys() - reference.keys())}")
    return reference, engine
