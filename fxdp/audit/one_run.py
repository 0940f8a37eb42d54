"""``one_run``: train a model privately with fxdp's own PrivacyEngine while auditing the run.

The run is the ordinary private run — Poisson sampling, per-sample clipping at ``max_grad_norm``,
Gaussian noise ``noise_multiplier * max_grad_norm``, the accountant — with ``canaries`` extra records,
each in the training set with probability 1/2. A user-level run (``privacy_unit="user"``) hides canary
users instead, all of whose records are in or out together (:mod:`fxdp.audit.users`); a run with correlated
noise (``noise_mechanism=``) puts the canaries in its cyclic loader's parts (:mod:`fxdp.audit.correlated`).
Afterwards the auditor guesses which canaries were in (:func:`fxdp.audit.bound.best_guesses`) and turns its
success into a lower bound on epsilon (:func:`fxdp.audit.bound.epsilon_lower_bound`), reported next to the
accountant's epsilon.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from fxdp.audit.bound import AuditResult, best_guesses
from fxdp.audit.canaries import CanaryInputs, CanarySink, StepScores, draw_membership, loss_scores
from fxdp.audit.correlated import CorrelatedStepScores, canary_partitions, strategy_matrix
from fxdp.audit.users import UserCanarySink, user_observer

CANARY_KINDS = ("gradient", "input")
CANARY_NORM_FACTOR = 1000.0  # a gradient canary's raw norm, in units of max_grad_norm


def one_run(
    model: nn.Module,
    train_set: Dataset,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    batch_size: int,
    epochs: int,
    canaries: int = 1000,
    canary: str = "gradient",
    delta: float = 1e-5,
    confidence: float = 0.95,
    seed: int = 0,
    lr: float = 0.5,
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    accountant: Optional[str] = None,
    grad_sample_mode: str = "fx",
    grid: Optional[List[Tuple[int, int]]] = None,
    privacy_unit: str = "example",
    user_ids: Any = None,
    max_records_per_user: Optional[int] = None,
    canary_records: Optional[int] = None,
    noise_mechanism: Any = "gaussian",
) -> AuditResult:
    """Train ``model`` (in place) on ``train_set`` with DP-SGD and audit the run.

    Args:
        model: the model to train; its parameters are trained in place.
        train_set: a dataset of ``(input, label)`` pairs.
        noise_multiplier, max_grad_norm: sigma and C of DP-SGD.
        batch_size: the expected (Poisson) batch size: the sample rate is one over the number of batches
            of that size, about ``batch_size / len(train_set)`` (with input canaries, the training set
            includes the canaries that are in).
        epochs: passes over the data (``epochs * len(train_set) / batch_size`` steps).
        canaries: how many canaries; each is in with probability 1/2.
        canary: ``"gradient"`` (white box: a gradient of its own direction in a parameter block the model
            never reads, through the same clipping and noise as the data; close to the truth for DP-SGD)
            or ``"input"`` (black box: random inputs with random labels, scored by their loss; what can
            be run on any model, and much weaker). See docs/audit.md.
        delta, confidence: the bound's delta (the accountant is asked at the same delta) and confidence.
        seed: seeds the canaries, their membership, the sampling and the noise (the global RNG is
            restored afterwards).
        lr: the learning rate of plain SGD (no momentum, so the gradient canaries' scores are sums of
            their private gradients).
        loss_fn: ``loss_fn(outputs, labels)`` reduced by mean; default cross-entropy.
        accountant, grad_sample_mode: passed to the PrivacyEngine (accountant default ``"rdp"``, ``"pld"`` with
            a correlated ``noise_mechanism``, which is accounted with PLD only).
        grid: (positive, negative) guess counts to try, default :func:`fxdp.audit.bound.guess_grid`.
        privacy_unit, user_ids, max_records_per_user: a user-level run (``privacy_unit="user"``, passed to
            ``make_private``): the canaries are then canary users (:mod:`fxdp.audit.users`) of
            ``canary_records`` records each (default ``max_records_per_user``; a canary user brings at most
            ``max_records_per_user`` of them to a step), all included or excluded together.
        noise_mechanism: passed to ``make_private`` (``BandedMatrixFactorization(...)``,
            ``BufferedLinearToeplitz(...)``): the canaries then follow the cyclic loader's parts and are scored
            after undoing the noise's correlation (:mod:`fxdp.audit.correlated`). Gradient canaries only.

    Returns an :class:`AuditResult`: ``epsilon_lower`` at ``confidence``, and the accountant's
    ``epsilon_claimed`` for this run at ``delta``. ``epsilon_lower > epsilon_claimed`` means the run
    leaked more than the accountant allows — a bug in clipping, noise, sampling or accounting.
    """
    if canary not in CANARY_KINDS:
        raise ValueError(f"fxdp.audit: canary must be one of {CANARY_KINDS}, got {canary!r}")
    if not isinstance(canaries, int) or canaries < 1:
        raise ValueError(f"fxdp.audit: canaries must be a positive int, got {canaries!r}")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"fxdp.audit: epochs must be a positive int, got {epochs!r}")
    by_user = privacy_unit == "user"
    correlated = not (noise_mechanism is None or (isinstance(noise_mechanism, str) and noise_mechanism == "gaussian"))
    if canary == "input" and (by_user or correlated):
        raise ValueError("fxdp.audit: input canaries audit example-level runs with independent noise only; audit a "
                         "user-level or correlated-noise run with canary='gradient'")
    records = 1
    if by_user:
        if max_records_per_user is None:
            raise ValueError("fxdp.audit: privacy_unit='user' needs max_records_per_user (k)")
        records = max_records_per_user if canary_records is None else canary_records
        if isinstance(records, bool) or not isinstance(records, int) or records < 1:
            raise ValueError(f"fxdp.audit: canary_records must be a positive int, got {records!r}")
        records = min(records, max_records_per_user)  # a sampled user brings at most k records
    elif canary_records is not None:
        raise ValueError("fxdp.audit: canary_records is for privacy_unit='user' (records of a canary user)")
    if accountant is None:
        accountant = "pld" if correlated else "rdp"
    private = dict(privacy_unit=privacy_unit, user_ids=user_ids, max_records_per_user=max_records_per_user)
    if correlated:
        private["noise_mechanism"] = noise_mechanism

    loss_fn = loss_fn or nn.functional.cross_entropy
    g = torch.Generator().manual_seed(seed)
    members = draw_membership(canaries, g)

    data, canary_set = train_set, None
    if canary == "input":
        with torch.no_grad():
            first = torch.as_tensor(train_set[0][0]).unsqueeze(0).to(next(model.parameters()).device)
            num_classes = model(first).shape[-1]
        canary_set = CanaryInputs.like(train_set, canaries, num_classes=num_classes, generator=g)
        data = ConcatDataset([train_set, Subset(canary_set, members.nonzero().flatten().tolist())])

    engine, step_scores = _train(model, data, members, g, canary=canary, seed=seed, accountant=accountant, lr=lr,
                                 batch_size=batch_size, noise_multiplier=noise_multiplier,
                                 max_grad_norm=max_grad_norm, grad_sample_mode=grad_sample_mode, epochs=epochs,
                                 loss_fn=loss_fn, records=records, private=private)
    if step_scores is not None:
        scores = step_scores.scores()
    else:
        per_sample = None if loss_fn is nn.functional.cross_entropy else (
            lambda out, y: torch.stack([loss_fn(out[i:i + 1], y[i:i + 1]) for i in range(len(y))]))
        scores = loss_scores(model, canary_set, loss_fn=per_sample)
    guesses = best_guesses(scores.tolist(), members.tolist(), delta=delta, confidence=confidence, grid=grid)
    return AuditResult(
        epsilon_lower=guesses.epsilon_lower,
        epsilon_claimed=engine.get_epsilon(delta),
        guesses=guesses.guesses,
        correct=guesses.correct,
        canaries=canaries,
        delta=delta,
        confidence=confidence,
        positives=guesses.positives,
        canary=canary,
    )


def _train(model: nn.Module, data: Dataset, members: torch.Tensor, g: torch.Generator, *, canary: str, seed: int,
           accountant: str, lr: float, batch_size: int, noise_multiplier: float, max_grad_norm: float,
           grad_sample_mode: str, epochs: int, loss_fn: Callable, records: int = 1,
           private: Optional[Dict[str, Any]] = None) -> tuple:
    """:func:`one_run`'s training: DP-SGD on ``data`` (gradient canaries, when asked for, in a parameter block of
    their own, one per canary, in the ``members``), the global RNG seeded by ``seed`` and restored afterwards.
    Returns the engine (its accountant) and the gradient canaries' scores (None for input canaries)."""
    from fxdp.privacy_engine import PrivacyEngine  # the audit sits on top of the whole training stack

    canaries = len(members)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the sampler's and the noise's draws, without touching the caller's RNG
        engine = PrivacyEngine(accountant=accountant)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        loader = DataLoader(data, batch_size=batch_size)
        dp_model, dp_optimizer, dp_loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm, grad_sample_mode=grad_sample_mode, poisson_sampling=True,
            noise_generator=torch.Generator().manual_seed(seed), **(private or {}))
        mechanism = getattr(dp_optimizer, "noise_mechanism", None)

        sink, step_scores, eligible = None, None, None
        device = next(model.parameters()).device
        if canary == "gradient":
            block = nn.Parameter(torch.zeros(canaries, device=device))
            dp_optimizer.add_param_group({"params": [block], "lr": lr, "momentum": 0.0, "weight_decay": 0.0})
            by_user = getattr(dp_optimizer, "privacy_unit", "example") == "user"
            kind = UserCanarySink if by_user else CanarySink
            sink = kind(dp_optimizer.sink, block, members, norm=CANARY_NORM_FACTOR * max_grad_norm,
                        sample_rate=dp_loader.sample_rate, generator=g, records=records)
            dp_optimizer.sink = sink
            if by_user:  # the canary users are drawn as the loader tells the optimizer each batch's users
                dp_loader.batch_observer = user_observer(dp_optimizer, sink)
            per_sample_scale = dp_optimizer.expected_batch_size if dp_optimizer.loss_reduction == "mean" else 1
            unit = lr * max_grad_norm / per_sample_scale
            if mechanism is not None:  # correlated noise: canaries in the cyclic loader's parts
                partition = canary_partitions(canaries, dp_loader.partitions, g)
                eligible = lambda: partition == dp_loader.cycle_position  # noqa: E731
                step_scores = CorrelatedStepScores(
                    block, unit=unit, noise_multiplier=noise_multiplier, sample_rate=dp_loader.sample_rate,
                    partition=partition, position=lambda: dp_loader.cycle_position,
                    strategy=lambda n: strategy_matrix(mechanism, n))
            else:
                step_scores = StepScores(block, unit=unit, noise_multiplier=noise_multiplier,
                                         sample_rate=dp_loader.sample_rate)
            dp_optimizer.attach_step_hook(step_scores)

        dp_model.train()
        for _ in range(epochs):
            for inputs, labels in dp_loader:
                if sink is not None and not isinstance(sink, UserCanarySink):  # (canary users: drawn by the observer)
                    sink.draw(None if eligible is None else eligible())
                dp_optimizer.zero_grad()
                if len(inputs):  # an empty Poisson batch still takes a step: noise (and canaries) only
                    loss_fn(dp_model(inputs.to(device)), labels.to(device)).backward()
                dp_optimizer.step()

    return engine, step_scores


__all__ = ["CANARY_KINDS", "one_run"]
