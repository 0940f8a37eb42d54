"""The checks :class:`~fxdp.optim.dp_optimizer.DPOptimizer` runs before a step moves anything: one row per sample
in every parameter, every trainable parameter still the model's, one logical batch per step, a batch seen,
every gradient per-sample, and per-sample norms that clipping can bound. A sample whose per-sample gradient is
not finite is dropped from the step (its records zeroed by the sink, so it adds nothing, as if clipped to 0)
with a warning; a sink that cannot drop samples makes that a refused step. Each refusal is a
:class:`~fxdp.sinks.contract.StepRefusedError` naming the parameter and saying what to do."""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
from torch import nn

from fxdp.sinks.contract import NonFiniteSampleWarning, StepRefusedError, wide


def stacked_norms(norms: Dict[nn.Parameter, torch.Tensor]) -> Optional[torch.Tensor]:
    """Every parameter's per-sample squared norms as one ``(P, N)`` tensor in at least float32, so that the checks
    and the clip factors are a few kernels for all parameters, not a few per parameter; ``None`` where there are
    none or they differ in rows or device (then each is read alone)."""
    if not norms:
        return None
    first = next(iter(norms.values()))
    if any(sq.shape != first.shape or sq.device != first.device for sq in norms.values()):
        return None
    dtypes = {sq.dtype for sq in norms.values()}
    dtype = torch.float32
    for d in dtypes:
        dtype = torch.promote_types(dtype, d)
    if dtypes == {dtype}:  # (the usual case: stacked as they are, no conversion per parameter)
        return torch.stack(list(norms.values()))
    return torch.stack([sq.to(dtype) for sq in norms.values()])


