"""Schedules for the noise multiplier and the clipping bound, with Opacus's names and signatures.

A scheduler changes the DP optimizer's ``noise_multiplier`` (or ``max_grad_norm``) through its checked
setter; :meth:`step` is called once per epoch (or per step, as the user schedules). The accountant records,
at every optimizer step, the noise multiplier the optimizer has at that step, so the privacy spent follows
the schedule whatever its shape (and a larger clipping bound needs no accounting change: the noise std is
``noise_multiplier * max_grad_norm``, so the noise multiplier alone sets the privacy of a step).

``value(epoch)`` is ``base * factor(epoch)``, ``base`` the optimizer's value when the scheduler was built;
the constructor applies epoch 0 (the base itself), each :meth:`step` the next epoch.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

_EXCLUDED_FROM_STATE = ("optimizer", "noise_lambda", "scheduler_function")


class _Scheduler:
    _attribute = ""  # the optimizer's setting this schedules

    def __init__(self, optimizer: Any, *, last_epoch: int = -1):
        self.optimizer = optimizer
        self.base = getattr(optimizer, self._attribute)
        if isinstance(self.base, (list, tuple)):
            raise TypeError(f"fxdp: {type(self).__name__} schedules one {self._attribute}; this optimizer has "
                            "per-layer bounds (clipping='per_layer'). Set optimizer.max_grad_norm to a new list "
                            "yourself between epochs")
        self.last_epoch = last_epoch
        self.step()

    def factor(self, epoch: int) -> float:
        raise NotImplementedError

    def step(self, epoch: Optional[int] = None) -> None:
        """Apply the next epoch's value (``epoch``'s when given)."""
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        setattr(self.optimizer, self._attribute, self.base * self.factor(self.last_epoch))

    def state_dict(self) -> Dict[str, Any]:
        """Every field but the optimizer and a user's function (which cannot be saved with weights_only)."""
        return {k: v for k, v in self.__dict__.items() if k not in _EXCLUDED_FROM_STATE}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the optimizer's own checkpoint restores its current value)."""
        self.__dict__.update(state_dict)


class ExponentialNoise(_Scheduler):
    """``noise_multiplier = base * gamma ** epoch``."""

    _attribute = "noise_multiplier"

    def __init__(self, optimizer: Any, *, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.gamma ** epoch


class StepNoise(_Scheduler):
    """``noise_multiplier = base * gamma ** (epoch // step_size)``."""

    _attribute = "noise_multiplier"

    def __init__(self, optimizer: Any, *, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.gamma ** (epoch // self.step_size)


class LambdaNoise(_Scheduler):
    """``noise_multiplier = base * noise_lambda(epoch)``."""

    _attribute = "noise_multiplier"

    def __init__(self, optimizer: Any, *, noise_lambda: Callable[[int], float], last_epoch: int = -1):
        self.noise_lambda = noise_lambda
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.noise_lambda(epoch)


class ExponentialGradClip(ExponentialNoise):
    """``max_grad_norm = base * gamma ** epoch``."""

    _attribute = "max_grad_norm"


class StepGradClip(StepNoise):
    """``max_grad_norm = base * gamma ** (epoch // step_size)``."""

    _attribute = "max_grad_norm"


class LambdaGradClip(_Scheduler):
    """``max_grad_norm = base * scheduler_function(epoch)``."""

    _attribute = "max_grad_norm"

    def __init__(self, optimizer: Any, *, scheduler_function: Callable[[int], float], last_epoch: int = -1):
        self.scheduler_function = scheduler_function
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.scheduler_function(epoch)
