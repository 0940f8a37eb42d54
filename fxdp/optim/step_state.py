"""``StepState``: what a :class:`~fxdp.optim.dp_optimizer.DPOptimizer` carries from one call to the next within a
logical step (``observe_batch``, ``signal_skip_step``, ``step``, ``zero_grad``), in one object the optimizer owns
(``optimizer.step_state``). The optimizer, its mixins (:mod:`fxdp.optim.step_checks`,
:mod:`fxdp.optim.extension_points`) and its subclasses (user-level, DDP, FSDP2) read and write it there, and only
there: none of it lives in attributes of their own.

The settings (bounds, noise multiplier, expected batch size) are not step state: they are the optimizer's, checked
by their setters. A checkpoint (``DPOptimizer.state_dict``) keeps ``summed`` (as ``"accumulated"``) and
``skip_next`` (as ``"skip_next"``); the rest is rebuilt by the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from torch import nn


@dataclass
class StepState:
    """One logical step's state, from the batch the loader hands out to the update."""

    # the clipped sums of this logical batch so far (skipped steps' physical batches), by parameter
    summed: Dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    # the next step() only clips and accumulates (signal_skip_step)
    skip_next: bool = False
    # what the data loader said (observe_batch): logical batches begun since the last step (None: no loader
    # reports), whether the last one was empty, and a padded batch's (real rows, padded size)
    logical_batches: Optional[int] = None
    batch_empty: bool = False
    padding: Optional[Tuple[int, int]] = None
    # a logical step ran and zero_grad() has not been called since
    needs_zero_grad: bool = False
    # whether this physical batch dropped samples whose per-sample gradient is not finite (the sums are checked
    # after dropping only then)
    dropped_samples: bool = False
    # this physical batch's clip factors while an Opacus extension point runs (clip_and_accumulate reads them)
    factors: Optional[Dict[nn.Parameter, torch.Tensor]] = None
    # (norms, their (P, N) stack) while the clip factors of those very norms are formed (the stack made once)
    stacked: Optional[tuple] = None

    def stepped(self) -> None:
        """A logical step updated the parameters: the loader's batch is used, and zero_grad() is due."""
        self.needs_zero_grad = True
        self.logical_batches = None if self.logical_batches is None else 0
        self.batch_empty = False
        self.padding = None


class MovedToStepState:
    """A former private attribute of the optimizer, now a field of its :class:`StepState`: reading or setting it
    under the old name fails loudly (a subclass still setting it would otherwise set an attribute nothing reads)."""

    def __init__(self, name: str):
        self.name = name

    def _moved(self) -> AttributeError:
        return AttributeError(f"fxdp: DPOptimizer.{self.name} is now optimizer.step_state.{MOVED[self.name]} "
                              "(fxdp.optim.step_state.StepState)")

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        raise self._moved()

    def __set__(self, obj, value) -> None:
        raise self._moved()


# the optimizer's private attributes StepState replaced, as their field names were: {old name: field}
MOVED = {"_summed": "summed", "_skip_next": "skip_next", "_logical_batches": "logical_batches",
         "_batch_empty": "batch_empty", "_padding": "padding", "_needs_zero_grad": "needs_zero_grad",
         "_dropped_samples": "dropped_samples", "_step_factors": "factors", "_stacked": "stacked"}
