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
from fxdp.diagnostics.errors import EmptyBatchError, SelfCheckError
from fxdp.engines import GradSampleModuleBase, PerSampleModel, check_grad_sample_mode
from fxdp.engines.selfcheck import batch_of_one_gradients, cross_sample_dependence, preserved_state
from fxdp.grad_sample.accumulate import zero_grad_sample
from fxdp.sinks.contract import LOSS_REDUCTIONS

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
    if is_batch_empty(inputs):  # empty in another dimension: all its gradients are zero
        raise EmptyBatchError(f"fxdp: the input has shape {tuple(inputs[0].shape)}, no element; per-sample "
                              "gradients need at least one sample with data to check")
    names = [name for name, p in _model_of(module).named_parameters() if p.requires_grad]
    if not names:
        raise ValueError(
            f"fxdp: {type(module).__name__} has no trainable parameters (none with requires_grad=True), "
            "so it has no per-sample gradients to check."
        )
    compiled = _is_compiled(module)

    reference = _fresh_copy(module)
    samples = (tuple(t.narrow(batch_dim, i, 1) for t in inputs) for i in range(n))
    expected, projections = _batch_of_one_gradients(reference, samples, n, batch_dim, names)

    records = PerSampleGradientDiagnostics()
    with preserved_state(reference):
        records.cross_sample_dependence, untested = cross_sample_dependence(reference, inputs, {}, batch_dim)
        records.cross_sample_untested = None if untested is None else untested.why
    for reduction in ([_loss_reduction_of(module)] if compiled else LOSS_REDUCTIONS):
        if compiled:
            wrapped = _fresh_copy(module)
            model_copy = _model_of(wrapped)
        else:
            model_copy = _fresh_copy(module)
            wrapped = _wrap(model_copy, grad_sample_mode, inputs, batch_dim, reduction)
        _without_self_check(wrapped)
        try:
            grad_samples, grads = _engine_gradients(wrapped, model_copy, inputs, projections, batch_dim, reduction)
        except SelfCheckError as exc:  # correct-or-error: the engine said so before handing out gradients
            records.engine_error, records.engine_findings = str(exc), exc.findings
            return records
        for name in names:
            record = _compare(name, reduction, grad_samples.get(name), expected[name], atol, rtol)
            if record.grad_sample_shape is not None and not record.shape_mismatch and grads.get(name) is not None:
                _compare_sum(record, grad_samples[name], grads[name], expected[name], atol, rtol)
            records.append(record)
    return records


def _batch_of_one_gradients(reference: nn.Module, samples, n: int, batch_dim: int, names: List[str]):
    """The definition: ({name: (n, *p.shape)}, projections), row i the gradient of sample i run alone through
    ``reference`` (each of ``samples`` is the input tuple of one sample, batch of one); the loss is the
    projection of the output by fixed random tensors drawn from the first sample's output."""
    samples = list(samples)
    projections: List[torch.Tensor] = []

    def loss_alone(i: int) -> torch.Tensor:
        reference.zero_grad(set_to_none=True)
        out = reference(*samples[i])
        if not projections:
            projections.extend(_projections(out, batch_dim))
        return _projected_loss(out, projections, batch_dim, "sum")

    named = [(name, p) for name, p in _model_of(reference).named_parameters() if name in names]
    return _zero_filled(batch_of_one_gradients(loss_alone, named, n), named, n), projections or None


def _zero_filled(alone: Dict[str, Optional[torch.Tensor]], named, n: int) -> Dict[str, torch.Tensor]:
    """Batch-of-one gradients with zero rows for a parameter no sample reaches."""
    return {name: torch.zeros((n, *p.shape), dtype=p.dtype, device=p.device) if alone[name] is None
            else alone[name] for name, p in named}


