"""Following a cyclic loader: what a correlated noise mechanism checks at every step about the batch it noises.

Correlated noise is private only under the participation pattern its analysis assumes: banded MF's amplified
accounting needs each sample in one step of every ``bands`` or more (cyclic Poisson sampling), BLT's accounting
a minimum separation between a sample's steps. Both are what a :class:`fxdp.data.CyclicPoissonDataLoader` of
enough ``partitions`` hands out when its batches are used in order, one per step. :class:`FollowsCycle` (a mixin
of such mechanisms) reads the loader's ``cycle_position`` before each step and refuses a step whose batch is not
the next one of the cycle, or a loader whose split of the samples differs from the one followed before.

A mechanism using it sets ``_label`` (its name in messages), ``_separation`` (the fewest partitions it accepts),
``steps`` (the noise draws made) and, where its sensitivity holds for a number of steps, ``planned_steps``, and
calls :meth:`_init_cycle` in its constructor.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fxdp.sinks.contract import PrivacySettingError, StepRefusedError


class FollowsCycle:
    """The cycle checks of a correlated noise mechanism (see the module docstring)."""

    _label: str = ""
    steps: int = 0
    planned_steps: Optional[int] = None  # the steps its sensitivity was computed for (None: no such plan)
    _planned: str = "its sensitivity computed"  # what the plan fixed, for the refusal of a step past it

    @property
    def _separation(self) -> int:
        raise NotImplementedError

    def _init_cycle(self) -> None:
        self._position: Optional[Callable[[], Optional[int]]] = None  # the cycle position of this step's batch
        self.partitions: Optional[int] = None
        self.partition_fingerprint: Optional[str] = None  # which sample is in which partition (the loader's)
        self._fingerprint_now: Optional[str] = None
        self._offset: Optional[int] = None  # (cycle position - step) mod partitions, the same at every step

    def follow(self, loader: Any) -> None:
        """Follow a cyclic loader (:class:`fxdp.data.CyclicPoissonDataLoader`): each step's batch must be the next of
        its cycle (read from ``loader.cycle_position``), and its ``partitions`` at least the separation needed."""
        partitions = getattr(loader, "partitions", None)
        if not isinstance(partitions, int) or not hasattr(loader, "cycle_position"):
            raise PrivacySettingError(
                f"fxdp: {self._label} noise is private (and accounted) only when each sample can take part in one "
                f"step of every {self._separation} or more; a {type(loader).__name__} does not guarantee that. Train "
                f"on a fxdp.data.CyclicPoissonDataLoader with partitions >= {self._separation}")
        self.follow_cycle(lambda: loader.cycle_position, partitions, getattr(loader, "partition_fingerprint", None))

    def follow_cycle(self, position: Callable[[], Optional[int]], partitions: int,
                     fingerprint: Optional[str] = None) -> None:
        """:meth:`follow` for any source of batches: ``position()`` is the cycle position (0 .. partitions-1) of the
        batch of the step about to be noised; ``fingerprint`` names the assignment of samples to partitions."""
        if not isinstance(partitions, int) or partitions < self._separation:
            raise PrivacySettingError(
                f"fxdp: {self._separation_need()} needs a cyclic loader of at least {self._separation} partitions "
                f"(a sample's steps must be {self._separation} or more apart, {self._separation_reason()}), got "
                f"partitions={partitions!r}")
        if self.partitions is not None and self.partitions != partitions:
            raise PrivacySettingError(f"fxdp: this {self._label} noise followed a cycle of {self.partitions} "
                                      f"partitions; the loader has {partitions}. Keep the loader's partitions for "
                                      "the whole run")
        self._position, self.partitions = position, partitions
        if fingerprint is not None and self.partition_fingerprint is None:
            self.partition_fingerprint = fingerprint
        self._fingerprint_now = fingerprint

    def _separation_need(self) -> str:
        return f"{self._label} with a minimum separation of {self._separation}"

    def _separation_reason(self) -> str:
        return "as the accounting assumes"

    def check_step(self) -> None:
        """Before each step's noise: the batch is the cycle's next, and the step is within the plan."""
        self._check_cycle()
        if self.planned_steps is not None and self.steps >= self.planned_steps:
            raise StepRefusedError(
                f"fxdp: this {self._label} noise was planned ({self._planned}) for {self.planned_steps} steps and all "
                "have run: a further step would release more than the accounting covers. Build the mechanism with "
                "steps= the whole run's number of steps")

    def _check_cycle(self) -> None:
        if self._position is None:
            raise StepRefusedError(
                f"fxdp: {self._label} noise is private (and accounted) only when each sample can take part in one step "
                f"of every {self._separation} or more: train on a fxdp.data.CyclicPoissonDataLoader and call "
                "noise_mechanism.follow(loader) before the first step (make_private does)")
        if self.partition_fingerprint is not None and self._fingerprint_now != self.partition_fingerprint:
            raise StepRefusedError(
                "fxdp: the cyclic loader assigns the samples to partitions differently from the one this "
                f"{self._label} noise followed before (a resumed run with a fresh loader?): a sample could take part "
                "in steps closer than the accounting allows. Build the loader with the saved assignment "
                "(CyclicPoissonDataLoader(..., partition_of=old_loader.partition_of))")
        position = self._position()
        if position is None:
            raise StepRefusedError("fxdp: the cyclic loader has handed out no batch for this step; draw the batch "
                                   f"from the loader the {self._label} noise follows")
        offset = (position - self.steps) % self.partitions
        if self._offset is None:
            self._offset = offset
        elif offset != self._offset:
            raise StepRefusedError(
                f"fxdp: step {self.steps} of the {self._label} noise got a batch at cycle position {position}, and "
                f"the cycle expects {(self.steps + self._offset) % self.partitions}: a batch was skipped or reused (a "
                "pass over the loader left early, or a resumed run restarted the loader mid-cycle), so a sample "
                f"could take part in steps closer than {self._separation} apart. Consume the loader's batches in "
                "order, one per step, and leave a pass only after a whole number of cycles")

    def _cycle_state(self) -> dict:
        return {"steps": self.steps, "offset": self._offset, "partitions": self.partitions,
                "partition_fingerprint": self.partition_fingerprint}

    def _load_cycle_state(self, state: dict) -> None:
        if state["partitions"] is not None and self.partitions not in (None, state["partitions"]):
            raise ValueError(f"fxdp: the checkpoint's {self._label} noise followed {state['partitions']} partitions, "
                             f"this one follows {self.partitions}")
        self.steps, self._offset = int(state["steps"]), state["offset"]
        self.partitions = state["partitions"] if self.partitions is None else self.partitions
        self.partition_fingerprint = state["partition_fingerprint"]


def check_plan(n: Any, min_separation: Any) -> None:
    """A plan's ``steps`` (``n``) and ``min_separation`` (or None) are ints >= 1 (BLT and the tree take them)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PrivacySettingError(f"fxdp: steps (the number of steps planned) must be an int >= 1, got {n!r}")
    if min_separation is not None and (isinstance(min_separation, bool) or not isinstance(min_separation, int)
                                       or min_separation < 1):
        raise PrivacySettingError(f"fxdp: min_separation must be an int >= 1, got {min_separation!r}")
