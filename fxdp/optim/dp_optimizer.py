"""``DPOptimizer``: the DP-SGD step (clip each sample, add up, add noise once) around any torch optimizer.

One optimizer step of DP-SGD, as this class runs it::

    for each physical batch (one step() call):
        n_i  = per-sample gradient norms                      sink.squared_norms(params)
        c_i  = min(1, C / (n_i + 1e-6))                       clip factors, one per sample
        S   += sum_i c_i g_i                                  sink.clipped_sums(params, factors)
    once per logical batch (a step() without signal_skip_step):
        p.grad = (S + N(0, sigma^2 C^2)) / expected_batch_size    ("mean"; no division for "sum")
        inner_optimizer.step()

(The sums are read with ``sink.take_clipped_sums``, which frees each layer's records as its sums form;
the noise is added into the sums' own buffers, see ``_write_private_grads``.)

The per-sample gradients come from the model's gradient sink (:mod:`fxdp.sinks.contract`): the
optimizer never reads ``p.grad_sample`` itself, so a sink that computes norms and clipped sums without
materialising per-sample gradients (book-keeping) serves it unchanged. Without a sink, a fresh
:class:`~fxdp.sinks.contract.GradSampleSink` reads ``p.grad_sample`` as any engine writes it.

Clipping:

- ``"flat"``: one bound ``C`` on each sample's gradient over all trainable parameters together.
  Noise std: ``sigma * C``.
- ``"per_layer"``: a list with one bound ``C_k`` per trainable parameter (in the optimizer's order);
  each parameter's per-sample gradient is clipped to its own bound. A sample's whole clipped gradient
  then has norm at most ``sqrt(sum_k C_k^2)``, so that is the sensitivity, and every parameter gets
  noise of std ``sigma * sqrt(sum_k C_k^2)``: the same privacy as flat clipping with that bound.

One step is one private step, or an error before anything moves (parameters, optimizer state, the
accountant's steps): the settings are checked by their setters and again at every step; the sink refuses
records of more than one batch (:mod:`fxdp.sinks.contract`); the data loader, when it reports to
:meth:`DPOptimizer.observe_batch`, says how many logical batches a step covers (exactly one: none means the
batch came from elsewhere) and whether its batch was empty; a step with no per-sample gradient is refused unless that batch was empty (noise only, as Poisson
sampling requires) — a gradient without per-sample gradients means the original model was run.

Conventions: a frozen parameter (``requires_grad=False``) is ignored; a trainable parameter unused in
a step contributes a zero clipped sum and still gets noise (noise must not depend on the data); a tied
parameter is one object whose per-sample gradients arrive summed over its uses (the sink's convention); a
sample whose per-sample gradient is not finite is dropped from the step, as if clipped to 0, with a warning
(``_drop_non_finite``).
"""

from __future__ import annotations

import collections
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn
from torch.optim import Optimizer

from fxdp.optim.correlated.mechanism import (NoiseMechanism, mechanism_state, noise_mechanism_from,
                                             restore_mechanism_state)
from fxdp.optim.correlated.processes import check_noise_path
from fxdp.optim.extension_points import OpacusExtensionPoints
from fxdp.optim.step_checks import StepChecks, stacked_norms
from fxdp.optim.step_state import MOVED, MovedToStepState, StepState
from fxdp.optim.noise import add_gaussian_noise_all_
from fxdp.optim.noise_rows import add_noise_rows_
from fxdp.sinks.contract import (LOSS_REDUCTIONS, GradientSink, GradSampleSink, PrivacySettingError, StepRefusedError,
                                 clip_factor, wide, wide_dtype)

CLIPPING_MODES = ("flat", "per_layer")
# Opacus's DPOptimizer extension points. The default step forms the clipped, noised gradient in one pass
# (_write_private_grads); a subclass overriding one of them steps through them instead (_step_through_overrides).
_OPACUS_EXTENSION_POINTS = ("pre_step", "clip_and_accumulate", "add_noise", "scale_grad")
_NEEDS_EXPECTED_BATCH_SIZE = (
    "fxdp: loss_reduction='mean' needs expected_batch_size (the expected number of samples per logical batch: "
    "sample_rate * len(dataset) under Poisson sampling); the gradient is divided by it, not by the actual batch size")
