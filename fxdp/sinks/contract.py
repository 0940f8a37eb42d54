"""The gradient sink: the seam between the DP-aware ops, which write to it during backward, and the DP
optimizer, which reads from it after.

Write side. In backward, every DP-aware op (a layer in the compiled graph, a hooked layer, the
whole-model op) hands its model's sink one :class:`LayerCapture`: the layer's saved input ``A`` and
output gradient ``G``, both batch first and for a *summed* loss (the mean's ``1/N`` already undone),
and a function that materialises the layer's per-sample gradients from them. When the backward pass
ends the autograd engine calls the sink's ``_publish(task)``, which the first ``add`` of that pass queued
(:func:`pending_of_this_backward`).
A sink that forms the parameters' gradients itself (book-keeping) says so (``skips_param_grads``) and
tells the DP-aware ops, through :meth:`GradientSink.functional_forward`, how to run a layer so that
backward computes its input gradient only: the runtime reaches every sink through this module alone.

Read side. After ``loss.backward()`` the optimizer asks for each parameter's per-sample squared norms
and, given one clip factor per sample, each parameter's clipped sum ``sum_i c_i g_i``. It never reads
``p.grad_sample`` itself, so where the answers come from — materialised per-sample gradients
(:class:`GradSampleSink`, the default) or norms and re-weighted products from ``A`` and ``G``
(book-keeping) — is the sink's business. The materialising :class:`GradSampleSink` is defined here, with
the contract: it is the optimizer's default reading (``p.grad_sample``, as any engine writes it), and the
optimizer imports this module alone.

One row per sample. Between two clears (one optimizer step), "sample i" is row i of the batch, in
every sink and engine: the uses of a parameter in several forward calls (two views of a batch) and in
several backward passes through the same forward calls (two losses, ``retain_graph=True``) add up per
sample into ONE row, the gradient of the sample's total loss (what one ``(loss1 + loss2).backward()``
gives). So the forward calls of one step must have one batch size, and a backward pass that reaches
none of the forward calls the step's earlier backward passes reached (forward x1, backward, forward x2,
backward: two batches) does not belong to the step. Such a step is refused: the read side raises a
:class:`PerSampleError` and the optimizer does not step (:class:`StepCalls`). Gradients are accumulated
over batches with the optimizer's skip steps, never by backward passes alone.

Sink state lives on the model that owns the sink, never in a process-global: two models running
backward at the same time (two threads) each fill their own sink. Within one sink, captures are kept
per autograd graph task, so a backward pass that raised leaves nothing behind for the next one.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

# Re-exported: readers of this contract (the DP optimizer, which imports only this module) raise it too.
from fxdp.diagnostics.errors import NonFiniteSampleWarning, PerSampleError, PrivacySettingError, StepRefusedError

# How a training loss reduces over the batch; a sink is always handed G of the summed loss.
LOSS_REDUCTIONS = ("mean", "sum")


def check_loss_reduction(loss_reduction: str) -> None:
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")


@dataclass
class LayerCapture:
    """What one DP-aware op saw in one backward pass.

    ``backprops`` always reads as G of the *summed* loss. A producer may hand the output gradient as it
    came (a mean loss's, carrying ``1/N``) with ``backprops_scale=N``: the first read of ``backprops`` then
    forms the product (once), while a reader that folds the factor into its own arithmetic reads
    ``backprops_unscaled`` and ``backprops_scale`` instead and saves a copy of G per layer."""

    batch_size: int
    grad_samples: Callable[[], Dict[nn.Parameter, torch.Tensor]]  # -> {p: (N, *p.shape)}, summed loss
    module: Optional[nn.Module] = None  # the layer, when a hand-written rule applies to it
    activations: Sequence[torch.Tensor] = ()  # A: the layer's tensor inputs, batch first
    backprops: Optional[torch.Tensor] = None  # G: gradient of the summed loss w.r.t. the output, batch first
    params: Sequence[nn.Parameter] = field(default_factory=tuple)  # the trainable parameters it covers
    call: int = 0  # the model's forward call it belongs to (see StepCalls)
    backprops_scale: float = 1.0  # G of the summed loss = backprops_unscaled * backprops_scale

    @property
    def backprops_unscaled(self) -> Optional[torch.Tensor]:
        return self._backprops


def _summed_loss_backprops(capture: LayerCapture) -> Optional[torch.Tensor]:
    if capture.backprops_scale != 1.0 and capture._backprops is not None:
        capture._backprops, capture.backprops_scale = capture._backprops * capture.backprops_scale, 1.0
    return capture._backprops


def _set_backprops(capture: LayerCapture, value: Optional[torch.Tensor]) -> None:
    capture._backprops = value


# ``backprops`` is a dataclass field (so the constructor takes it) read through this property.
LayerCapture.backprops = property(_summed_loss_backprops, _set_backprops)


class GradientSink(abc.ABC):
    """Where DP-aware ops deliver (A, G, layout-resolved) captures, and where the optimizer reads from."""

    #: False while the model's per-sample computation is switched off (``model.disable_hooks()``): what the
    #: DP-aware ops deliver is dropped and parameters get their ordinary gradient (a DP optimizer refuses it)
    enabled = True

    #: True for a sink that forms the parameters' gradients itself from the captures (book-keeping): the
    #: optimizer writes ``p.grad`` from its clipped sums, so the DP-aware ops may leave them out of backward
    skips_param_grads = False

    # -- write side: called from backward -------------------------------------------------------------

    @abc.abstractmethod
    def add(self, capture: LayerCapture) -> None:
        """Take one layer's capture (called from a backward hook)."""

    def functional_forward(self, module: nn.Module, x: torch.Tensor):
        """For a layer whose parameter gradients this sink forms itself: ``(fn, params)`` with ``fn(x, *params)``
        equal to ``module(x)``, so that the DP-aware op can call the layer with backward computing the input
        gradient alone (fxdp/runtime/bookkeeping_calls.py). ``None``: the layer is called as usual."""
        return None

    # -- read side: called by the optimizer after backward ---------------------------------------------

    @abc.abstractmethod
    def squared_norms(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        """Per-sample squared gradient norms, shape ``(N,)``, of each of ``params`` that received
        per-sample gradients since :meth:`clear`: one row per sample of the batch, the uses of every
        forward call and backward pass since then summed per sample."""

    @abc.abstractmethod
    def clipped_sums(
        self, params: Iterable[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor]
    ) -> Dict[nn.Parameter, torch.Tensor]:
        """``sum_i factors[p][i] * g_i(p)`` for each parameter in ``factors``: the clipped sum."""

    def take_clipped_sums(
        self, params: Sequence[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor], alpha: float = 1.0
    ) -> Dict[nn.Parameter, torch.Tensor]:
        """``alpha`` times each clipped sum, then :meth:`clear` of ``params``: the optimizer's read of a
        physical batch. Each sum returned is the caller's to write to (it adds the noise in place).

        This default forms the sums with :meth:`clipped_sums`; a sink may instead forget each parameter's
        records as soon as its sum is formed, which keeps the step's peak memory down (book-keeping does:
        a layer's input and output gradient are freed once its sums exist, not after all of them)."""
        sums = self.clipped_sums(params, factors)
        self.clear(params)
        return {p: s * alpha for p, s in sums.items()}  # new tensors, whatever clipped_sums hands out

    def grouped_squared_norms(self, params: Iterable[nn.Parameter], groups: torch.Tensor,
                              num_groups: int) -> Dict[nn.Parameter, torch.Tensor]:
        """``||sum_{i: groups[i] == u} g_i(p)||^2`` for every group ``u < num_groups``, shape ``(num_groups,)``, of
        each of ``params`` with records: the squared norm of the summed gradient of a group of samples (user-level
        privacy: a user's records, :mod:`fxdp.optim.user_level`). ``groups``: a long ``(N,)`` tensor, one group
        per sample. Exact, never an approximation: this default forms each group's summed gradient with
        :meth:`clipped_sums` (factor 1 on the group's samples, 0 elsewhere), one call per group; a sink with a
        cheaper exact form overrides it."""
        params, out = list(params), {}
        for u in range(num_groups):
            members = (groups == u)
            factors = {p: members.to(torch.float32) for p in params}
            for p, s in self.clipped_sums(params, factors).items():
                sq = wide(s).reshape(-1).pow(2).sum().reshape(1)
                out[p] = sq if p not in out else torch.cat([out[p], sq.to(out[p].device)])
        return out

    def set_grouped_norms_only(self, on: bool = True) -> bool:
        """Told by an optimizer that clips groups of samples (user-level privacy) before the backward passes of a
        step: from now on it reads :meth:`sample_rows` and :meth:`grouped_squared_norms`, never per-sample norms.
        A sink that takes it (returns True) may then skip forming per-sample norms, and sum a group's per-sample
        gradients once, when its norm is asked, for the group's clipped sum (whose factors must then be equal
        within each group); :meth:`squared_norms` and per-sample gradients of what it recorded so are refused
        (an error, never stale values). This default takes nothing: False, every read stays as it was."""
        return False

    def sample_rows(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, int]:
        """How many per-sample rows each of ``params`` with records has since :meth:`clear` (the ``N`` of its
        :meth:`squared_norms`), without forming the norms where the sink can tell (this default forms them)."""
        return {p: int(sq.shape[0]) for p, sq in self.squared_norms(params).items()}

    def drop_samples(self, params: Iterable[nn.Parameter], dropped: torch.Tensor) -> None:
        """Zero what was recorded for the samples ``dropped`` marks (a bool ``(N,)``), so that their clipped sums
        are 0: the optimizer drops a sample whose per-sample gradient is not finite. A sink that cannot raises
        NotImplementedError, and the optimizer refuses the step instead."""
        raise NotImplementedError

    @abc.abstractmethod
    def clear(self, params: Iterable[nn.Parameter]) -> None:
        """Forget everything recorded for ``params`` (the optimizer calls it after each step)."""

    # -- parameters the model no longer uses ------------------------------------------------------------

    def retire(self, known: Iterable[nn.Parameter], current: Iterable[nn.Parameter], why: str) -> None:
        """The model used ``known`` and uses ``current`` now (``why``: a layer was replaced after it was
        compiled): those of ``known`` it no longer uses are retired. An optimizer still holding a retired
        trainable parameter refuses to step: it would move it by noise alone."""
        retired = self.__dict__.setdefault("_retired", {})
        current = {id(p): p for p in current}
        for p in current.values():
            retired.pop(p, None)
        for p in known:
            if id(p) not in current:
                retired[p] = why

    def retired_reason(self, p: nn.Parameter) -> Optional[str]:
        """Why the model no longer uses ``p`` (see :meth:`retire`), or None."""
        return self.__dict__.get("_retired", {}).get(p)


class StepCalls:
    """The forward calls the backward passes of one step reached, their batch size, and the parameters they
    delivered for: the check that makes "sample i" row i of one batch (see the module docstring).

    A sink asks :meth:`problem` about each backward pass before it merges the pass's records with the step's:
    the pass's calls must have the step's batch size, and a pass after the first must reach a call an earlier
    one reached. A pass that does not belong to the step is kept apart and makes the step *refused*: the sink's
    read side raises :attr:`refusal` (so the DP optimizer refuses to step) until the step ends (:meth:`reset`),
    when the sink is cleared or when none of the step's parameters holds records any more (``p.grad_sample``
    cleared by hand). Backward passes alone (a model used outside training) never raise."""

    def __init__(self):
        self.calls: Dict[int, int] = {}  # forward call -> its batch size
        self.params: Dict[int, nn.Parameter] = {}  # the parameters with records of this step, by id
        self.refusal: Optional[str] = None  # why the optimizer must not step on this step's records

    def reset(self) -> None:
        self.calls, self.params, self.refusal = {}, {}, None

    def problem(self, calls: Dict[int, int]) -> Optional[str]:
        """Why a backward pass that reached ``calls`` (forward call -> batch size) does not belong to this
        step, or None. Changes nothing."""
        sizes = batch_size_problem([*calls.values(), *self.calls.values()])
        if sizes is not None:
            return sizes
        if self.calls and calls and not set(calls) & set(self.calls):
            return (
                "fxdp: a backward pass since the last optimizer step reached none of the forward calls that the "
                "earlier ones reached: it was another batch (forward x1, backward, forward x2, backward), which one "
                "private step would clip as if one batch and account as one step at the rate of one. Call "
                "optimizer.step() after each batch's backward (to cut a logical batch into physical batches that fit "
                "in memory, use BatchMemoryManager, which signals optimizer.signal_skip_step() for all but the last), "
                "or add the losses and call backward once; optimizer.zero_grad() forgets the batches seen so far"
            )
        return None

    def add(self, calls: Dict[int, int], params: Iterable[nn.Parameter], refusal: Optional[str] = None) -> None:
        """Record a backward pass (``refusal``: why it does not belong to the step, if it does not)."""
        self.calls.update(calls)
        self.params.update((id(p), p) for p in params)
        self.refusal = self.refusal or refusal

    def check_readable(self) -> None:
        """Raise the refusal, if the step has one: the optimizer reads nothing of a refused step."""
        if self.refusal is not None:
            raise PerSampleError(self.refusal)


def batch_size_problem(sizes: Iterable[int]) -> Optional[str]:
    """Why forward calls of ``sizes`` cannot be one step's (see :class:`StepCalls`), or None."""
    sizes = sorted(set(sizes))
    if len(sizes) <= 1:
        return None
    return (
        f"fxdp: forward calls with batches of {sizes} samples reached backward in one step. Within one optimizer "
        "step sample i is row i of the batch: the uses of every forward call (two views of a batch) and of every "
        "backward pass (two losses) add up per sample, so they need one batch size. Call optimizer.step() (and "
        "optimizer.zero_grad()) between batches; to cut a logical batch into physical batches, use "
        "BatchMemoryManager (a skip step between them)"
    )


class GradSampleSink(GradientSink):
    """The materialising sink: per-sample gradients become ``p.grad_sample``.

    One row per sample (see the module docstring): the uses of a parameter within one forward call (tied
    weights, a layer called twice), across the forward calls of one backward pass and across the backward
    passes of one step add up per sample. Rows that cannot be one step's (forward calls of other batch
    sizes, a backward pass over another batch) are appended along dimension 0 instead, one row per sample
    seen, and the optimizer refuses to step on them (:class:`StepCalls`). The read side reads
    ``p.grad_sample``, so it also serves engines that write it themselves (PyTorch's ExpandedWeights, which
    hands each backward pass's rows to :meth:`add_rows`).
    """

    def __init__(self):
        self._lock = threading.Lock()
        # graph task -> forward call -> (batch size, sums of that call's uses)
        self._pending: Dict[int, Dict[int, tuple]] = {}
        self._step = StepCalls()

    # A copied or pickled model (copy.deepcopy, torch.save) gets a fresh sink: what is pending belongs
    # to a backward pass of the original, and a lock cannot be copied.
    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def add(self, capture: LayerCapture) -> None:
        if not self.enabled:
            return
        if capture.batch_size == 0:  # an empty batch (Poisson sampling): no rows, and no rule to run
            grad_samples = {p: p.new_zeros((0, *p.shape)) for p in capture.params}
        else:
            grad_samples = capture.grad_samples()
        with self._lock:
            pending = pending_of_this_backward(self)
            n, sums = pending.setdefault(capture.call, (capture.batch_size, {}))
            for p, g in grad_samples.items():
                check_grad_sample(p, g, n, capture.module)
                g = g.detach()
                sums[p] = sums[p] + g if p in sums else g

    def _publish(self, task: int) -> None:
        with self._lock:
            calls = self._pending.pop(task, {})
        sizes = {call: n for call, (n, _) in calls.items()}
        refusal = batch_size_problem(sizes.values())
        params = list(dict.fromkeys(p for _, sums in calls.values() for p in sums))
        rows = {}
        for p in params:
            if refusal is None:  # one batch: per sample, the calls' uses add up
                parts = [sums[p] for _, sums in calls.values() if p in sums]
                rows[p] = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
            else:  # the calls' rows one after the other (zeros where a call did not use p)
                rows[p] = torch.cat([sums[p] if p in sums else p.new_zeros((n, *p.shape))
                                     for _, (n, sums) in sorted(calls.items())])
        self.add_rows(rows, sizes, refusal)

    def add_rows(self, rows: Dict[nn.Parameter, torch.Tensor], calls: Dict[int, int],
                 refusal: Optional[str] = None) -> None:
        """One backward pass's per-sample gradients (``calls``: the forward calls it reached -> their batch
        size): added per sample to the step's rows if the pass belongs to the step, else appended to them
        and the step refused (see :class:`StepCalls`)."""
        if not self.enabled:
            return
        held = [p for p in self._step.params.values() if getattr(p, "grad_sample", None) is not None]
        if all(getattr(p.grad_sample, _STEPPED, False) for p in held):
            # nothing of the step is held any more (or only rows a step consumed): this pass starts a new one
            for p in held:
                p.grad_sample = None
            self._step.reset()
        earlier = {i: p.grad_sample for i, p in self._step.params.items()
                   if getattr(p, "grad_sample", None) is not None}
        refusal = refusal or self._step.problem(calls)
        for p, g in rows.items():
            previous = earlier.get(id(p))
            if refusal is None and previous is not None and previous.shape[0] != g.shape[0]:
                refusal = batch_size_problem([previous.shape[0], g.shape[0]])
        self._step.add(calls, rows, refusal)
        for p, g in rows.items():
            previous = earlier.get(id(p))  # (rows from before the step are replaced)
            if previous is None:
                p.grad_sample = g
            else:
                p.grad_sample = torch.cat([previous, g]) if self._step.refusal else previous + g

    def squared_norms(self, params):
        self._step.check_readable()
        return {
            p: wide(p.grad_sample.reshape(p.grad_sample.shape[0], p.numel())).pow(2).sum(1)
            for p in params
            if getattr(p, "grad_sample", None) is not None
        }

    def clipped_sums(self, params, factors):
        self._step.check_readable()
        out = {}
        for p in params:
            if p in factors and getattr(p, "grad_sample", None) is not None:
                gs = wide(p.grad_sample)
                out[p] = torch.tensordot(factors[p].to(gs.dtype), gs, dims=1)
        return out

    def grouped_squared_norms(self, params, groups, num_groups):
        """The rows of each group added up (``index_add``), then their squared norms."""
        self._step.check_readable()
        out = {}
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if gs is not None:
                rows = wide(gs.reshape(gs.shape[0], p.numel()))
                summed = rows.new_zeros((num_groups, rows.shape[1])).index_add_(0, groups.to(rows.device), rows)
                out[p] = summed.pow(2).sum(1)
        return out

    def sample_rows(self, params):
        self._step.check_readable()
        return {p: int(p.grad_sample.shape[0]) for p in params if getattr(p, "grad_sample", None) is not None}

    def drop_samples(self, params, dropped):
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if gs is not None:
                p.grad_sample = gs.masked_fill(dropped.to(gs.device).view(-1, *[1] * (gs.dim() - 1)), 0)

    def clear(self, params):
        self._step.reset()
        for p in params:
            if hasattr(p, "grad_sample"):
                p.grad_sample = None

    def end_step(self, params: Iterable[nn.Parameter]) -> None:
        """A private step consumed the rows: the next backward pass begins a new step. Until it (or ``clear``,
        which ``zero_grad()`` calls) the rows stay readable as ``p.grad_sample``, where Opacus leaves them, marked
        as consumed, so that the pass replaces them (in whichever sink it delivers to: a DP optimizer built without
        the model's sink has its own) and a stepped batch's rows never reach another step."""
        self._step.reset()
        for p in params:
            if getattr(p, "grad_sample", None) is not None:
                setattr(p.grad_sample, _STEPPED, True)


_STEPPED = "_fxdp_stepped"  # on a p.grad_sample a step consumed (GradSampleSink.end_step)


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32. Every sink answers norms and clipped sums in at least float32, whatever the
    per-sample gradients' dtype: a bfloat16 norm or sum is rounded to 8 mantissa bits, and a sum over the
    batch rounded that coarsely can move by more than one sample's bound C (see docs/mixed_precision.md)."""
    return t if t.dtype in (torch.float32, torch.float64) or not t.is_floating_point() else t.float()


CLIP_EPS = 1e-6  # in the clip factor C / (norm + eps): a zero gradient gets factor 1, never a division by 0


def clip_factor(bound, norm: torch.Tensor) -> torch.Tensor:
    """The clip factor ``min(1, bound / (norm + 1e-6))`` of per-sample gradients of norms ``norm`` (the one
    formula: the DP optimizer's and Opacus's fast-gradient-clipping wrapper's)."""
    return (bound / (norm + CLIP_EPS)).clamp(max=1.0)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`wide` gives a floating tensor of ``dtype``: at least float32 (the optimizer forms the private
    gradient, noise included, in it)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def pending_of_this_backward(sink) -> dict:
    """The dict where ``sink`` keeps what the running backward pass delivered (``sink._pending[task]``).
    The first call of a pass queues ``sink._publish(task)`` for when the autograd engine finishes it.
    Call with ``sink._lock`` held."""
    task = torch._C._current_graph_task_id()
    pending = sink._pending.get(task)
    if pending is None:
        pending = sink._pending[task] = {}
        torch.autograd.Variable._execution_engine.queue_callback(lambda: sink._publish(task))
    return pending


def check_grad_sample(param: nn.Parameter, grad_sample: torch.Tensor, batch_size: Optional[int],
                      module: Optional[nn.Module] = None) -> None:
    """A per-sample gradient must have one row per sample and the parameter's shape after it.
    ``module``, the layer whose rule produced it when known, is named in the error."""
    of = f" of {type(module).__name__}" if module is not None else ""
    if batch_size is not None and grad_sample.shape[0] != batch_size:
        raise PerSampleError(
            f"fxdp: per-sample gradients with {grad_sample.shape[0]} rows for a batch of {batch_size} samples "
            f"(parameter{of} of shape {tuple(param.shape)}); where the batch sits was recorded wrongly. Pass "
            "example_inputs with more than one sample to compile_for_dp"
        )
    if grad_sample.shape[1:] != param.shape:
        fix = f" Check the per-sample rule for {type(module).__name__}." if module is not None else ""
        raise PerSampleError(
            f"fxdp: a per-sample rule returned shape {tuple(grad_sample.shape)} for a parameter{of} of "
            f"shape {tuple(param.shape)}; expected (N, *{tuple(param.shape)}).{fix}"
        )


SINK_ATTR = "fxdp_sink"


def sink_of(model: nn.Module) -> Optional[GradientSink]:
    """The sink a compiled or wrapped model delivers to (``None`` for a plain model)."""
    sink = getattr(model, SINK_ATTR, None)
    return sink if isinstance(sink, GradientSink) else None


__all__: List[str] = ["LayerCapture", "GradientSink", "GradSampleSink", "StepCalls", "batch_size_problem",
                      "check_grad_sample", "sink_of", "SINK_ATTR", "wide", "wide_dtype", "clip_factor", "PerSampleError",
                      "PrivacySettingError"]
