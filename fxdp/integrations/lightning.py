"""Private training with PyTorch Lightning (extra ``lightning``: the ``pytorch-lightning`` package)::

    from fxdp.integrations.lightning import DPCallback

    trainer = pytorch_lightning.Trainer(max_epochs=10, callbacks=[DPCallback(max_grad_norm=1.0, target_epsilon=3.0,
                                                                             target_delta=1e-5)])
    trainer.fit(module)        # ε logged as "epsilon" after every epoch; the accountant travels in the checkpoints

The callback changes three things of ``trainer.fit``, all through :meth:`fxdp.PrivacyEngine.make_private` (with
``wrap_model=False``: the LightningModule itself records the per-sample gradients, so ``training_step``, validation
and Lightning's checkpoints use it as they are):

- the training loader (from ``LightningModule.train_dataloader`` or the ``LightningDataModule``'s) is replaced by a
  Poisson one (each sample in each batch with rate ``1 / len(loader)``);
- the optimizer ``configure_optimizers`` returns is wrapped in a :class:`fxdp.optim.DPOptimizer` (each sample's
  gradient clipped, Gaussian noise, one accountant step per optimizer step);
- ``epsilon`` is logged with ``pl_module.log`` at the end of every training epoch, and the accountant's history is
  saved in every checkpoint and restored when a fit resumes from one (a checkpoint without it is refused).

The DP optimizer's flow rules (one Poisson batch per step, ``zero_grad`` before each step, a step only on a batch
the private loader handed out) hold as in a plain loop. Lightning fetches one batch ahead of the one it trains, so
the loader's report of each batch to the optimizer is held back until Lightning starts training that batch
(``on_train_batch_start``).

Refused with :class:`~fxdp.diagnostics.PrivacySettingError` at ``setup``, before anything moves:
``accumulate_grad_batches != 1`` (one Poisson batch is one private step), precisions other than ``"32-true"`` and
``"64-true"`` (mixed precision's loss scaling and casts are not verified with fxdp's clipping here),
manual optimization (``automatic_optimization = False``: Lightning's optimizer wrapper keeps its own copy of the
optimizer's attributes, so the DP optimizer's ``zero_grad`` would not reach it), ``gradient_clip_val`` (it would
clip the batch's gradient; DP-SGD clips each sample's, to ``max_grad_norm``), several
processes or devices, ``overfit_batches``, more than one optimizer, learning-rate schedulers returned by
``configure_optimizers`` (not wired to the DP optimizer yet), and training data given to ``fit(train_dataloaders=...)``
(the callback must replace the loader; give it through ``train_dataloader`` or a datamodule). At the start of every
training epoch the loader Lightning iterates is checked to be the private one.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, Optional

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from fxdp.data.loader import is_empty_batch
from fxdp.diagnostics import PrivacySettingError
from fxdp.privacy_engine import PrivacyEngine
from fxdp.sinks.contract import StepRefusedError

CHECKPOINT_KEY = "fxdp_privacy"
SUPPORTED_PRECISIONS = ("32-true", "64-true")


class DPCallback(pl.Callback):
    """Trains the fitted ``LightningModule`` with DP-SGD (see the module's docstring). Give ``noise_multiplier`` or
    ``target_epsilon`` (then the noise is the least that spends at most ``target_epsilon`` at ``target_delta`` over
    ``epochs``, by default the trainer's ``max_epochs``). ``target_delta``: the δ of the ε logged, by default
    ``1 / len(training dataset)``. ``noise_generator``: a ``torch.Generator`` for reproducible noise.
    ``callback.privacy_engine`` holds the accountant; :meth:`get_epsilon` gives the ε spent."""

    def __init__(self, *, max_grad_norm: float, noise_multiplier: Optional[float] = None,
                 target_epsilon: Optional[float] = None, target_delta: Optional[float] = None,
                 epochs: Optional[float] = None, accountant: str = "pld", secure_mode: bool = False,
                 noise_generator: Optional[torch.Generator] = None, log_name: str = "epsilon"):
        if (noise_multiplier is None) == (target_epsilon is None):
            raise PrivacySettingError("fxdp: DPCallback needs exactly one of noise_multiplier and target_epsilon "
                                      f"(got noise_multiplier={noise_multiplier}, target_epsilon={target_epsilon})")
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.epochs = epochs
        self.noise_generator = noise_generator
        self.log_name = log_name
        self.privacy_engine = PrivacyEngine(accountant=accountant, secure_mode=secure_mode)
        self.optimizer = None
        self.data_loader: Optional[DataLoader] = None
        self._dataset_size: Optional[int] = None
        self._pending: Deque[Dict[str, Any]] = collections.deque()

    # -- what the user reads ------------------------------------------------------------------------

    @property
    def delta(self) -> float:
        if self.target_delta is not None:
            return self.target_delta
        if self._dataset_size is None:
            raise PrivacySettingError("fxdp: DPCallback: δ defaults to 1 / len(training dataset), which is known once "
                                      "fit has started; pass target_delta= to read ε before")
        return 1.0 / self._dataset_size

    def get_epsilon(self) -> float:
        """The ε spent by the private steps taken so far (restored ones included), at :attr:`delta`."""
        return self.privacy_engine.get_epsilon(self.delta)

    # -- Lightning's hooks -----------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        if self.optimizer is not None:
            raise PrivacySettingError(
                "fxdp: this DPCallback has made a fit private already; a second trainer.fit with it would wrap the "
                "module a second time. To train on, save a checkpoint (trainer.save_checkpoint) and fit with a new "
                "DPCallback and ckpt_path=...: the accountant's history travels in the checkpoint")
        _refuse_what_is_not_private(trainer)
        if not pl_module.automatic_optimization:
            raise PrivacySettingError(
                f"fxdp: DPCallback trains with Lightning's automatic optimization only; {type(pl_module).__name__} "
                "sets automatic_optimization = False. The optimizer self.optimizers() returns is Lightning's wrapper, "
                "which keeps its own copy of the optimizer's attributes: the DP optimizer's zero_grad and "
                "signal_skip_step called through it would not reach the DP optimizer. Use automatic optimization, or "
                "fxdp.PrivacyEngine.make_private in a loop of your own")
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        if type(source).train_dataloader in (pl.LightningModule.train_dataloader,
                                             pl.LightningDataModule.train_dataloader):
            raise PrivacySettingError(
                f"fxdp: DPCallback needs the training data from {type(pl_module).__name__}.train_dataloader or a "
                "LightningDataModule's train_dataloader, to replace it by a Poisson-sampled loader; a loader given "
                "to trainer.fit(train_dataloaders=...) cannot be replaced. Return it from train_dataloader instead")
        callback = self
        user_loader = source.train_dataloader
        user_optimizers = pl_module.configure_optimizers

        def configure_optimizers():
            return callback._make_private(pl_module, user_optimizers(), user_loader)

        def train_dataloader():
            if callback.data_loader is None:
                raise PrivacySettingError("fxdp: DPCallback: the training loader was asked for before "
                                          "configure_optimizers ran; the private loader does not exist yet")
            return callback.data_loader

        # Lightning calls these public hooks itself; the instance attributes route them through the callback
        pl_module.configure_optimizers = configure_optimizers
        source.train_dataloader = train_dataloader

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.train_dataloader is not self.data_loader:
            raise PrivacySettingError(
                f"fxdp: Lightning is iterating a {type(trainer.train_dataloader).__name__}, not the Poisson loader "
                "DPCallback made: its batches would be accounted as Poisson samples they are not. Give the "
                "training data through train_dataloader (not fit(train_dataloaders=...)), and do not replace the "
                "loader (use_distributed_sampler, overfit_batches, reload hooks)")

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        """The loader's report of this batch, held back since Lightning fetched it, goes to the optimizer now."""
        if not self._pending:
            raise StepRefusedError(
                f"fxdp: Lightning started training batch {batch_idx}, but DPCallback's Poisson loader has handed "
                "out no batch that was not trained yet: this batch came from elsewhere and would be accounted as a "
                "Poisson sample it is not")
        report = self._pending.popleft()
        if bool(report["empty"]) != is_empty_batch(batch):
            raise StepRefusedError(
                f"fxdp: batch {batch_idx} that Lightning trains is {'not ' if report['empty'] else ''}empty, but the "
                "Poisson loader's next batch was the opposite: the batches no longer match the loader's order")
        self.optimizer.observe_batch(**report)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        pl_module.log(self.log_name, self.get_epsilon(), on_step=False, on_epoch=True, prog_bar=True)

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: Dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {"accountant": self.privacy_engine.accountant.state_dict(),
                                      "accountant_name": self.privacy_engine.accountant_name}

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: Dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            raise PrivacySettingError(
                "fxdp: DPCallback cannot resume from this checkpoint: it holds no privacy accountant (it was not "
                "saved by a fit with DPCallback), so the resumed run would not count the privacy already spent. "
                "Train from the start, or resume from a checkpoint saved with DPCallback")
        if saved["accountant_name"] != self.privacy_engine.accountant_name:
            raise PrivacySettingError(f"fxdp: the checkpoint's accountant is {saved['accountant_name']!r}, this "
                                      f"DPCallback's {self.privacy_engine.accountant_name!r}: use the same accountant")
        self.privacy_engine.accountant.load_state_dict(saved["accountant"])

    # -- make_private --------------------------------------------------------------------------------

    def _make_private(self, pl_module: "pl.LightningModule", configured: Any, user_loader) -> Any:
        optimizer = _the_one_optimizer(configured)
        loader = user_loader()
        if not isinstance(loader, DataLoader):
            raise PrivacySettingError(f"fxdp: DPCallback needs train_dataloader to return one torch DataLoader, got "
                                      f"{type(loader).__name__}")
        self._dataset_size = len(loader.dataset)
        settings: Dict[str, Any] = dict(module=pl_module, optimizer=optimizer, data_loader=loader,
                                        max_grad_norm=self.max_grad_norm, wrap_model=False,
                                        noise_generator=self.noise_generator)
        if self.noise_multiplier is not None:
            private = self.privacy_engine.make_private(noise_multiplier=self.noise_multiplier, **settings)
        else:
            epochs = self.epochs if self.epochs is not None else pl_module.trainer.max_epochs
            if epochs is None or epochs < 1:
                raise PrivacySettingError("fxdp: DPCallback(target_epsilon=...) needs the number of epochs to "
                                          "calibrate the noise to: set Trainer(max_epochs=...) or "
                                          "DPCallback(epochs=...)")
            private = self.privacy_engine.make_private_with_epsilon(
                target_epsilon=self.target_epsilon, target_delta=self.delta, epochs=epochs, **settings)
        _, self.optimizer, self.data_loader = private
        self.data_loader.batch_observer = self._hold_back
        self._pending.clear()
        return self.optimizer

    def _hold_back(self, **report: Any) -> None:
        """The Poisson loader's report of a batch it hands out, kept until Lightning trains that batch. A new pass over
        the loader forgets batches fetched ahead and never trained (drawn, but never used: no privacy spent)."""
        if report.get("new_epoch"):
            self._pending.clear()
        self._pending.append(report)


def _the_one_optimizer(configured: Any) -> torch.optim.Optimizer:
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict) and set(configured) == {"optimizer"}:
        return _the_one_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and len(configured) == 1:
        return _the_one_optimizer(configured[0])
    raise PrivacySettingError(
        "fxdp: DPCallback needs configure_optimizers to return one torch optimizer (alone, in a list, or as "
        f"{{'optimizer': ...}}), got {type(configured).__name__}: several optimizers, and learning-rate schedulers "
        "returned with it, are not supported by DPCallback yet")


def _refuse_what_is_not_private(trainer: "pl.Trainer") -> None:
    problems = []
    if trainer.accumulate_grad_batches != 1:
        problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}: one Poisson batch is one private "
                        "step (raise the loader's batch_size instead, and leave accumulate_grad_batches at 1)")
    if str(trainer.precision) not in SUPPORTED_PRECISIONS:
        problems.append(f"precision={trainer.precision!r}: only {' and '.join(SUPPORTED_PRECISIONS)} are supported "
                        "(mixed precision's casts and loss scaling are not verified with fxdp's clipping here)")
    if trainer.gradient_clip_val:
        problems.append(f"gradient_clip_val={trainer.gradient_clip_val}: it clips the batch's gradient, which the DP "
                        "optimizer replaces; DP-SGD clips each sample's gradient to DPCallback(max_grad_norm=...)")
    if trainer.world_size > 1 or trainer.num_devices > 1:
        problems.append(f"{trainer.world_size} processes / {trainer.num_devices} devices: DPCallback trains in one "
                        "process on one device (see docs/distributed.md for fxdp's DDP in a loop of your own)")
    if trainer.overfit_batches:
        problems.append(f"overfit_batches={trainer.overfit_batches}: it replaces the Poisson sampler")
    if problems:
        raise PrivacySettingError("fxdp: DPCallback cannot train with these Trainer settings:\n  - "
                                  + "\n  - ".join(problems))
