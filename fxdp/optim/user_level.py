"""User-level DP-SGD: the unit of privacy is a user (all the records of one person), not a record.

One step, as :class:`UserLevelDPOptimizer` runs it on a batch from a user-level loader
(:class:`fxdp.data.users.UserLevelDataLoader`: each user sampled with probability q, then up to k of their records,
the batch's records grouped by user, the loader telling the optimizer how many records each sampled user has)::

    g_u  = (1 / k_u) sum_{i in u} g_i                       the user's gradient: the AVERAGE of their k_u records'
    n_u  = ||g_u||                                          exact: sink.grouped_squared_norms (no approximation)
    f_u  = min(1, C / (n_u + 1e-6))                         one clip factor per user
    S    = sum_u f_u g_u = sum_i (f_{u(i)} / k_{u(i)}) g_i   the records' weighted sum (sink.clipped_sums)
    p.grad = (S + N(0, sigma^2 C^2)) / expected users per batch   ("mean"; no division for "sum")

So each user adds at most C to the sum, whatever their number of records, and the noise is added once: one user
is one unit of the Poisson-subsampled Gaussian mechanism at rate q, which is what the accountant records. The
average (not the sum) of the records' gradients is used, so that a user's update does not grow with their number
of records before clipping (the sum would clip users with many records harder; both are private).

Refused, never silently example-level: a step whose batch did not come from a user-level loader (no user
segments told), a batch whose records do not match the segments, skip steps (a user's records must be in one
physical batch to be clipped as one), padded batches, and Opacus's extension-point overrides. A user whose summed
gradient is not finite (a record's inf or NaN reaches it) is dropped whole from the step (warning), as the
example-level optimizer drops a sample.

Only per-user norms are read: when the loader tells a batch's users, the optimizer tells its sink
(``set_grouped_norms_only``), which may then form no per-record norm, and sum each user's records once, for the
user's norm and clipped sum alike (book-keeping: :mod:`fxdp.sinks.bookkeeping.users`).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from fxdp.optim.dp_optimizer import DPOptimizer
from fxdp.optim.step_checks import stacked_norms
from fxdp.sinks.contract import (NonFiniteSampleWarning, PrivacySettingError, StepRefusedError, clip_factor,
                                 wide)

PRIVACY_UNITS = ("example", "user")

_NO_USERS = (
    "fxdp: this optimizer trains with user-level privacy (privacy_unit='user'), but the batch of this step came "
    "without its users: it was not handed out by a user-level data loader (fxdp.data.UserLevelDataLoader, which "
    "make_private(privacy_unit='user', user_ids=...) returns), so its records cannot be grouped by user and each "
    "would be clipped as a unit of its own, an example-level step the user-level ε does not cover. Iterate the "
    "loader make_private returned, one step per batch")


class UserLevelDPOptimizer(DPOptimizer):
    """:class:`~fxdp.optim.dp_optimizer.DPOptimizer` whose unit of clipping is a user (see the module docstring).

    ``expected_batch_size`` is the expected number of USERS per batch (``q * number of users``): the ``"mean"``
    normaliser. ``max_grad_norm`` bounds each user's averaged gradient. Everything else is the DPOptimizer's."""

    privacy_unit = "user"

    def __init__(self, optimizer, **kwargs: Any):
        super().__init__(optimizer, **kwargs)
        if self._overrides:
            raise PrivacySettingError(
                f"fxdp: {type(self).__name__} overrides {', '.join(self._overrides)}; user-level clipping forms its "
                "factors per user and needs the DPOptimizer's own step. Remove the overrides")
        self._user_counts: Optional[torch.Tensor] = None  # records per sampled user, in batch order

    def observe_batch(self, *, empty: bool, new_epoch: bool = False, real_rows: Optional[int] = None,
                      padded_to: Optional[int] = None, users: Optional[torch.Tensor] = None) -> None:
        """As :meth:`DPOptimizer.observe_batch`, and ``users``: the number of records of each user of the batch, in
        the batch's order (the records of user 0 first, then user 1's, ...). A batch told without it is refused at
        the step."""
        if padded_to is not None:
            raise StepRefusedError("fxdp: user-level training does not take padded batches yet; build the loader "
                                   "without padded_batches")
        super().observe_batch(empty=empty, new_epoch=new_epoch)
        self._user_counts = None if users is None else torch.as_tensor(users, dtype=torch.long).reshape(-1)
        if users is not None:  # (before the batch's backward: the sink then forms no per-record norm)
            self.sink.set_grouped_norms_only(True)

    def signal_skip_step(self, do_skip: bool = True) -> None:
        if do_skip:
            raise StepRefusedError(
                "fxdp: user-level training clips each user's records as one unit, so all of a user's records must "
                "be in one physical batch: skip steps (BatchMemoryManager, signal_skip_step) would split them. "
                "Lower the sample rate or max_records_per_user until a batch fits in memory")
        super().signal_skip_step(False)

    def step(self, closure=None):
        result = super().step(closure)
        self._user_counts = None  # consumed by the step (a refused step raised before: its batch stays)
        return result

    def _factors(self, params: List[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        """One factor per record: its user's clip factor divided by the user's number of records. Only per-user
        norms are read (the sink was told so at observe_batch, and forms no per-record norm where it can)."""
        counts = self._user_counts
        held = self.sink.sample_rows(params)  # parameters with records -> their rows
        if counts is None:
            raise StepRefusedError(_NO_USERS)
        if not held:
            self._check_a_batch_was_seen(params)
            return {}
        rows = self._check_row_counts(held)
        if int(counts.sum()) != rows or (counts.numel() and int(counts.min()) <= 0):
            raise StepRefusedError(
                f"fxdp: the loader said this batch holds {int(counts.sum())} records of {counts.numel()} users, but "
                f"the per-sample gradients since the last step have {rows} rows: the records cannot be matched to "
                "their users. Run the model once on the batch as the loader hands it out, then step")
        self._check_every_gradient_is_per_sample(params, held, rows)
        num_users = counts.numel()
        groups = torch.repeat_interleave(counts)  # (each record's user: 0 0 0 1 1 2 ...)
        per_user = self.sink.grouped_squared_norms(list(held), groups, num_users)
        device = next(iter(per_user.values())).device
        counts, groups = counts.to(device), groups.to(device)
        stacked = stacked_norms(per_user)  # (P, U)
        self._check_not_negative(per_user, stacked)
        dropped_users = self._drop_non_finite_users(per_user, stacked, groups, num_users)
        inverse = 1.0 / counts.to(torch.float64)  # the average of the user's records
        # ||g_u||^2 = ||sum_{i in u} g_i||^2 / k_u^2, each parameter's in its own (wide) dtype
        if stacked is not None and all(wide(sq).dtype == stacked.dtype for sq in per_user.values()):
            # (all of one dtype and device, the usual case: every parameter's at once, the same values)
            scaled = stacked * inverse.to(stacked.dtype) ** 2
            weights = dict(zip(per_user, scaled))
        else:
            scaled = None
            weights = {p: wide(sq).to(device) * inverse.to(wide(sq).dtype) ** 2 for p, sq in per_user.items()}
        if self.clipping == "per_layer":
            factors = {p: clip_factor(self._bound(p), sq.sqrt()) for p, sq in weights.items()}
        else:
            total = (scaled.to(torch.float64) if scaled is not None else
                     torch.stack([sq.to(torch.float64) for sq in weights.values()])).sum(0)
            factor = clip_factor(self._max_grad_norm, total.sqrt())
            factors = dict.fromkeys(weights, factor)
        if dropped_users is not None:  # (their factor would be 0 or NaN: 0 either way; their records are zeros)
            factors = {p: f.masked_fill(dropped_users, 0.0) for p, f in factors.items()}
        self.step_state.dropped_samples = dropped_users is not None
        # the record's factor: its user's, times 1/k_u (one tensor stays one: flat clipping sums all layers at once)
        expanded: Dict[int, torch.Tensor] = {}
        out = {}
        for p, f in factors.items():
            if id(f) not in expanded:
                dtype = torch.float64 if per_user[p].dtype == torch.float64 else torch.float32
                expanded[id(f)] = (f * inverse.to(f.dtype))[groups].to(dtype)
            out[p] = expanded[id(f)].to(per_user[p].device)
        return out

    def _drop_non_finite_users(self, per_user: Dict[nn.Parameter, torch.Tensor], stacked: Optional[torch.Tensor],
                               groups: torch.Tensor, num_users: int) -> Optional[torch.Tensor]:
        """The users whose summed gradient is not finite (inf or NaN in one of their records, or too large to
        square), as a bool ``(U,)``, or None when there are none. Their records are dropped (the sink zeroes them),
        so that the user contributes nothing, as if clipped to 0, with a warning, as the example-level optimizer
        drops a sample; a sink that cannot drop records refuses the step."""
        if bool(torch.isfinite(stacked).all()) if stacked is not None else all(
                bool(torch.isfinite(sq).all()) for sq in per_user.values()):
            return None
        device = groups.device
        dropped = torch.zeros(num_users, dtype=torch.bool, device=device)
        for sq in per_user.values():
            dropped |= ~torch.isfinite(sq.to(device))
        first = int(dropped.nonzero()[0])
        p = next(p for p, sq in per_user.items() if not bool(torch.isfinite(sq[first])))
        where = (f"the gradient of parameter '{self._name(p)}' is not finite (inf or nan, or too large to square) "
                 f"for {int(dropped.sum())} of {dropped.numel()} users (first: user {first} of the batch, records "
                 f"{[int(i) for i in (groups == first).nonzero().flatten()]})")
        try:
            self.sink.drop_samples(list(per_user), dropped[groups])
        except NotImplementedError:
            raise StepRefusedError(
                f"fxdp: {where}; clipping cannot bound it and this model's gradient sink cannot leave those "
                "records out, so the optimizer refuses to step. Look for inf/nan in the inputs and the loss (log "
                "of 0, division by 0), or lower the learning rate if training diverged") from None
        warnings.warn(
            f"fxdp: {where}: all the records of those users contribute nothing to this step (as if clipped to 0; "
            "the noise is added as always). Look for inf/nan in the inputs and the loss (log of 0, division by 0); "
            "if every user is dropped, training has diverged (lower the learning rate)", NonFiniteSampleWarning,
            stacklevel=4)
        return dropped


def check_privacy_unit(privacy_unit: str) -> str:
    if privacy_unit not in PRIVACY_UNITS:
        raise PrivacySettingError(f"fxdp: privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
    return privacy_unit
