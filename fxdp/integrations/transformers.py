"""Private training with Hugging Face ``transformers.Trainer`` (extra ``transformers``)::

    from fxdp.integrations.transformers import DPTrainer, PrivacyArguments

    trainer = DPTrainer(model=model, args=TrainingArguments(...), train_dataset=train, data_collator=collator,
                        privacy_args=PrivacyArguments(per_sample_max_grad_norm=1.0, target_epsilon=8.0))
    trainer.train()            # the logs carry "epsilon"
    trainer.save_model(path)   # the plain model's checkpoint (from_pretrained loads it without fxdp)

``DPTrainer`` is the Trainer with three things changed, all through :meth:`fxdp.PrivacyEngine.make_private`:
its training loader draws Poisson batches (each sample in each batch with rate ``1 / len(loader)``; the
Trainer's collator and column removal kept), its optimizer is a :class:`fxdp.optim.DPOptimizer` (each
sample's gradient clipped, Gaussian noise, one accountant step per optimizer step), and the training forward
runs the model compiled by fxdp (captured from a batch of the dataset's first samples; it shares its
parameters with ``trainer.model``, which evaluation and ``save_model`` use as they are).

The loss is computed outside the model, per sample (:func:`per_sample_loss`): a loss the model computes from
``labels`` is averaged over the whole batch (over all its tokens, for a language model), which would make each
sample's gradient depend on the others. For a causal language model each sample's loss is the mean over its
own target tokens (``labels`` of -100, the collators' padding, are not targets), so the training loss differs
from the Trainer's token-weighted one by that weighting. Pass ``per_sample_loss=`` for another loss.

Refused, each with an error saying why: gradient accumulation (a Poisson batch is one step), several
processes, fp16/bf16 mixed precision and ``torch_compile`` (not verified with fxdp yet), resuming from a
checkpoint (the accountant's history is not in it). The gradient norm the Trainer logs is left out (it would
be the norm of the batch's gradient before clipping and noise); the training loss is logged as the Trainer
does, computed on the private data, and not covered by ε (as in any DP library). The Trainer's own
``max_grad_norm`` (clipping of the batch gradient) is switched off: DP-SGD clips each sample's gradient to ``per_sample_max_grad_norm``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader

from fxdp.diagnostics import ExportShapeError, PrivacySettingError
from fxdp.per_sample_loss import IGNORE_INDEX, TASKS, per_sample_loss, task_of  # noqa: F401 (re-exported)
from fxdp.data.example_inputs import LABEL_KEYS
from fxdp.privacy_engine import PrivacyEngine

@dataclass
class PrivacyArguments:
    """DP-SGD's settings for :class:`DPTrainer`. Give ``noise_multiplier`` or ``target_epsilon`` (then the noise
    is the least that spends at most ``target_epsilon`` over the training's steps, at ``target_delta``).
    ``target_delta``: the δ of the ε logged (and targeted); by default ``1 / len(train_dataset)``."""

    per_sample_max_grad_norm: float = 1.0
    noise_multiplier: Optional[float] = None
    target_epsilon: Optional[float] = None
    target_delta: Optional[float] = None
    accountant: str = "pld"
    secure_mode: bool = False

    def check(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise PrivacySettingError("fxdp: PrivacyArguments needs exactly one of noise_multiplier and target_epsilon "
                                      f"(got noise_multiplier={self.noise_multiplier}, "
                                      f"target_epsilon={self.target_epsilon})")


class DPTrainer(transformers.Trainer):
    """``transformers.Trainer`` training with DP-SGD (see the module's docstring). ``privacy_args``: the DP
    settings; ``per_sample_loss``: ``(outputs, labels) -> (N,)``, by default :func:`per_sample_loss` with the
    model's task. ``trainer.privacy_engine`` holds the accountant; :meth:`get_epsilon` the ε spent."""

    def __init__(self, *args: Any, privacy_args: PrivacyArguments,
                 per_sample_loss: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        privacy_args.check()
        _refuse_what_is_not_private(self.args)
        self.args = copy.copy(self.args)
        self.args.max_grad_norm = 0.0  # the Trainer's clipping of the batch gradient: DP-SGD clips per sample
        self.privacy_args = privacy_args
        self.privacy_engine = PrivacyEngine(accountant=privacy_args.accountant, secure_mode=privacy_args.secure_mode)
        self._per_sample_loss = per_sample_loss
        self.private_model: Optional[nn.Module] = None
        self._dp_optimizer = None
        self._dp_loader: Optional[DataLoader] = None

    @property
    def delta(self) -> float:
        return self.privacy_args.target_delta or 1.0 / len(self.train_dataset)

    def get_epsilon(self) -> float:
        """The ε spent by the private steps taken so far, at :attr:`delta`."""
        return self.privacy_engine.get_epsilon(self.delta)

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint:
            raise PrivacySettingError(
                "fxdp: DPTrainer cannot resume from a checkpoint: the Trainer's checkpoints do not hold the "
                "accountant's history, so the resumed run would not count the privacy already spent. Train again "
                "from the start, or save and restore with fxdp.PrivacyEngine.save_checkpoint / load_checkpoint "
                "in a loop of your own")
        return super().train(None, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        if self._dp_loader is None:
            self._make_private()
        return self._dp_loader

    def _make_private(self) -> None:
        if self.train_dataset is None:
            raise ValueError("fxdp: DPTrainer: training requires a train_dataset")
        dataset, collate = self.train_dataset, self.data_collator
        if hasattr(self, "_remove_unused_columns") and type(dataset).__module__.startswith("datasets"):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        loader = DataLoader(dataset, batch_size=self._train_batch_size, collate_fn=collate,
                            num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available())
        optimizer = self.create_optimizer()
        settings: Dict[str, Any] = dict(module=self.model, optimizer=optimizer, data_loader=loader,
                                        max_grad_norm=self.privacy_args.per_sample_max_grad_norm)
        if self.privacy_args.noise_multiplier is not None:
            private = self.privacy_engine.make_private(noise_multiplier=self.privacy_args.noise_multiplier, **settings)
        else:
            steps = self.args.max_steps if self.args.max_steps > 0 else None
            epochs = steps / len(loader) if steps else self.args.num_train_epochs
            private = self.privacy_engine.make_private_with_epsilon(
                target_epsilon=self.privacy_args.target_epsilon, target_delta=self.delta, epochs=epochs, **settings)
        self.private_model, self._dp_optimizer, self._dp_loader = private
        self.optimizer = self._dp_optimizer  # the Trainer's create_optimizer keeps an optimizer it already has

    def training_step(self, model: nn.Module, inputs: Dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        if self._dp_optimizer is not None:  # the Trainer resets p.grad only; the DP optimizer's sink too
            self._dp_optimizer.zero_grad()
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch=None):
        if self.private_model is None or not model.training:  # evaluation: the plain model and its own loss
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        names = set(self.label_names or ()) | set(LABEL_KEYS)
        labels = [inputs[k] for k in (self.label_names or ["labels"]) if k in inputs]
        if len(labels) != 1:
            raise ValueError(f"fxdp: DPTrainer needs one label tensor in each batch (under {self.label_names}); "
                             f"the batch has {sorted(inputs)}")
        if labels[0].shape[0] == 0:  # an empty Poisson batch: the step adds noise only (models cannot run 0 rows)
            loss = torch.zeros((), device=labels[0].device, requires_grad=True)
            return (loss, None) if return_outputs else loss
        try:
            outputs = self.private_model(**{k: v for k, v in inputs.items() if k not in names})
        except ExportShapeError as exc:  # a batch the model could not be captured again for (not one graph)
            raise ExportShapeError(
                f"fxdp: DPTrainer: {exc} With the Trainer: have the data collator pad every batch to one length, "
                "e.g. DataCollatorWithPadding(tokenizer, padding='max_length', max_length=...), or tokenize with "
                "padding='max_length' (the model was captured from a batch of the dataset's first samples)") from exc
        if self._per_sample_loss is not None:
            losses = self._per_sample_loss(outputs, labels[0])
        else:
            losses = per_sample_loss(outputs.logits, labels[0], task_of(self.model))
        if losses.dim() != 1 or losses.shape[0] != labels[0].shape[0]:
            raise ValueError(f"fxdp: the per-sample loss must have shape (N,) = ({labels[0].shape[0]},), one loss per "
                             f"sample; got {tuple(losses.shape)}")
        loss = losses.sum() / max(losses.shape[0], 1)  # the mean (an empty Poisson batch: 0, still stepped)
        return (loss, outputs) if return_outputs else loss

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        """Not logged: before the step, the gradients are the batch's own, neither clipped nor noised, and logging
        their norm would publish what the accountant does not count."""
        return None

    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._dp_optimizer is not None:
            logs = {**logs, "epsilon": self.get_epsilon()}
        super().log(logs, *args, **kwargs)


def _refuse_what_is_not_private(args: transformers.TrainingArguments) -> None:
    problems = []
    if args.gradient_accumulation_steps != 1:
        problems.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps}: one Poisson batch is one "
                        "private step (set per_device_train_batch_size to the batch you want, and 1 here)")
    if args.world_size > 1 or args.n_gpu > 1:
        problems.append("several processes or GPUs: DPTrainer trains in one process (see docs/distributed.md for "
                        "fxdp's DDP)")
    if args.fp16 or args.bf16:
        problems.append("fp16/bf16 mixed precision: not verified with fxdp's per-sample clipping yet; train in float32")
    if getattr(args, "torch_compile", False):
        problems.append("torch_compile: not verified with fxdp's compiled model yet")
    if problems:
        raise PrivacySettingError("fxdp: DPTrainer cannot train with these TrainingArguments:\n  - "
                                  + "\n  - ".join(problems))
