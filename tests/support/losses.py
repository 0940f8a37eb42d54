"""Losses as users write them, for the tests of the loss pass (tests/passes/test_loss.py) and of the loss probe
(tests/runtime/test_loss_probe.py): each case is a loss of a model's output and its targets, what fxdp must find
in it (nothing, samples mixed, or a normaliser the batch sets), and for a normaliser its per-sample fix.

The model: ``model()`` maps ``(N, 5)`` (``"flat"``: output ``(N, 6)``) or ``(N, T, 5)`` (``"tokens"``: output
``(N, T, 6)``, six classes per token) to its output, in float64."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.per_sample_loss import per_sample_loss

N, T, D = 5, 4, 6
NONE, MIXES, NORMALISER = "none", "mixes samples", "normalised by the batch"


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, D)).double()


def inputs(shape: str, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn((n, 5) if shape == "flat" else (n, T, 5), generator=g, dtype=torch.float64)


def _labels(n):
    return torch.arange(n) % D


def _token_labels(n):
    labels = (torch.arange(n * T).view(n, T) * 7) % D
    for i in range(n):  # padding of a different length in each sample
        labels[i, T - (i % T):] = -100
    return labels


def _soft(n):
    return torch.softmax(torch.linspace(-1, 1, n * D, dtype=torch.float64).view(n, D), 1)


def _values(n):
    return torch.linspace(-1, 2, n * D, dtype=torch.float64).view(n, D)


def _signs(n):
    return torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).double()


WEIGHTS = torch.linspace(0.5, 2.0, D, dtype=torch.float64)


@dataclass(frozen=True)
class LossCase:
    name: str
    loss: Callable[..., torch.Tensor]  # (output, *targets) -> the batch's loss
    targets: Callable[[int], Tuple[torch.Tensor, ...]]
    expect: str = NONE
    shape: str = "flat"
    fix: Optional[Callable[..., torch.Tensor]] = None  # a normaliser's per-sample fix, same arguments


def _ctc(o, labels, lengths):
    log_probs = o.transpose(0, 1).log_softmax(2)  # (T, N, C)
    return F.ctc_loss(log_probs, labels, torch.full((o.shape[0],), T, dtype=torch.long), lengths)


PER_SAMPLE = [
    LossCase("cross_entropy", lambda o, y: F.cross_entropy(o, y), lambda n: (_labels(n),)),
    LossCase("cross_entropy_ignore_index", lambda o, y: F.cross_entropy(o, y, ignore_index=0), lambda n: (_labels(n),)),
    LossCase("cross_entropy_label_smoothing", lambda o, y: F.cross_entropy(o, y, label_smoothing=0.1),
             lambda n: (_labels(n),)),
    LossCase("cross_entropy_probabilities", lambda o, p: F.cross_entropy(o, p), lambda n: (_soft(n),)),
    LossCase("cross_entropy_sum", lambda o, y: F.cross_entropy(o, y, reduction="sum"), lambda n: (_labels(n),)),
    LossCase("CrossEntropyLoss_module", nn.CrossEntropyLoss(), lambda n: (_labels(n),)),
    LossCase("nll_loss", lambda o, y: F.nll_loss(F.log_softmax(o, 1), y), lambda n: (_labels(n),)),
    LossCase("mse_loss", lambda o, t: F.mse_loss(o, t), lambda n: (_values(n),)),
    LossCase("l1_loss", lambda o, t: F.l1_loss(o, t), lambda n: (_values(n),)),
    LossCase("smooth_l1_loss", lambda o, t: F.smooth_l1_loss(o, t, beta=0.5), lambda n: (_values(n),)),
    LossCase("huber_loss", nn.HuberLoss(delta=0.7), lambda n: (_values(n),)),
    LossCase("binary_cross_entropy", lambda o, p: F.binary_cross_entropy(torch.sigmoid(o), p), lambda n: (_soft(n),)),
    LossCase("bce_with_logits", nn.BCEWithLogitsLoss(), lambda n: (_soft(n),)),
    LossCase("bce_with_logits_pos_weight", nn.BCEWithLogitsLoss(pos_weight=WEIGHTS), lambda n: (_soft(n),)),
    LossCase("kl_div_batchmean", lambda o, p: F.kl_div(F.log_softmax(o, 1), p, reduction="batchmean"),
             lambda n: (_soft(n),)),
    LossCase("poisson_nll_loss", lambda o, t: F.poisson_nll_loss(o, t.abs()), lambda n: (_values(n),)),
    LossCase("cosine_embedding_loss", lambda o, s: F.cosine_embedding_loss(o[:, :3], o[:, 3:], s),
             lambda n: (_signs(n),)),
    LossCase("margin_ranking_loss", lambda o, s: F.margin_ranking_loss(o[:, 0], o[:, 1], s), lambda n: (_signs(n),)),
    LossCase("hinge_embedding_loss", lambda o, s: F.hinge_embedding_loss(o.sum(1), s), lambda n: (_signs(n),)),
    LossCase("soft_margin_loss", lambda o, s: F.soft_margin_loss(o.sum(1), s), lambda n: (_signs(n),)),
    LossCase("triplet_margin_loss", lambda o: F.triplet_margin_loss(o[:, :2], o[:, 2:4], o[:, 4:]), lambda n: ()),
    LossCase("multilabel_soft_margin_loss", nn.MultiLabelSoftMarginLoss(), lambda n: ((_soft(n) > 0.2).double(),)),
    LossCase("multi_margin_loss", lambda o, y: F.multi_margin_loss(o, y), lambda n: (_labels(n),)),
    LossCase("sum_over_expected_batch", lambda o, t: F.mse_loss(o, t, reduction="sum") / 32.0,
             lambda n: (_values(n),)),
    LossCase("loss_plus_penalty", lambda o, y: F.cross_entropy(o, y) + 0.1 * (o ** 2).sum(1).mean(),
             lambda n: (_labels(n),)),
    LossCase("ctc_per_sample", _ctc, lambda n: (torch.ones(n, 2, dtype=torch.long), torch.full((n,), 2)),
             shape="tokens"),
    LossCase("each_sample_own_token_mean",
             lambda o, y: fxdp.per_sample_mean(F.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="none")
                                               .view(y.shape), weights=y != -100),
             lambda n: (_token_labels(n),), shape="tokens"),
    LossCase("fxdp_per_sample_loss_causal_lm", lambda o, y: per_sample_loss(o, y, "causal_lm").mean(),
             lambda n: (_token_labels(n),), shape="tokens"),
]

MIXING = [
    LossCase("infonce_in_batch_negatives", lambda z: F.cross_entropy(z @ z.T / 0.1, torch.arange(z.shape[0])),
             lambda n: (), MIXES),
    LossCase("clip_image_text", lambda o: F.cross_entropy(o[:, :3] @ o[:, 3:].T, torch.arange(o.shape[0])),
             lambda n: (), MIXES),
    LossCase("triplet_mining_in_batch", lambda o: torch.cdist(o, o).max(1).values.mean(), lambda n: (), MIXES),
    LossCase("normalised_by_batch_statistics", lambda o, t: F.mse_loss((o - o.mean(0)) / (o.std(0) + 1e-5), t),
             lambda n: (_values(n),), MIXES),
    LossCase("softmax_over_the_batch", lambda o, p: -(F.log_softmax(o, 0) * p).sum(), lambda n: (_soft(n),), MIXES),
    LossCase("root_of_the_batch_mean", lambda o, t: F.mse_loss(o, t).sqrt(), lambda n: (_values(n),), MIXES),
    LossCase("labels_centred_by_the_batch", lambda o, t: F.mse_loss(o, t - t.mean(0)), lambda n: (_values(n),),
             MIXES),
]


def _masked_token_losses(o, y):
    return F.cross_entropy(o.flatten(0, 1), y.clamp(min=0).flatten(), reduction="none").view(y.shape)


NORMALISERS = [
    LossCase("cross_entropy_class_weights", lambda o, y: F.cross_entropy(o, y, weight=WEIGHTS),
             lambda n: (_labels(n),), NORMALISER,
             fix=lambda o, y: F.cross_entropy(o, y, weight=WEIGHTS, reduction="none").mean()),
    LossCase("nll_class_weights", lambda o, y: F.nll_loss(F.log_softmax(o, 1), y, weight=WEIGHTS),
             lambda n: (_labels(n),), NORMALISER,
             fix=lambda o, y: F.nll_loss(F.log_softmax(o, 1), y, weight=WEIGHTS, reduction="none").mean()),
    LossCase("language_model_token_mean", lambda o, y: F.cross_entropy(o.reshape(-1, D), y.reshape(-1)),
             lambda n: (_token_labels(n),), NORMALISER, shape="tokens",
             fix=lambda o, y: fxdp.per_sample_mean(F.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="none")
                                                   .view(y.shape), weights=y != -100)),
    LossCase("masked_sum_over_mask_count",
             lambda o, y: (_masked_token_losses(o, y) * (y != -100)).sum() / (y != -100).sum(),
             lambda n: (_token_labels(n),), NORMALISER, shape="tokens",
             fix=lambda o, y: fxdp.per_sample_mean(_masked_token_losses(o, y), weights=y != -100)),
]
