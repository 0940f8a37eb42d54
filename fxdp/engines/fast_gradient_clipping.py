"""Opacus's fast gradient (ghost) clipping classes, served by fxdp's book-keeping sink.

In Opacus, ghost clipping takes two backward passes: one for per-sample norms, one on the loss re-weighted
by the clip factors. fxdp's :class:`~fxdp.sinks.bookkeeping.BookkeepingSink` gets the per-sample norms
and each layer's clipped sum from ONE backward pass (the compiled graph's default, ``make_private``'s
``grad_sample_mode="fx"``), so these classes are thin:

- :class:`GradSampleModuleFastGradientClipping` / :class:`GradSampleHooksFastGradientClipping` are the
  hooks engine (wrapping the model, or hooks on it) delivering to a book-keeping sink;
- :class:`DPLossFastGradientClipping` computes the per-sample loss and returns a
  :class:`DPTensorFastGradientClipping`, whose ``backward()`` is one ordinary backward of the reduced loss;
  the DP optimizer then clips, sums and adds noise in ``step()`` (it reads the module's sink).

``p.grad`` is written by the optimizer's step; between backward and step it holds nothing for the layers the
sink book-keeps. ``p.grad_sample`` is ``None`` on every trainable parameter (set when the class is built, as
Opacus's ghost clipping leaves it after backward): the per-sample gradients are never materialised, whether
``use_ghost_clipping`` is on or off; ``get_norm_sample()`` gives their norms.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fxdp.engines.hooks import GradSampleHooks, GradSampleModule
from fxdp.runtime.guards import GUARD_ATTR
from fxdp.runtime.loss_probe import add_loss_report, plain, warn_of
from fxdp.sinks.bookkeeping import BookkeepingSink
from fxdp.sinks.contract import SINK_ATTR, clip_factor, sink_of


class _FastGradientClipping:
    """The clipping bound and the per-sample norms' read side shared by the two classes below."""

    def _init_clipping(self, max_grad_norm: float, use_ghost_clipping: bool) -> None:
        if not max_grad_norm > 0:
            raise ValueError(f"fxdp: max_grad_norm must be positive, got {max_grad_norm!r}")
        self.max_grad_norm = float(max_grad_norm)
        self.use_ghost_clipping = use_ghost_clipping
        for p in self.trainable_parameters:  # as Opacus's ghost clipping leaves it: no per-sample gradient is kept
            p.grad_sample = None

    @property
    def trainable_parameters(self):
        return [p for p in self._module.parameters() if p.requires_grad]

    def get_norm_sample(self) -> torch.Tensor:
        """Each sample's gradient norm over all trainable parameters, shape ``(N,)``, from the last backward."""
        norms = getattr(self, SINK_ATTR).squared_norms(self.trainable_parameters)
        if not norms:
            raise RuntimeError("fxdp: no per-sample norms recorded: run forward and backward first")
        return torch.stack([n.to(next(iter(norms.values())).device) for n in norms.values()]).sum(0).sqrt()

    def get_clipping_coef(self) -> torch.Tensor:
        """Each sample's clip factor ``min(1, max_grad_norm / norm)``, shape ``(N,)``."""
        return clip_factor(self.max_grad_norm, self.get_norm_sample())


class GradSampleModuleFastGradientClipping(_FastGradientClipping, GradSampleModule):
    """The hooks engine around ``m`` with a book-keeping sink: per-sample norms and clipped sums from one
    backward pass, without ``p.grad_sample`` (``use_ghost_clipping``: accepted; the sink picks, per
    layer, the cheaper of the ghost norm and the materialised one)."""

    def __init__(self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean",
                 strict: bool = False, max_grad_norm: float = 1.0, use_ghost_clipping: bool = True,
                 **kwargs):
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                         sink=BookkeepingSink(), **kwargs)
        self._init_clipping(max_grad_norm, use_ghost_clipping)


class GradSampleHooksFastGradientClipping(_FastGradientClipping, GradSampleHooks):
    """:class:`GradSampleModuleFastGradientClipping` as hooks on ``m`` (call ``m`` itself)."""

    def __init__(self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean",
                 strict: bool = False, max_grad_norm: float = 1.0, use_ghost_clipping: bool = True,
                 **kwargs):
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                         sink=BookkeepingSink(), **kwargs)
        self._init_clipping(max_grad_norm, use_ghost_clipping)


