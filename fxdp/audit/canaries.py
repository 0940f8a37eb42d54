"""Canaries: the examples an audit hides in training and then tries to find.

Gradient canaries (white box). Canary ``j`` is a pretend training sample whose gradient is
``norm * e_j`` in a block of ``m`` extra coordinates — a standalone parameter the model's forward never
reads, so real samples leave it alone and each canary has a direction of its own. They enter through
the gradient sink: :class:`CanarySink` wraps the model's sink and, for every step, appends one
per-sample row per canary that joins that step, so the DP optimizer clips, sums and noises them like
any sample. ``norm`` is far above the clipping bound: correct clipping cuts each canary to exactly
``max_grad_norm``; a missing or loose clip lets more through, and the audit sees it.

Input canaries (black box). Inputs drawn from no class (noise the shape of the data) with random
labels, inserted into the training set when "in" and scored afterwards by their loss alone.
"""

from __future__ import annotations

import math

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import Dataset

from fxdp.diagnostics import PerSampleError
from fxdp.sinks.contract import GradientSink, LayerCapture


def draw_membership(m: int, generator: torch.Generator) -> torch.Tensor:
    """Each of ``m`` canaries is "in" independently with probability 1/2 (a bool tensor)."""
    return torch.rand(m, generator=generator) < 0.5


