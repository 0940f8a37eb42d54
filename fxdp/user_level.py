"""``make_private(privacy_unit="user", user_ids=..., max_records_per_user=k)``: what the PrivacyEngine checks and
builds for user-level DP-SGD (the unit of privacy a user, all of whose records are added or removed together).

The pieces: the loader :class:`fxdp.data.users.UserLevelDataLoader` (users Poisson-sampled at rate
``q = 1 / len(data_loader)``, up to k records each), the optimizer :class:`fxdp.optim.user_level.UserLevelDPOptimizer`
(each user's averaged gradient clipped to C as one unit, the noise added once, the ``"mean"`` loss divided by
the expected number of users per batch) and the accountant, unchanged: one user is one unit of the
Poisson-subsampled Gaussian mechanism at rate q, which is what it records at every step. Across processes (DDP,
FSDP2) each user is trained by one rank (:mod:`fxdp.data.user_ranks`, :mod:`fxdp.distributed.user_level`).
docs/user_level.md."""

from __future__ import annotations

from typing import Any, Optional

from fxdp.data.users import UserLevelDataLoader
from fxdp.distributed.data import check_poisson_group
from fxdp.optim.user_level import check_privacy_unit


def check_user_level(*, privacy_unit: str, user_ids: Any, max_records_per_user: Optional[int],
                     poisson_sampling: bool, clipping: str, padded_batches: Any, criterion: Any,
                     mechanism: Any, fixed_batch_accounting: str, wrap_model: bool) -> bool:
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
        (mechanism is not None, "a correlated noise_mechanism (use the default 'gaussian')"),
        (fixed_batch_accounting != "poisson", f"fixed_batch_accounting={fixed_batch_accounting!r}"),
        (not wrap_model, "wrap_model=False (pass wrap_model=True)"),
    ]
    bad = [why for refuse, why in refused if refuse]
    if bad:
        raise ValueError("fxdp: privacy_unit='user' does not support " + "; ".join(bad) + " yet")
    return True


def unit_of_the_accountant(current: str, asked: str, steps: int) -> str:
    """The engine's unit after a ``make_private`` asking for ``asked``: one accountant holds the steps of one unit
    (its ε is for a record, or for a user), so a PrivacyEngine whose accountant recorded steps of another unit
    refuses."""
    if steps and asked != current:
        raise ValueError(f"fxdp: this PrivacyEngine's accountant holds {steps} steps accounted with "
                         f"privacy_unit={current!r}; its ε cannot also be for privacy_unit={asked!r}. Use a new "
                         "PrivacyEngine for training with another unit of privacy")
    return asked


def unit_of_the_checkpoint(current: str, saved: str, path: Any, *, made_private: bool) -> str:
    """The unit a checkpoint's accountant history was recorded for, which the engine takes on loading it; an
    engine that made a model private with another unit refuses (its steps would be added to a history of the
    other unit, and the ε would hold for neither)."""
    if saved not in ("example", "user"):
        raise ValueError(f"fxdp: {path} says its ε is for privacy_unit={saved!r}, which fxdp does not know")
    if made_private and saved != current:
        raise ValueError(f"fxdp: {path} holds an accountant history for privacy_unit={saved!r}, and this "
                         f"PrivacyEngine trains with privacy_unit={current!r}. Call make_private with "
                         f"privacy_unit={saved!r} to continue that training")
    return saved


def user_level_loader(data_loader: Any, *, generator: Any, across: Any, user_ids: Any, max_records_per_user: int,
                      batch_first: bool) -> UserLevelDataLoader:
    """The user-level loader ``make_private`` returns. ``across``: the DDP module or FSDP2 sharding plan training
    across processes (None in one process): then every rank draws the users of the default process group and keeps
    those assigned to it (:mod:`fxdp.data.user_ranks`)."""
    if across is not None:
        check_poisson_group(across.process_group)
    return UserLevelDataLoader.from_data_loader(data_loader, generator=generator, distributed=across is not None,
                                                user_ids=user_ids, max_records_per_user=max_records_per_user,
                                                batch_first=batch_first)
