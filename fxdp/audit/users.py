"""Canary users: gradient canaries for auditing a user-level run (``make_private(privacy_unit="user", ...)``).

The unit of privacy is a user, so the audit's secret is a user: canary user ``j`` has ``records`` records, and
the coin that decides whether it is "in" includes or excludes **all** of them together. Each of its records is
a per-sample row ``norm * e_j`` in the canaries' parameter block (:class:`fxdp.audit.CanarySink` with
``records > 1``), so the records of one canary user point the same way: their average is ``norm * e_j``, which
correct user-level clipping cuts to exactly ``C`` — the user adds ``C`` to the sum, as the accountant assumes.
Clipping each record alone (an example-level optimizer on a user-level batch) would let ``records * C``
through, and the audit sees it.

A canary user joins a step with the loader's user rate ``q`` (one coin per user per step, as real users), and
brings ``min(records, k)`` records (``k = max_records_per_user``; its records are identical, so which ones does
not matter). The loader tells the optimizer how many records each user of the batch has;
:func:`user_observer` appends the canary users of the step to that list, after the real users, matching the
rows :class:`UserCanarySink` appends after the real records.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from fxdp.audit.canaries import CanarySink
from fxdp.diagnostics import PerSampleError


class UserCanarySink(CanarySink):
    """A :class:`~fxdp.audit.CanarySink` whose canaries are users of ``records`` rows each, for the
    :class:`~fxdp.optim.user_level.UserLevelDPOptimizer`: it answers the per-user norms
    (:meth:`grouped_squared_norms`) of the real users from the wrapped sink and of the canary users itself."""

    def canary_counts(self) -> torch.Tensor:
        """The number of records of each canary user of this step (in the order of their rows)."""
        return torch.full((len(self.active),), self.records, dtype=torch.long)

    def grouped_squared_norms(self, params, groups: torch.Tensor, num_groups: int):
        ordinary, with_block = self._split(params)
        canaries = len(self.active)
        real_groups, rows = num_groups - canaries, groups.numel()
        n_real = rows - canaries * self.records
        expected = torch.arange(real_groups, num_groups, device=groups.device).repeat_interleave(self.records)
        if real_groups < 0 or n_real < 0 or not torch.equal(groups[n_real:], expected):
            raise PerSampleError(
                f"fxdp.audit: the optimizer grouped {rows} rows into {num_groups} users, but the canary users of this "
                f"step are the last {canaries} users with {self.records} rows each; build the loader's observer with "
                "fxdp.audit.users.user_observer so that the canary users follow the real ones")
        out = {}
        if ordinary and n_real > 0:
            out = dict(self.inner.grouped_squared_norms(ordinary, groups[:n_real], real_groups))
        for p in ordinary:
            if p in out:
                out[p] = torch.cat([out[p], out[p].new_zeros(canaries)])
        if with_block:
            per_user = self.block.new_zeros(num_groups, dtype=torch.float64)
            per_user[real_groups:] = (self.records * self.norm) ** 2  # ||sum of the user's rows||^2
            out[self.block] = per_user
        return out

    def drop_samples(self, params, dropped: torch.Tensor) -> None:
        ordinary, _ = self._split(params)
        rows = dropped.numel() - len(self.active) * self.records
        if bool(dropped[rows:].any()):
            raise PerSampleError("fxdp.audit: the optimizer dropped a record of a canary user, whose rows are "
                                 "finite: the dropping marked the wrong rows")
        self.inner.drop_samples(ordinary, dropped[:rows])


def user_observer(optimizer: Any, sink: UserCanarySink) -> Callable[..., None]:
    """A batch observer for a user-level loader (``loader.batch_observer``): before each batch is handed out it
    draws the step's canary users (:meth:`CanarySink.draw`) and tells ``optimizer.observe_batch`` the batch's
    users followed by the canary users. A batch told without users stays without them (the optimizer refuses it)."""

    def observe_batch(*, empty: bool, new_epoch: bool = False, users: Optional[torch.Tensor] = None) -> None:
        sink.draw()
        if users is not None:
            users = torch.cat([torch.as_tensor(users, dtype=torch.long).reshape(-1), sink.canary_counts()])
        optimizer.observe_batch(empty=empty, new_epoch=new_epoch, users=users)

    return observe_batch


__all__ = ["UserCanarySink", "user_observer"]
