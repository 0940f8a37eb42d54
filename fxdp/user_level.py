"""``make_private(privacy_unit="user", user_ids=..., max_records_per_user=k)``: what the PrivacyEngine checks and
builds for user-level DP-SGD (the unit of privacy a user, all of whose records are added or removed together).

The pieces: the loader :class:`fxdp.data.users.UserLevelDataLoader` (users Poisson-sampled at rate
``q = 1 / len(data_loader)``, up to k records each), the optimizer :class:`fxdp.optim.user_level.UserLevelDPOptimizer`
(each user's averaged gradient clipped to C as one unit, the noise added once, the ``"mean"`` loss divided by
the expected number of users per batch) and the accountant, unchanged: one user is one unit of the
Poisson-subsampled Gaussian mechanism at rate q, which is what it records at every step. docs/user_level.md."""

from __future__ import annotations

from typing import Any, Optional

from fxdp.optim.user_level import check_privacy_unit


def check_user_level(*, privacy_unit: str, user_ids: Any, max_records_per_user: Optional[int],
                     poisson_sampling: bool, clipping: str, padded_batches: Any, criterion: Any,
                     across_processes: bool, mechanism: Any, fixed_batch_accounting: str, wrap_model: bool) -> bool:
    """Whether ``make_private`` trains at user level; every option it cannot combine with that refused, naming it."""
    check_privacy_unit(privacy_unit)
    if privacy_unit == "example":
        if user_ids is not None or max_records_per_user is not None:
            raise ValueError("fxdp: user_ids and max_records_per_user are for privacy_unit='user'; with the default "
                             "privacy_unit='example' each record is the unit. Pass privacy_unit='user'")
        return False
    if user_ids is None or max_records_per_user is None:
        raise ValueError("fxdp: privacy_unit='user' needs user_ids (each record's user: a sequence aligned with the "
                         "dataset, a field name, or a function of a record) and max_records_per_user (k, the most "
                         "records of one user in a step)")
    refused = [
        (not poisson_sampling, "poisson_sampling=False (users are Poisson-sampled; pass poisson_sampling=True)"),
        (clipping not in ("flat", "per_layer"), f"clipping={clipping!r} (use 'flat' or 'per_layer')"),
        (bool(padded_batches), "padded_batches (pass padded_batches=False)"),
        (criterion is not None, "criterion (compute the loss yourself)"),
        (across_processes, "DDP or FSDP (train in one process)"),
        (mechanism is not None, "a correlated noise_mechanism (use the default 'gaussian')"),
        (fixed_batch_accounting != "poisson", f"fixed_batch_accounting={fixed_batch_accounting!r}"),
        (not wrap_model, "wrap_model=False (pass wrap_model=True)"),
    ]
    bad = [why for refuse, why in refused if refuse]
    if bad:
        raise ValueError("fxdp: privacy_unit='user' does not support " + "; ".join(bad) + " yet")
    return True