def _engine_gradients(wrapped: nn.Module, model: nn.Module, inputs, projections, batch_dim: int, reduction: str):
    """One forward and backward of the whole batch through an engine: ({name: grad_sample}, {name: grad}).
    ``projections`` None: drawn from the batch's output (the same tensors the samples run alone get)."""
    out = wrapped(*inputs)
    if projections is None:
        projections = _projections(out, batch_dim, of_one=False)
    _projected_loss(out, projections, batch_dim, reduction).backward()
    return _read_gradients(model, wrapped)


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
        raise EmptyBatchError(
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


def _projections(out, batch_dim: int, of_one: bool = True) -> List[torch.Tensor]:
    """One fixed random tensor per output, shaped like a single sample's output (``out`` is the output of
    one sample, or with ``of_one=False`` of a whole batch: the same tensors either way)."""
    generator = torch.Generator().manual_seed(0)
    projections = []
    for t in _output_tensors(out):
        if t.dim() <= batch_dim or (of_one and t.shape[batch_dim] != 1):
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


# -- Opacus's checking utilities (opacus.utils.per_sample_gradients_utils, module_utils), over the same loop --

def get_grad_sample_modes(use_ew: bool = False) -> List[str]:
    """The engines whose per-sample gradients a check should cover: fxdp's default ``"fx"`` (the compiled
    graph), ``"hooks"`` and ``"functorch"``, and ``"ew"`` (ExpandedWeights) with ``use_ew``."""
    return ["fx", "hooks", "functorch"] + (["ew"] if use_ew else [])


def is_batch_empty(batch) -> bool:
    """Whether ``batch`` (a tensor, or a tuple whose first tensor carries the batch) holds no element."""
    first = batch if isinstance(batch, torch.Tensor) else batch[0]
    return first.numel() == 0


def clone_module(module: nn.Module) -> nn.Module:
    """An independent copy of ``module`` (parameters, buffers, and what fxdp compiled into it), by a
    ``torch.save`` / ``torch.load`` round trip in memory."""
    import io

    with io.BytesIO() as buffer:
        torch.save(module, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)


def are_state_dict_equal(sd1: Dict[str, torch.Tensor], sd2: Dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts have the same keys and, key by key, tensors of one shape that are
    ``torch.allclose``."""
    if sd1.keys() != sd2.keys():
        return False
    return all(v1.shape == sd2[k].shape and torch.allclose(v1, sd2[k]) for k, v1 in sd1.items())


# A PackedSequence input (each sample its own length): the reference runs each sequence alone.

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


def _packed_microbatch_grad_sample(x, module: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                                   chunk_method=iter) -> Dict[str, torch.Tensor]:
    """Each sample's gradient, from the sample run alone (a batch of one), stacked batch first by name (Opacus's
    L1 loss: the batch-of-one projections above do not apply to a PackedSequence output)."""
    model = _fresh_copy(module)
    samples = list(chunk_method(_sequences(x)))  # each a (T_i, ...) sequence, run alone as a batch of one

    def loss_alone(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        one = samples[i]
        inputs = one if type(one) is tuple else (one.unsqueeze(0 if batch_first else 1),)
        return _l1_loss(model(*inputs), loss_reduction)

    named = list(_trainable(model).items())
    torch.manual_seed(0)
    return _zero_filled(batch_of_one_gradients(loss_alone, named, len(samples)), named, len(samples))


def compute_engine_grad_sample(x, module: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                               grad_sample_mode: str = "hooks") -> Dict[str, torch.Tensor]:
    """``{parameter name: grad_sample}`` after one forward and backward of ``x`` through a copy of ``module``
    wrapped by the engine ``grad_sample_mode`` (the loss: the output projected on fixed random tensors,
    reduced by ``loss_reduction``). ``x``: a tensor or a tuple of positional inputs; it may be an empty
    batch (the engine must accept it)."""
    check_grad_sample_mode(grad_sample_mode)
    if isinstance(x, PackedSequence):
        return _packed_engine_grad_sample(x, module, batch_first, loss_reduction, grad_sample_mode)
    inputs, batch_dim = _as_input_tuple(x), 0 if batch_first else 1
    model_copy = _fresh_copy(module)
    wrapped = _wrap(model_copy, grad_sample_mode, inputs, batch_dim, loss_reduction)
    grad_samples, _ = _engine_gradients(wrapped, model_copy, inputs, None, batch_dim, loss_reduction)
    return grad_samples


def compute_grad_samples_microbatch_and_engine(x, module: nn.Module, batch_first: bool = True,
                                               loss_reduction: str = "mean", grad_sample_mode: str = "hooks",
                                               chunk_method=iter):
    """``(batch-of-one gradients, engine's grad_sample)``, two ``{parameter name: (N, *p.shape)}`` dicts of
    the same loss, for comparing (what :func:`check_per_sample_gradients_are_correct` compares).

    ``chunk_method(x)`` yields the samples: a tensor without its batch dimension (``iter`` over a tensor,
    the default; with ``batch_first=False`` over ``x`` with dims 0 and 1 swapped), or a tuple of inputs
    already batched as one (for inputs such as an EmbeddingBag's indices and offsets). Raises
    :class:`~fxdp.errors.EmptyBatchError` for an empty batch, ``ValueError`` when the two
    disagree on which parameters have per-sample gradients."""
    if is_batch_empty(x):
        raise EmptyBatchError("fxdp: x is an empty batch; there is no sample to run alone and compare with")
    if isinstance(x, PackedSequence):
        return (_packed_microbatch_grad_sample(x, module, batch_first, loss_reduction, chunk_method),
                _packed_engine_grad_sample(x, module, batch_first, loss_reduction, grad_sample_mode))
    inputs, batch_dim = _as_input_tuple(x), 0 if batch_first else 1
    names = [name for name, p in _model_of(module).named_parameters() if p.requires_grad]
    source = x.transpose(0, 1) if isinstance(x, torch.Tensor) and not batch_first else x
    samples = [one if isinstance(one, tuple) else (one.unsqueeze(batch_dim),) for one in chunk_method(source)]
    expected, projections = _batch_of_one_gradients(_fresh_copy(module), samples, len(samples), batch_dim, names)

    model_copy = _fresh_copy(module)
    wrapped = _wrap(model_copy, grad_sample_mode, inputs, batch_dim, loss_reduction)
    _without_self_check(wrapped)  # the caller compares every sample
    grad_samples, _ = _engine_gradients(wrapped, model_copy, inputs, projections, batch_dim, loss_reduction)
    grad_samples = {name: gs for name, gs in grad_samples.items() if name in set(names)}
    if expected.keys() != grad_samples.keys():
        raise ValueError(
            "fxdp: the batch-of-one gradients and the engine's grad_sample cover different parameters: only "
            f"batch-of-one: {sorted(expected.keys() - grad_samples.keys())}; only the engine: "
            f"{sorted(grad_samples.keys() - expected.keys())}")
    return expected, grad_samples


def _packed_engine_grad_sample(x: PackedSequence, module: nn.Module, batch_first: bool, loss_reduction: str,
                               grad_sample_mode: str) -> Dict[str, torch.Tensor]:
    model = _fresh_copy(module)
    wrapped = wrap_model(model, grad_sample_mode, batch_first=batch_first, loss_reduction=loss_reduction)
    torch.manual_seed(0)
    wrapped.zero_grad()
    out = wrapped(*x) if type(x) is tuple else wrapped(x)  # a PackedSequence is a tuple too: one input
    _l1_loss(out, loss_reduction).backward()
    return {name: p.grad_sample for name, p in _trainable(model).items()}