class StepChecks:
    """Mixed into :class:`~fxdp.optim.dp_optimizer.DPOptimizer` (which supplies the sink, the settings, the step's
    state ``step_state``, a :class:`~fxdp.optim.step_state.StepState`, and ``_name``)."""

    def _check_rows(self, norms: Dict[nn.Parameter, torch.Tensor]) -> int:
        """Every parameter must have one row per sample seen since the last step."""
        first = next(iter(norms.values()), None)
        if first is None or all(sq.shape[0] == first.shape[0] for sq in norms.values()):
            return 0 if first is None else first.shape[0]  # (the usual case: no dict of rows formed)
        return self._check_row_counts({p: sq.shape[0] for p, sq in norms.items()})

    def _check_row_counts(self, rows: Dict[nn.Parameter, int]) -> int:
        """:meth:`_check_rows` of the parameters' numbers of rows (``sink.sample_rows``)."""
        if len(set(rows.values())) > 1:
            (p1, n1), *others = rows.items()
            p2, n2 = next((p, n) for p, n in others if n != n1)
            raise StepRefusedError(
                f"fxdp: parameter '{self._name(p1)}' has per-sample gradients for {n1} samples but "
                f"'{self._name(p2)}' for {n2}: one of them received none in some backward pass since the last "
                "step, so samples cannot be matched up for clipping. Call optimizer.step() after each "
                "backward pass (optimizer.signal_skip_step() before it to accumulate a logical batch)"
            )
        return next(iter(rows.values()), 0)

    def _check_params_are_the_models(self, params: List[nn.Parameter]) -> None:
        """Before anything moves: every trainable parameter is still one the model uses, and has its bound
        under per_layer clipping (a parameter frozen when the optimizer was built and unfrozen since has none)."""
        for p in params:
            why = self.sink.retired_reason(p)
            if why is not None:
                raise StepRefusedError(
                    f"fxdp: parameter '{self._name(p)}' is in the optimizer, but the model no longer uses it ({why}), "
                    "so DP-SGD would move it by noise alone. Call make_private again with the changed model and an "
                    "optimizer over its parameters (the PrivacyEngine's accountant keeps the privacy spent so far), "
                    "or freeze the old parameter (requires_grad_(False)) and add the new ones with "
                    "optimizer.add_param_group")
            if self.clipping == "per_layer":
                self._bound(p)

    def _check_one_logical_batch(self) -> None:
        """A private step (with the skip steps before it) takes one logical batch: the accountant records one
        step at the sampling rate. Two Poisson batches in one step would be clipped as if one batch and
        accounted at the rate of one; none (once a loader tells its batches) means the batch came from
        elsewhere, and would be accounted as a Poisson sample it is not."""
        if self.step_state.logical_batches == 0:
            raise StepRefusedError(
                "fxdp: optimizer.step() without a batch from the data loader make_private returned since the last "
                "step: this step's batch came from elsewhere (the loader you passed to make_private, or a batch "
                "already used for a step), but the accountant would record it as a fresh Poisson sample of the "
                "dataset. Iterate the loader make_private returned (model, optimizer, loader = "
                "engine.make_private(...)), one step per batch"
            )
        batches = self.step_state.logical_batches
        if batches is not None and batches > 1:
            raise StepRefusedError(
                f"fxdp: the data loader handed out {batches} batches since the last optimizer step, "
                "but one private step takes one batch (the accountant records one step at the sampling rate). "
                "Call optimizer.step() once per batch, an empty one too (it adds noise only); to cut a batch that "
                "does not fit in memory into physical batches, use BatchMemoryManager, which signals the skip steps"
            )

    def _check_a_batch_was_seen(self, params: List[nn.Parameter]) -> None:
        """No per-sample gradient since the last step: the step would add noise only, and be counted. That
        is right for an empty batch, and a useless (silently counted) step otherwise."""
        plain = next((p for p in params if p.grad is not None and bool(p.grad.ne(0).any())), None)
        if plain is not None and not self.sink.enabled:
            raise StepRefusedError(
                f"fxdp: parameter '{self._name(plain)}' received a gradient in backward but no per-sample gradient: "
                "the model's per-sample computation is switched off (model.disable_hooks()). Call "
                "model.enable_hooks() before the forward and backward of a private step; this step would have "
                "discarded the gradient and added noise only"
            )
        if plain is not None:
            raise StepRefusedError(
                f"fxdp: parameter '{self._name(plain)}' received a gradient in backward but no parameter received "
                "a per-sample gradient: the backward pass ran through a model fxdp did not compile or wrap, most "
                "likely the original model instead of the one make_private (or fxdp.compile_for_dp) returned. Call "
                "the returned model: it shares the original's parameters and records the per-sample gradients "
                "DP-SGD clips; this step would have discarded the gradient and added noise only"
            )
        if not self.step_state.batch_empty and params:
            raise StepRefusedError(
                "fxdp: optimizer.step() found no per-sample gradient since the last step: no backward pass ran "
                "through the private model (loss.backward() missing, or called after step()?). The step would add "
                "noise only and still be counted by the accountant. Run the model and loss.backward() on the batch "
                "before step(). An empty batch (Poisson sampling) steps with noise only, as it should: run the model "
                "on it as on any batch, or take the batches from the data loader make_private returned, which "
                "tells the optimizer when a batch is empty"
            )

    def _check_not_negative(self, norms: Dict[nn.Parameter, torch.Tensor],
                            stacked: Optional[torch.Tensor] = None) -> None:
        if stacked is not None:  # (P, N): one check for all
            negative = stacked.numel() > 0 and bool(stacked.amin() < 0)
        else:
            negative = any(sq.numel() for sq in norms.values()) and bool(
                torch.stack([sq.amin() for sq in norms.values() if sq.numel()]).lt(0).any())
        if negative:
            p = next(p for p, sq in norms.items() if bool(sq.lt(0).any()))
            raise StepRefusedError(f"fxdp: the gradient sink gave parameter '{self._name(p)}' a negative squared "
                                 "per-sample norm; its clip factor would be NaN. This is a bug in the sink: please "
                                 "report it")

    def _real_rows_of(self, rows: int) -> int:
        """How many of the ``rows`` per-sample rows are samples: all of them, unless the loader handed out a padded
        batch (:meth:`observe_batch`'s ``real_rows`` of ``padded_to``, the padding rows last). The model must then
        have run on the padded batch (``padded_to`` rows) or on its real rows alone; anything else is refused, as
        rows that cannot be matched to samples."""
        if self.step_state.padding is None:
            return rows
        real, padded_to = self.step_state.padding
        if self._overrides:
            raise StepRefusedError(
                f"fxdp: {type(self).__name__} overrides {', '.join(self._overrides)}, which read the per-sample "
                "gradients themselves and would count a padded batch's padding rows as samples. Build the data "
                "loader without padded_batches, or use the DPOptimizer without overrides")
        if rows == padded_to or rows == real:
            return min(rows, real)
        raise StepRefusedError(
            f"fxdp: the data loader handed out a batch padded to {padded_to} rows, of which the first {real} are "
            f"samples, but the per-sample gradients since the last step have {rows} rows: they cannot be matched to "
            "the batch's samples, and its padding rows cannot be dropped. Run the model on the batch as the loader "
            "hands it out (or on its first loader.real_rows rows), once per step")

    def _drop_padding(self, norms: Dict[nn.Parameter, torch.Tensor], real: int,
                      rows: int) -> Dict[nn.Parameter, torch.Tensor]:
        """A padded batch's padding rows (its last ``rows - real``) dropped: the sink zeroes their records by
        selection (a padding row's gradient may be inf or NaN: 0 times it would be NaN), so their clipped sums are
        exactly 0. Returns the real rows' norms, which the checks and the clip factors (and AdaClip's count)
        read. A sink that cannot drop samples cannot take padded batches: a refused step."""
        device = next(iter(norms.values())).device
        padding = torch.arange(rows, device=device) >= real
        try:
            self.sink.drop_samples(list(norms), padding)
        except NotImplementedError:
            raise StepRefusedError(
                f"fxdp: the data loader pads its batches (padded_batches), but this model's gradient sink "
                f"({type(self.sink).__name__}) cannot drop the padding rows. Build the loader without "
                "padded_batches") from None
        return {p: sq[:real] for p, sq in norms.items()}

    def _drop_non_finite(self, norms: Dict[nn.Parameter, torch.Tensor], rows: int, recorded: Optional[int] = None,
                         stacked: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The samples whose per-sample gradient is not finite (inf or NaN, or too large to square), as a bool
        ``(N,)``, or None when there are none. They are dropped: the sink zeroes their records, so each
        contributes nothing, as if clipped to 0. That keeps the step private (every sample still adds at most C;
        an inf or NaN in the sum would show, through the noise, which coordinates that sample reached), and the
        step goes on, with a warning naming the parameter and the sample. A sink that cannot drop samples makes
        it a refused step. ``recorded``: the rows the sink holds, when more than the ``rows`` of ``norms`` (a
        padded batch's padding rows follow them, dropped already); ``stacked``: the norms as :func:`stacked_norms`
        gives them."""
        if not norms or (bool(torch.isfinite(stacked).all()) if stacked is not None else
                         bool(torch.isfinite(torch.stack([wide(sq).sum() for sq in norms.values()])).all())):
            return None  # one check for the common case
        device = next(iter(norms.values())).device
        dropped = torch.zeros(rows, dtype=torch.bool, device=device)
        for sq in norms.values():
            dropped |= ~torch.isfinite(sq.to(device))
        if not bool(dropped.any()):
            return None  # (finite per sample, only their sum overflowed: clipping bounds each)
        p, sq = next((p, sq) for p, sq in norms.items() if not bool(torch.isfinite(sq).all()))
        where = (f"the per-sample gradient of parameter '{self._name(p)}' is not finite (inf or nan, or too large "
                 f"to square) for {int(dropped.sum())} of {rows} samples (first: sample "
                 f"{int((~torch.isfinite(sq)).nonzero()[0])})")
        try:
            extra = (recorded or rows) - rows
            self.sink.drop_samples(list(norms), torch.cat([dropped, dropped.new_ones(extra)]) if extra else dropped)
        except NotImplementedError:
            raise StepRefusedError(
                f"fxdp: {where}; clipping cannot bound it and this model's gradient sink cannot leave those "
                "samples out, so the optimizer refuses to step. Look for inf/nan in the inputs and the loss (log "
                "of 0, division by 0), or lower the learning rate if training diverged") from None
        warnings.warn(
            f"fxdp: {where}: those samples contribute nothing to this step (as if clipped to 0; the noise is "
            "added as always). Look for inf/nan in the inputs and the loss (log of 0, division by 0); if every "
            "sample is dropped, training has diverged (lower the learning rate)", NonFiniteSampleWarning,
            stacklevel=4)
        return dropped

    def _check_finite_after_dropping(self, sums) -> None:
        """After samples were dropped, every clipped sum must be finite (a record the sink did not zero would let
        an inf or NaN through the noise): checked only then, so a normal step pays nothing."""
        if self._unfinished_after_dropping(sums):
            raise StepRefusedError(
                "fxdp: a clipped sum is not finite after the samples with a non-finite per-sample gradient were "
                "dropped, so the optimizer refuses to step. Look for inf/nan in the inputs and the loss; this is "
                "also a bug in the gradient sink: please report it")

    def _unfinished_after_dropping(self, sums) -> bool:
        """Whether samples were dropped from this physical batch and a clipped sum of ``sums`` is still not finite
        (what :meth:`_check_finite_after_dropping` refuses)."""
        return self.step_state.dropped_samples and not all(bool(torch.isfinite(s).all()) for s in sums)

    def _check_every_gradient_is_per_sample(self, params, norms, rows: int) -> None:
        """A parameter that got a gradient in backward but no per-sample gradient would silently lose
        its update: the engine did not see how the parameter was used."""
        if rows == 0:
            return  # an empty batch (or no backward): nothing to compare with
        for p in params:
            if p not in norms and p.grad is not None and bool(p.grad.ne(0).any()):
                raise StepRefusedError(
                    f"fxdp: parameter '{self._name(p)}' received a gradient in backward but no per-sample "
                    "gradient, so DP-SGD cannot clip it. Is it used outside the model that was compiled or "
                    "wrapped (fxdp.compile_for_dp / make_private), or is the optimizer's parameter list from "
                    "another model? Check fxdp.report(model) for ops fxdp does not cover"
                )