class CanarySink(GradientSink):
    """A gradient sink that adds gradient canaries to another sink's samples.

    ``block`` is the canaries' parameter, shape ``(m,)``. ``members[j]`` says whether canary ``j`` is
    in the training set; :meth:`draw` Poisson-samples the members for the next step with
    ``sample_rate`` (the rate of the real data). Until the next :meth:`draw`, every read appends those
    canaries as extra rows: zeros for the model's parameters, ``norm * e_j`` for ``block``. The rows
    are spent by :meth:`clipped_sums` (once per step, whatever the number of physical batches).
    ``records`` rows per canary that joins (default 1; several for the canary users of a user-level
    audit, :mod:`fxdp.audit.users`): canary ``j``'s rows are consecutive, each ``norm * e_j``.
    """

    def __init__(self, inner: GradientSink, block: nn.Parameter, members: torch.Tensor, *, norm: float,
                 sample_rate: float, generator: torch.Generator, records: int = 1):
        if block.dim() != 1 or block.numel() != members.numel():
            raise ValueError(f"fxdp.audit: the canary block must have shape ({members.numel()},), one "
                             f"coordinate per canary; got {tuple(block.shape)}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"fxdp.audit: sample_rate must lie in (0, 1], got {sample_rate}")
        if isinstance(records, bool) or not isinstance(records, int) or records < 1:
            raise ValueError(f"fxdp.audit: records per canary must be an int >= 1, got {records!r}")
        self.records = records
        self.inner = inner
        self.block = block
        self.members = members.bool()
        self.norm = float(norm)
        self.sample_rate = float(sample_rate)
        self.generator = generator
        self.active = torch.zeros(0, dtype=torch.long)  # canaries in the current step
        self.appearances = torch.zeros(members.numel(), dtype=torch.long)  # steps each canary joined

    def draw(self, eligible: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Choose the canaries of the next step: each member joins with probability ``sample_rate`` (only those
        ``eligible`` marks, when given: the canaries of the part a cyclic loader samples this step)."""
        joins = torch.rand(self.members.numel(), generator=self.generator) < self.sample_rate
        if eligible is not None:
            joins &= eligible.bool()
        self.active = torch.nonzero(joins & self.members).flatten()
        self.appearances[self.active] += 1
        return self.active

    # write side: the model's captures go to the model's sink untouched
    def add(self, capture: LayerCapture) -> None:
        self.inner.add(capture)

    def _split(self, params: Iterable[nn.Parameter]) -> Tuple[List[nn.Parameter], bool]:
        params = list(params)
        return [p for p in params if p is not self.block], any(p is self.block for p in params)

    def _real_rows(self, norms: Dict[nn.Parameter, torch.Tensor]) -> int:
        sizes = {int(n.shape[0]) for n in norms.values()}
        if len(sizes) > 1:
            raise PerSampleError(f"fxdp.audit: the model's sink reported different sample counts {sorted(sizes)} "
                               "for different parameters; cannot line canary rows up with them")
        return sizes.pop() if sizes else 0

    def squared_norms(self, params):
        ordinary, with_block = self._split(params)
        norms = self.inner.squared_norms(ordinary)
        n_real, k = self._real_rows(norms), len(self.active) * self.records
        out = {p: torch.cat([n, n.new_zeros(k)]) for p, n in norms.items()}
        if with_block:
            rows = self.block.new_zeros(n_real + k)
            rows[n_real:] = self.norm ** 2
            out[self.block] = rows
        return out

    def clipped_sums(self, params, factors):
        ordinary, with_block = self._split(params)
        k = len(self.active) * self.records
        real_factors = {p: f[: f.shape[0] - k] for p, f in factors.items() if p is not self.block}
        sums = self.inner.clipped_sums(ordinary, real_factors)
        if with_block and self.block in factors:
            f = factors[self.block]
            total = self.block.new_zeros(self.block.shape)
            rows_of = self.active.repeat_interleave(self.records).to(total.device)  # each canary row's canary
            total.index_add_(0, rows_of, f[f.shape[0] - k:].to(total.dtype) * self.norm)
            sums[self.block] = total
        self.active = self.active[:0]  # spent: later physical batches of this step carry none
        return sums

    def clear(self, params):
        ordinary, _ = self._split(params)
        self.inner.clear(ordinary)


class StepScores:
    """Scores of gradient canaries from every step's update (white box: the auditor sees each model
    update, which the accountant's guarantee covers). Call it after each step (an optimizer step hook).

    In units of ``unit`` (how far one clipped canary moves its coordinate in one step: lr * C / B for
    SGD on a mean loss), canary ``j``'s step update is ``u = b + sigma * z`` with ``b`` = 1 if it joined
    the step (probability ``sample_rate`` when in, never when out). The score is the log-likelihood
    ratio of "in" to "out" summed over steps, ``sum_t log(1 - q + q exp((u_t - 1/2) / sigma^2))``,
    which ranks canaries far better than the summed update when a canary joins only a few of many noisy
    steps. Without noise it is the summed update. Any score gives a valid bound; this one a high one.
    """

    def __init__(self, block: nn.Parameter, *, unit: float, noise_multiplier: float, sample_rate: float):
        if unit <= 0:
            raise ValueError(f"fxdp.audit: the canaries' step unit must be positive, got {unit}")
        self.block, self.unit = block, float(unit)
        self.sigma, self.q = float(noise_multiplier), float(sample_rate)
        self.previous = block.detach().clone()
        self.summed = torch.zeros(block.shape, dtype=torch.float64, device=block.device)
        self.log_ratio = torch.zeros_like(self.summed)
        self.steps = 0

    def __call__(self, optimizer=None) -> None:
        now = self.block.detach().clone()
        u = (self.previous - now).double() / self.unit  # a descent step along +e_j lowers coordinate j
        self.previous = now
        self.summed += u
        if self.sigma > 0:
            log_out = torch.full_like(u, math.log1p(-self.q) if self.q < 1 else -math.inf)
            self.log_ratio += torch.logaddexp(log_out, math.log(self.q) + (u - 0.5) / self.sigma ** 2)
        self.steps += 1

    def scores(self) -> torch.Tensor:
        """One score per canary; high means "was in"."""
        return self.log_ratio.clone() if self.sigma > 0 else self.summed.clone()


# --------------------------------------------------------------------------- input canaries


class CanaryInputs(Dataset):
    """``m`` black-box canaries: inputs the shape of the data's, drawn from N(mean, std) of the data
    (no digit, no class), each with a random label. Element ``j`` is ``(x_j, y_j)``."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor):
        self.inputs, self.labels = inputs, labels

    @classmethod
    def like(cls, dataset: Dataset, m: int, *, num_classes: int, generator: torch.Generator) -> "CanaryInputs":
        x0, y0 = dataset[0]
        x0 = torch.as_tensor(x0)
        probe = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(len(dataset), 256))]).float()
        inputs = torch.randn((m, *x0.shape), generator=generator) * probe.std() + probe.mean()
        labels = torch.randint(0, num_classes, (m,), generator=generator, dtype=torch.as_tensor(y0).dtype)
        return cls(inputs.to(x0.dtype), labels)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, j):
        return self.inputs[j], self.labels[j]


@torch.no_grad()
def loss_scores(model: nn.Module, canaries: CanaryInputs, *, batch_size: int = 256,
                loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Minus each canary's loss under the trained model: a canary trained on fits better, so high
    means "was in". ``loss_fn(outputs, labels)`` returns one loss per sample (default: cross-entropy)."""
    loss_fn = loss_fn or nn.CrossEntropyLoss(reduction="none")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        losses = [loss_fn(model(canaries.inputs[i:i + batch_size].to(device)),
                          canaries.labels[i:i + batch_size].to(device)).cpu()
                  for i in range(0, len(canaries), batch_size)]
    finally:
        model.train(was_training)
    return -torch.cat(losses).double()


__all__ = ["CanaryInputs", "CanarySink", "StepScores", "draw_membership", "loss_scores"]