class DPTensorFastGradientClipping:
    """A batch's per-sample losses (``loss_per_sample``, one row per sample), reduced by ``loss_reduction``
    when read (:meth:`item`) or differentiated (:meth:`backward`). Arithmetic with numbers and other such
    losses acts on the per-sample losses."""

    def __init__(self, module, optimizer, loss_per_sample: torch.Tensor, loss_reduction: str = "mean"):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"fxdp: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.module = module
        self.optimizer = optimizer
        self.loss_per_sample = loss_per_sample
        self.loss_reduction = loss_reduction

    def _like(self, loss_per_sample: torch.Tensor) -> "DPTensorFastGradientClipping":
        return DPTensorFastGradientClipping(self.module, self.optimizer, loss_per_sample, self.loss_reduction)

    def _other(self, other):
        if isinstance(other, DPTensorFastGradientClipping):
            if other.loss_reduction != self.loss_reduction:
                raise ValueError(f"fxdp: cannot combine a {self.loss_reduction!r} loss with a "
                                 f"{other.loss_reduction!r} one")
            return other.loss_per_sample
        return other

    def __add__(self, other):
        return self._like(self.loss_per_sample + self._other(other))

    __radd__ = __add__

    def __sub__(self, other):
        return self._like(self.loss_per_sample - self._other(other))

    def __rsub__(self, other):
        return self._like(self._other(other) - self.loss_per_sample)

    def __mul__(self, other):
        return self._like(self.loss_per_sample * other)

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self._like(self.loss_per_sample / other)

    def __neg__(self):
        return self._like(-self.loss_per_sample)

    def reduced(self) -> torch.Tensor:
        """The loss over the batch: the per-sample losses' mean or sum over dimension 0."""
        reduce = torch.mean if self.loss_reduction == "mean" else torch.sum
        return reduce(self.loss_per_sample, dim=0)

    def detach(self) -> torch.Tensor:
        return self.reduced().detach()

    def item(self) -> float:
        return self.detach().item()

    def backward(self) -> None:
        """One backward pass of the reduced loss: the module's book-keeping sink records what the
        optimizer's step needs (per-sample norms, clip factors, clipped sums)."""
        self.reduced().backward()

    def __repr__(self) -> str:
        return (f"DPTensorFastGradientClipping(loss_reduction={self.loss_reduction}, "
                f"shape={tuple(self.loss_per_sample.shape)})")


class DPLossFastGradientClipping:
    """``criterion`` computing per-sample losses for ``module``'s batch: calling it returns a
    :class:`DPTensorFastGradientClipping`. The optimizer is pointed at ``module``'s gradient sink (a DP
    optimizer built without one would find no per-sample norms). ``shape=(B, T)``: a criterion that gives
    one loss per token (``B*T`` values) is reduced per sample over ``T`` (its ``ignore_index`` honoured)."""

    def __init__(self, module, optimizer, criterion, loss_reduction: str = "mean"):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"fxdp: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not hasattr(criterion, "reduction"):
            criterion.reduction = loss_reduction
        settings = {"loss_reduction": loss_reduction, "the criterion's reduction": criterion.reduction,
                    "the optimizer's loss_reduction": optimizer.loss_reduction}
        if isinstance(getattr(module, "loss_reduction", None), str):  # a compiled graph keeps it in its ops
            settings["the module's loss_reduction"] = module.loss_reduction
        if len(set(settings.values())) > 1:
            raise ValueError("fxdp: the loss reduction must be one across module, optimizer, criterion and "
                             f"DPLossFastGradientClipping; got {settings}")
        sink = sink_of(module)
        if sink is None:
            raise TypeError(f"fxdp: {type(module).__name__} computes no per-sample gradients; pass the model "
                            "GradSampleModuleFastGradientClipping (or make_private) returned")
        if getattr(optimizer, "sink", sink) is not sink:
            optimizer.sink = sink  # what its step reads: this module's per-sample norms and clipped sums
        self.module, self.optimizer, self.criterion, self.loss_reduction = module, optimizer, criterion, loss_reduction
        self._judged = False

    def _judge(self, args, kwargs) -> None:
        """The criterion, traced by torch.fx with the model's output as a batched input, judged by the batch rules
        before its first loss is computed (:mod:`fxdp.passes.loss`): an op that mixes samples raises, a normaliser
        set by the batch warns, ``fxdp.report(module)`` lists what it finds. A model that is no compiled graph, or
        a criterion torch.fx cannot trace, is judged by the loss probe on the first backward instead."""
        guard = getattr(self.module, GUARD_ATTR, None)
        if kwargs or guard is None or guard.reanalysis is None or guard.batch_size is None:
            return
        report = guard.reanalysis.judge_criterion(self.criterion, plain(args), guard.batch_size)
        if report is not None:
            warn_of(report)  # raises what mixes samples: judged again on the next call
            add_loss_report(self.module, report)
        self._judged = True

    def __call__(self, *args, shape: Optional[tuple] = None, **kwargs) -> DPTensorFastGradientClipping:
        reduction, self.criterion.reduction = self.criterion.reduction, "none"
        try:
            if not self._judged:
                self._judge(args, kwargs)
            loss_per_sample = self.criterion(*args, **kwargs)
        finally:
            self.criterion.reduction = reduction
        if shape is not None and loss_per_sample.shape[0] == shape[0] * shape[1]:
            loss_per_sample = loss_per_sample.view(shape[0], shape[1])
            if self.loss_reduction == "sum":
                loss_per_sample = loss_per_sample.sum(dim=1)
            else:
                ignore_index = getattr(self.criterion, "ignore_index", None)
                targets = kwargs.get("target", args[1] if len(args) >= 2 else None)
                if ignore_index is not None and targets is not None:
                    counted = (targets.view(shape[0], shape[1]) != ignore_index).sum(dim=1).clamp(min=1)
                    loss_per_sample = loss_per_sample.sum(dim=1) / counted
                else:
                    loss_per_sample = loss_per_sample.mean(dim=1)
        return DPTensorFastGradientClipping(self.module, self.optimizer, loss_per_sample, self.loss_reduction)