# what a subclass overrides to form or add the noise its own way (a noise mechanism needs the default path)
_NOISE_PATH = ("_write_private_grads", "_scaled_sums", "_add_noise", "_set_grads", "_adds_noise", "_reduce",
               "_before_update", "_noise_rows")
_SECURE_WITH_GENERATOR = ("fxdp: secure_mode draws noise from the OS's cryptographic source; a seeded generator "
                          "would make the noise predictable. Pass generator=None")


class DPOptimizer(StepChecks, OpacusExtensionPoints, Optimizer):
    """Wraps ``optimizer`` (any ``torch.optim.Optimizer``) so that its step is a DP-SGD step.

    Args:
        optimizer: the optimizer to wrap; it keeps its own state (momentum, Adam moments) and runs on
            the private gradient this class writes into ``p.grad``.
        noise_multiplier: sigma; the noise std is ``sigma`` times the sensitivity (``max_grad_norm``
            for flat clipping, ``sqrt(sum C_k^2)`` for per-layer clipping). 0 turns noise off.
        max_grad_norm: ``C``, a float; for ``clipping="per_layer"`` a list with one bound per trainable
            parameter of ``optimizer``, in ``param_groups`` order.
        expected_batch_size: the expected number of samples in a logical batch (for Poisson sampling,
            ``sample_rate * len(dataset)``). Required for ``loss_reduction="mean"``: the gradient is
            divided by it, not by the batch's actual size, which would leak that size.
        loss_reduction: ``"mean"`` or ``"sum"``, as the training loss reduces over the batch.
        clipping: ``"flat"`` or ``"per_layer"``.
        sink: the model's gradient sink (``fxdp.sinks.contract.sink_of(model)``); ``None`` reads
            ``p.grad_sample``.
        secure_mode: draw noise from the OS's cryptographic source, guarded against the floating-point
            attack (see :mod:`fxdp.optim.noise`); no ``generator`` then.
        generator: a ``torch.Generator`` for reproducible noise (its state is saved by ``state_dict``).
        param_names: ``{parameter: name}`` used in error messages (the PrivacyEngine passes the model's
            ``named_parameters``).
        noise_mechanism: ``"gaussian"`` (independent noise at every step, the default) or a
            :class:`fxdp.optim.correlated.NoiseMechanism` that draws each step's noise (correlated across steps:
            ``BandedMatrixFactorization``); its state is part of :meth:`state_dict`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: Union[float, Sequence[float]],
        expected_batch_size: Optional[int],
        loss_reduction: str = "mean",
        clipping: str = "flat",
        sink: Optional[GradientSink] = None,
        secure_mode: bool = False,
        generator: Optional[torch.Generator] = None,
        param_names: Optional[Dict[nn.Parameter, str]] = None,
        noise_mechanism: Union[str, NoiseMechanism, None] = "gaussian",
    ):
        self._overrides = _overridden_extension_points(type(self))
        if isinstance(optimizer, DPOptimizer):
            raise TypeError("fxdp: the optimizer is already a DPOptimizer; wrap the original optimizer once")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"fxdp: DPOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if clipping not in CLIPPING_MODES:
            raise PrivacySettingError(f"fxdp: clipping must be one of {CLIPPING_MODES}, got {clipping!r}")
        # the hook lists torch.optim.Optimizer.__init__ would create (we do not call it: the param
        # groups and state are the wrapped optimizer's)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, collections.OrderedDict())
        self.original_optimizer = optimizer
        self.clipping = clipping
        self.sink: GradientSink = sink if sink is not None else GradSampleSink()
        self.param_names: Dict[nn.Parameter, str] = dict(param_names or {})
        # the settings, each validated by its setter (below) and all of them again before every step
        self.loss_reduction = loss_reduction
        self.secure_mode = secure_mode
        self.generator = generator
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        self.max_grad_norm = max_grad_norm
        self._check_settings()
        self.noise_mechanism: Optional[NoiseMechanism] = noise_mechanism_from(noise_mechanism)  # None: independent
        if self.noise_mechanism is not None:  # (DDP's and FSDP2's overrides keep its noise: fxdp.optim.correlated)
            check_noise_path(type(self), DPOptimizer, self._overrides, _NOISE_PATH, self.noise_mechanism)
        if set(self._overrides) - {"scale_grad"}:
            warnings.warn(
                f"fxdp: {type(self).__name__} overrides {', '.join(self._overrides)}: its step runs them. fxdp's "
                "accountants analyse the default mechanism (each sample clipped to max_grad_norm, Gaussian noise of "
                "std noise_multiplier * max_grad_norm, one step per Poisson batch); if yours differs, the ε they "
                "report is not yours: account for your mechanism yourself", stacklevel=2)
        self._step_hooks: List[Callable[["DPOptimizer"], None]] = []
        self.step_state = StepState()  # what one logical step carries between calls (fxdp.optim.step_state)
        self.steps = 0  # logical steps taken

    # -- settings ------------------------------------------------------------------------------------

    @property
    def max_grad_norm(self) -> Union[float, List[float]]:
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Union[float, Sequence[float]]) -> None:
        params = self._trainable_params()
        if self.clipping == "flat":
            if isinstance(value, (list, tuple)):
                raise PrivacySettingError("fxdp: max_grad_norm is a list of bounds, which needs "
                                          "clipping='per_layer'; flat clipping takes one float")
            self._bounds = None
            self._max_grad_norm = _positive_bound(value, "max_grad_norm")
            return
        if not isinstance(value, (list, tuple)):
            raise PrivacySettingError("fxdp: clipping='per_layer' needs max_grad_norm as a list with one bound per "
                                      f"trainable parameter ({len(params)} here: {self._names_of(params)})")
        if len(value) != len(params):
            raise PrivacySettingError(f"fxdp: clipping='per_layer' got {len(value)} bounds in max_grad_norm for "
                                      f"{len(params)} trainable parameters ({self._names_of(params)}); give one "
                                      "bound per trainable parameter, in the optimizer's order")
        bounds = [_positive_bound(c, f"max_grad_norm[{k}]") for k, c in enumerate(value)]
        self._bounds = dict(zip(params, bounds))
        self._max_grad_norm = bounds

    @property
    def noise_multiplier(self) -> float:
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise PrivacySettingError(f"fxdp: noise_multiplier must be a finite number >= 0, got {value!r}")
        self._noise_multiplier = float(value)

    @property
    def expected_batch_size(self) -> Optional[int]:
        return self._expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value: Optional[int]) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise PrivacySettingError(f"fxdp: expected_batch_size must be a positive int or None, got {value!r}")
        if value is None and getattr(self, "_loss_reduction", None) == "mean":
            raise PrivacySettingError(_NEEDS_EXPECTED_BATCH_SIZE)
        self._expected_batch_size = value

    @property
    def loss_reduction(self) -> str:
        return self._loss_reduction

    @loss_reduction.setter
    def loss_reduction(self, value: str) -> None:
        if value not in LOSS_REDUCTIONS:
            raise PrivacySettingError(f"fxdp: loss_reduction must be one of {LOSS_REDUCTIONS}, got {value!r}")
        self._loss_reduction = value

    @property
    def secure_mode(self) -> bool:
        return self._secure_mode

    @secure_mode.setter
    def secure_mode(self, value: bool) -> None:
        if value and getattr(self, "_generator", None) is not None:
            raise PrivacySettingError(_SECURE_WITH_GENERATOR)
        self._secure_mode = bool(value)

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self._generator

    @generator.setter
    def generator(self, value: Optional[torch.Generator]) -> None:
        if value is not None and getattr(self, "_secure_mode", False):
            raise PrivacySettingError(_SECURE_WITH_GENERATOR)
        self._generator = value

    @property
    def sensitivity(self) -> float:
        """The bound on one sample's clipped gradient over all parameters: C, or sqrt(sum C_k^2)."""
        if self.clipping == "flat":
            return self._max_grad_norm
        return math.sqrt(sum(c * c for c in self._max_grad_norm))

    @property
    def noise_std(self) -> float:
        """The std of the noise added to each coordinate of the summed clipped gradient."""
        return self.noise_multiplier * self.sensitivity

    def _check_settings(self) -> None:
        """Every setting again, as its setter checks it: an attribute of the optimizer's can be changed behind
        a setter (a per-layer list of bounds edited in place, ``clipping`` reassigned), and a step must not run
        on settings that no setter accepted."""
        if self.clipping not in CLIPPING_MODES:
            raise PrivacySettingError(f"fxdp: clipping must be one of {CLIPPING_MODES}, got {self.clipping!r}")
        self.loss_reduction = self._loss_reduction
        self.noise_multiplier = self._noise_multiplier
        self.expected_batch_size = self._expected_batch_size
        self.generator = self._generator
        value, bounds = self._max_grad_norm, self._bounds
        if self.clipping == "flat" or bounds is None or not isinstance(value, list) or len(value) != len(bounds):
            self.max_grad_norm = value  # (a clipping mode changed by assignment: its bounds checked afresh)
        else:  # the list may have been edited in place: its bounds checked, for the parameters they were given to
            self._bounds = dict(zip(bounds, [_positive_bound(c, f"max_grad_norm[{k}]") for k, c in enumerate(value)]))

    # -- what torch.optim.Optimizer users reach for -------------------------------------------------

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self):
        return self.original_optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value) -> None:
        self.original_optimizer.defaults = value

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if self.clipping == "per_layer":
            raise ValueError("fxdp: cannot add parameters to a per_layer DPOptimizer: each parameter needs "
                             "its bound; build a new DPOptimizer with the full list of bounds")
        self.original_optimizer.add_param_group(param_group)

    def attach_step_hook(self, fn: Callable[["DPOptimizer"], None]) -> None:
        """Call ``fn(optimizer)`` after every logical step (the PrivacyEngine's accountant uses it)."""
        self._step_hooks.append(fn)

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """The next :meth:`step` only clips and accumulates its physical batch (no noise, no update)."""
        self.step_state.skip_next = do_skip

    def __repr__(self) -> str:
        return (f"DPOptimizer(noise_multiplier={self.noise_multiplier}, max_grad_norm={self.max_grad_norm}, "
                f"clipping={self.clipping!r}, loss_reduction={self.loss_reduction!r}, "
                f"expected_batch_size={self.expected_batch_size}, secure_mode={self.secure_mode},\n"
                f"  {self.original_optimizer!r})")

    # -- the step ------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the per-sample gradients and ``p.grad``. The clipped sum of a logical batch in progress
        (after a skipped step) is kept, with ``p.summed_grad``: it belongs to the next real step."""
        self.sink.clear(self._all_params())
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        # (an override accumulates in p.summed_grad; skipped steps' sums are the next step's)
        for p in [] if self._overrides or self.step_state.summed else self._all_params():
            if getattr(p, "summed_grad", None) is not None:
                p.summed_grad = None
        self.step_state.needs_zero_grad = False
        if self.step_state.logical_batches and not self._accumulating():
            # what earlier batches left is gone: only the batch handed out last can still reach the step
            self.step_state.logical_batches = 1

    def expect_observed_batches(self) -> None:
        """From now on every step needs a batch told by :meth:`observe_batch` since the last step
        (``make_private`` calls it when it wires its loader): a step on a batch from anywhere else — the
        loader given to ``make_private`` instead of the one it returned, or one batch used for two steps —
        would be accounted as a fresh Poisson batch that it is not."""
        if self.step_state.logical_batches is None:
            self.step_state.logical_batches = 0

    def observe_batch(self, *, empty: bool, new_epoch: bool = False, real_rows: Optional[int] = None,
                      padded_to: Optional[int] = None) -> None:
        """Told by the data loader as it hands out each logical batch (``make_private`` wires its Poisson
        loader, and a :class:`~fxdp.data.BatchMemoryManager` over it, to this method): whether the batch is
        empty, and whether it is the first of a pass over the loader. A step then refuses to run on more
        than one logical batch, and lets a step with no per-sample gradient through only when the batch was
        empty (noise only, as Poisson sampling requires).

        A padded batch (``DPDataLoader(padded_batches=...)``) also says that its first ``real_rows`` rows of
        ``padded_to`` are samples and the rest padding: the step drops the padding rows before clipping
        (:meth:`~fxdp.optim.step_checks.StepChecks._real_rows_of`)."""
        if self.step_state.logical_batches is None or (new_epoch and not self._accumulating()):
            # a pass left by break is forgotten, unless skip steps accumulated part of its batch for the next step
            self.step_state.logical_batches = 0
        self.step_state.logical_batches += 1
        self.step_state.batch_empty = bool(empty)
        self.step_state.padding = None if padded_to is None else (int(real_rows), int(padded_to))

    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Clip and accumulate this physical batch; unless a skip was signalled, add noise once, scale,
        write ``p.grad`` and run the wrapped optimizer's step. Returns its result (the closure's loss
        when a closure is given; ``None`` for a skipped step).

        Every check runs before anything moves: a refused step leaves the parameters, the optimizer's state
        and the accountant as they were."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_settings()
        if self.step_state.needs_zero_grad:
            raise StepRefusedError(
                "fxdp: DPOptimizer.step() was called again without optimizer.zero_grad() since the last "
                "step. Call optimizer.zero_grad() (the DP optimizer's: model.zero_grad() does not reset it) "
                "once per logical batch, before its backward pass; otherwise gradients of the last step "
                "would be mixed into the next one"
            )
        self._check_one_logical_batch()
        if self.noise_mechanism is not None:  # (a batch out of a correlated mechanism's cycle: refused here)
            self.noise_mechanism.check_step()
        params = self._trainable_params()
        self._check_params_are_the_models(params)
        factors = self._factors(params)
        if self._overrides:
            if not self._step_through_overrides(params, factors):
                return None
        elif self.step_state.skip_next:
            self.step_state.skip_next = False
            self._accumulate(params, factors)
            return None
        else:
            self._write_private_grads(params, factors)
        self._before_update()
        result = self.original_optimizer.step()
        self.step_state.stepped()
        self.steps += 1
        for hook in self._step_hooks:
            hook(self)
        return loss if closure is not None else result

    def _factors(self, params: List[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        """This physical batch's clip factors, one per sample, after checking its per-sample norms
        (empty where no sample was seen)."""
        norms = self.sink.squared_norms(params)  # (a sink refuses the records of more than one batch)
        if not norms:
            self._check_a_batch_was_seen(params)
        rows = self._check_rows(norms)
        real = self._real_rows_of(rows)
        if real < rows:  # a padded batch: its padding rows are dropped, and the checks and clipping see the real ones
            norms = self._drop_padding(norms, real, rows)
        stacked = stacked_norms(norms)
        self.step_state.stacked = (norms, stacked)  # for _clip_factors (an extension point: its signature stays)
        self._check_not_negative(norms, stacked)
        dropped = self._drop_non_finite(norms, real, rows, stacked)
        self._check_every_gradient_is_per_sample(params, norms, rows)
        factors = self._clip_factors(norms) if norms else {}
        self.step_state.stacked = None
        if dropped is not None:  # (their factor C / (inf + eps) would be 0, or NaN: 0 either way)
            factors = {p: c.masked_fill(dropped.to(c.device), 0.0) for p, c in factors.items()}
        if real < rows:  # the padding rows' factors: 0 (their records are zeros already); one tensor stays one
            padded: Dict[int, torch.Tensor] = {}
            factors = {p: padded[id(c)] if id(c) in padded else padded.setdefault(id(c), torch.cat(
                [c, c.new_zeros(rows - real)])) for p, c in factors.items()}
        self.step_state.dropped_samples = dropped is not None
        return factors

    def _accumulate(self, params: List[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor]) -> None:
        """A skipped step: add this physical batch's clipped sums to the logical batch's."""
        sums = self.sink.take_clipped_sums(list(factors), factors) if factors else {}
        self.sink.clear(params)
        self._check_finite_after_dropping(sums.values())
        summed = self.step_state.summed
        for p, s in sums.items():
            summed[p] = summed[p] + s if p in summed else s
        if isinstance(self.sink, GradSampleSink):  # the logical batch's clipped sum so far, as Opacus shows it
            for p, s in summed.items():
                p.summed_grad = s.to(p.dtype, copy=True).view_as(p)
        # the plain (unclipped) gradient of this physical batch is not private: nothing reads it
        for p in params:
            p.grad = None

    def _clip_factors(self, norms: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
        """One factor per sample and parameter (flat clipping: one tensor for all, so a sink can form their sums
        together)."""
        if self.clipping == "per_layer":
            return {p: clip_factor(self._bound(p), wide(sq).sqrt()) for p, sq in norms.items()}
        device = next(iter(norms.values())).device
        kept = self.step_state.stacked  # the (P, N) stack _factors formed of these very norms
        stacked = kept[1] if kept is not None and kept[0] is norms else stacked_norms(norms)
        total = stacked.sum(0) if stacked is not None else sum(wide(sq).to(device) for sq in norms.values())
        factor = clip_factor(self._max_grad_norm, total.sqrt())
        if stacked is not None:  # (all norms on the factor's device: the one tensor for every parameter)
            return dict.fromkeys(norms, factor)
        return {p: factor.to(sq.device) for p, sq in norms.items()}

    def _write_private_grads(self, params: List[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor]) -> None:
        """``p.grad = (S + N(0, std^2)) * scale``, S the clipped sum of the logical batch: this physical
        batch's plus those accumulated by skipped steps. The ONE template of the private gradient: every optimizer
        runs it (one process, DDP, FSDP2, per-layer clipping, AdaClip), each overriding only the part that differs:
        the sums (:meth:`_scaled_sums`; FSDP2 reduce-scatters them into its shards), which rows of the noise
        :meth:`_add_noise` adds (:meth:`_noise_rows`; FSDP2: its shards'), who adds it, the check before the
        reduction and the reduction (:meth:`_adds_noise`, :meth:`_check_before_reduce`, :meth:`_reduce`; DDP: rank
        0, agreed by every rank, an all-reduce), how a gradient is written (:meth:`_set_grads`; FSDP2: a DTensor
        shard).

        Written as ``scale * S + N(0, (std * scale)^2)`` into the sum's own buffer: the sink forms each
        scaled sum and frees that layer's inputs and output gradients as it goes (``take_clipped_sums``),
        then the noise is added in place, in the parameters' order, a chunk at a time, the large parameters'
        blocks drawn in parallel (:func:`~fxdp.optim.noise.add_gaussian_noise_all_`). Under book-keeping no
        second copy of the gradients exists at any point; with per-sample gradients materialised (a
        :class:`GradSampleSink`) they stay readable as ``p.grad_sample``, and the un-noised clipped sum as
        ``p.summed_grad``, until ``zero_grad()``, as on Opacus (the next backward pass replaces the rows, so they
        never reach another step). Scaling before the all-reduce of training across
        processes is the same sum."""
        std = self.noise_std if self._adds_noise() else 0.0
        scale = 1.0 / self.expected_batch_size if self.loss_reduction == "mean" else 1.0
        grads = self._scaled_sums(params, factors, scale)
        self._add_noise(params, grads, std * scale)
        self._check_before_reduce(grads)
        self._set_grads(params, self._reduce(grads))
        self.step_state.summed.clear()

    def _scaled_sums(self, params: List[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor],
                     scale: float) -> List[torch.Tensor]:
        """``scale * S`` for each of ``params``, of its shape, in at least float32 (the noise is added to it):
        S its clipped sum of this physical batch plus what skipped steps accumulated, zeros where none."""
        # With per-sample gradients materialised (they cost N gradients), the un-noised clipped sum is kept as
        # p.summed_grad until zero_grad(), as Opacus leaves it; book-keeping keeps no second copy of the gradients
        keep_summed = isinstance(self.sink, GradSampleSink)
        if keep_summed:  # and p.grad_sample stays readable until zero_grad(), as on Opacus (never reaching a step)
            sums = {p: s * scale for p, s in self.sink.clipped_sums(list(factors), factors).items()} if factors else {}
            self.sink.end_step(params)
        else:
            sums = self.sink.take_clipped_sums(list(factors), factors, alpha=scale) if factors else {}
            self.sink.clear(params)
        grads = []
        for p in params:
            # formed in at least float32 (the sinks' sums are), noise included: a half-precision parameter's
            # gradient is rounded once, after the noise (post-processing; see docs/mixed_precision.md)
            grad = sums.pop(p, None)
            dtype = wide_dtype(p.dtype)
            if grad is None:
                grad = torch.zeros(p.shape, dtype=dtype, device=p.device)
            elif grad.dtype != dtype or grad.shape != p.shape:  # (the usual sum is both already: two calls spared)
                grad = grad.to(dtype).reshape(p.shape)
            earlier = self.step_state.summed.pop(p, None) if self.step_state.summed else None
            if earlier is not None:
                grad.add_(earlier.view_as(grad), alpha=scale)
            if keep_summed:
                p.summed_grad = (grad / scale).to(p.dtype)
            grads.append(grad)
        return grads

    def _add_noise(self, params: List[nn.Parameter], grads: List[torch.Tensor], std: float) -> None:
        """N(0, std^2) added in place to each of ``grads`` (``params``' gradients), in the parameters' order (or as
        the noise mechanism adds it); where ``grads`` are rows of their parameters (:meth:`_noise_rows`), their rows
        of the noise one process adds."""
        starts = self._noise_rows(params)
        if self.noise_mechanism is not None and not self._adds_noise():  # another process adds it (DDP's rank 0)
            self.noise_mechanism.advance_()
        elif starts is not None:  # rows of each parameter (FSDP2's shards): the rows of one process's noise
            add_noise_rows_(params, grads, starts, std, mechanism=self.noise_mechanism, secure_mode=self.secure_mode,
                            generator=self.generator)
        elif self.noise_mechanism is not None:  # correlated noise (fxdp.optim.correlated): its state advances
            self.noise_mechanism.add_noise_(grads, std, secure_mode=self.secure_mode, generator=self.generator)
        elif std > 0:  # in the parameters' order; the large ones' blocks drawn in parallel
            add_gaussian_noise_all_(grads, std, secure_mode=self.secure_mode, generator=self.generator)

    def _noise_rows(self, params: List[nn.Parameter]) -> Optional[List[int]]:
        """Where the gradients :meth:`_add_noise` is handed are rows of dimension 0 of their parameters (a sharded
        optimizer's shards), the row each starts at; ``None``: each is its parameter whole."""
        return None

    def _set_grads(self, params: List[nn.Parameter], grads: List[torch.Tensor]) -> None:
        """``p.grad``, in the parameter's dtype."""
        for p, grad in zip(params, grads):
            p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)

    def _accumulating(self) -> bool:
        """Whether skip steps have accumulated part of a logical batch for the next step."""
        return bool(self.step_state.summed) or (bool(self._overrides)
                                      and any(getattr(p, "summed_grad", None) is not None for p in self.params))

    def _before_update(self) -> None:
        """Called after the private gradient is written and before the wrapped optimizer's step (AdaClip
        updates its bound here)."""

    # hooks for training across processes (fxdp.distributed.DistributedDPOptimizer overrides them)

    def _adds_noise(self) -> bool:
        """Whether this process adds the noise of the logical step (across processes: exactly one)."""
        return True

    def _check_before_reduce(self, noised_sums: List[torch.Tensor]) -> None:
        """The check after dropping samples (:meth:`_check_finite_after_dropping`) of the sums :meth:`_reduce` is
        about to combine; across processes (DDP) every rank must agree on it before any of them reduces."""
        self._check_finite_after_dropping(noised_sums)

    def _reduce(self, noised_sums: List[torch.Tensor]) -> List[torch.Tensor]:
        """This process's noised clipped sums (one per trainable parameter, in order) combined with
        those of the other processes training together. A single process has nothing to combine."""
        return noised_sums

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict and fxdp's own fields (settings, logical steps, the noise
        generator's state, the clipped sum of a logical batch in progress)."""
        params = self._trainable_params()
        return {
            "optimizer": self.original_optimizer.state_dict(),
            "fxdp": {
                "noise_multiplier": self.noise_multiplier,
                "max_grad_norm": self.max_grad_norm,
                "expected_batch_size": self.expected_batch_size,
                "loss_reduction": self.loss_reduction,
                "clipping": self.clipping,
                "steps": self.steps,
                "skip_next": self.step_state.skip_next,
                "generator_state": None if self.generator is None else self.generator.get_state(),
                "accumulated": [self.step_state.summed.get(p) for p in params],
                "noise_mechanism": mechanism_state(self.noise_mechanism),
            },
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (a plain optimizer's state dict goes to the wrapped optimizer): the wrapped
        optimizer's state, the logical steps, the noise generator and a logical batch in progress. The noise
        multiplier, bounds and expected batch size stay this optimizer's, as on Opacus (a warning says which
        differ from the checkpoint's): they are settings, like the ones a scheduler restored from its own state
        sets, and the accountant records every step with the noise multiplier it ran with. A logical batch in
        progress must be finished with the bounds it was clipped to."""
        if set(state_dict) != {"optimizer", "fxdp"}:
            self.original_optimizer.load_state_dict(state_dict)
            return
        own = state_dict["fxdp"]
        for key in ("clipping", "loss_reduction"):
            if own[key] != getattr(self, key):
                raise ValueError(f"fxdp: the checkpoint was saved with {key}={own[key]!r}, this optimizer uses "
                                 f"{getattr(self, key)!r}; build the DPOptimizer with the checkpoint's setting")
        params = self._trainable_params()
        if len(own["accumulated"]) != len(params):
            raise ValueError(f"fxdp: the checkpoint's optimizer had {len(own['accumulated'])} trainable "
                             f"parameters, this one has {len(params)}")
        if any(s is not None for s in own["accumulated"]) and own["max_grad_norm"] != self.max_grad_norm:
            raise ValueError(
                f"fxdp: the checkpoint holds a logical batch in progress (skipped steps' clipped sums) clipped to "
                f"max_grad_norm={own['max_grad_norm']!r}, and this optimizer's bound is {self.max_grad_norm!r}: its "
                "step would add noise for the wrong bound. Build the optimizer with the checkpoint's max_grad_norm, "
                "or save the checkpoint after a real step")
        restore_mechanism_state(self.noise_mechanism, own.get("noise_mechanism"))
        self.original_optimizer.load_state_dict(state_dict["optimizer"])
        changed = [k for k in ("noise_multiplier", "max_grad_norm", "expected_batch_size")
                   if own[k] != getattr(self, k)]
        if changed:
            warnings.warn("fxdp: the checkpoint was saved with " + ", ".join(f"{k}={own[k]!r}" for k in changed)
                          + "; this optimizer keeps its own " + ", ".join(f"{k}={getattr(self, k)!r}" for k in changed)
                          + " (as on Opacus): set them on the optimizer to continue with the checkpoint's",
                          stacklevel=2)
        self._check_settings()
        self.steps = own["steps"]
        self.step_state.skip_next = own["skip_next"]
        if own["generator_state"] is not None:
            if self.generator is None:
                warnings.warn("fxdp: the checkpoint holds a noise generator's state but this optimizer has no "
                              "generator; the noise will not continue the saved sequence", stacklevel=2)
            else:
                self.generator.set_state(own["generator_state"])
        self.step_state.summed = {p: s.to(p.device) for p, s in zip(params, own["accumulated"]) if s is not None}

    # -- helpers -------------------------------------------------------------------------------------

    def _all_params(self) -> List[nn.Parameter]:
        return [p for group in self.original_optimizer.param_groups for p in group["params"]]

    def _trainable_params(self) -> List[nn.Parameter]:
        return [p for p in self._all_params() if p.requires_grad]

    def _bound(self, p: nn.Parameter) -> float:
        if p not in self._bounds:
            raise StepRefusedError(f"fxdp: parameter '{self._name(p)}' has no per_layer bound: it was frozen when "
                                 "the DPOptimizer was built and is trainable now. Freeze it again, or build the "
                                 "DPOptimizer (make_private) again with one bound per trainable parameter")
        return self._bounds[p]

    def _name(self, p: nn.Parameter) -> str:
        if p in self.param_names:
            return self.param_names[p]
        for g, group in enumerate(self.original_optimizer.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{g}]['params'][{i}] of shape {tuple(p.shape)}"
        return f"of shape {tuple(p.shape)}"

    def _names_of(self, params: List[nn.Parameter]) -> str:
        return ", ".join(self._name(p) for p in params)


for _old_name in MOVED:  # the step's state is in step_state: the old private names fail loudly
    setattr(DPOptimizer, _old_name, MovedToStepState(_old_name))


def _overridden_extension_points(cls: type) -> List[str]:
    """The extension points of Opacus's DPOptimizer that ``cls`` (a subclass) overrides."""
    return [name for name in _OPACUS_EXTENSION_POINTS
            if any(name in vars(klass) for klass in cls.__mro__ if issubclass(klass, DPOptimizer)
                   and klass is not DPOptimizer)]


def _positive_bound(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PrivacySettingError(f"fxdp: {what} must be a finite number > 0, got {value!r}")
    return float(value)


class DPPerLayerOptimizer(DPOptimizer):
    """Opacus's name and signature for ``DPOptimizer(..., clipping="per_layer")``: ``max_grad_norm`` is a list
    with one bound per trainable parameter."""

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: Sequence[float],
                 expected_batch_size: Optional[int], loss_reduction: str = "mean", **kwargs: Any):
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction,
                         clipping="per_layer", **kwargs)
