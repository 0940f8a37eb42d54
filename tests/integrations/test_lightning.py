"""fxdp.integrations.lightning.DPCallback: a LightningModule trained by pytorch_lightning.Trainer with DP-SGD.

Each step is checked against an independent computation: every sample of the very batch Lightning trained run
alone in float64, its gradient clipped by hand, the clipped gradients summed and divided by the expected batch
size (noise 0). The accountant's steps, the ε logged every epoch, checkpoints that carry the accountant, and the
Trainer settings DP-SGD cannot train with (refused before anything moves) are checked too."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fxdp.accounting import create_accountant
from fxdp.diagnostics import PrivacySettingError
from fxdp.sinks.contract import StepRefusedError

pl = pytest.importorskip("pytorch_lightning")
from fxdp.integrations.lightning import CHECKPOINT_KEY, DPCallback  # noqa: E402

N, BATCH, LR, CLIP = 12, 4, 0.5, 0.3  # rate 1/3: an empty batch has probability (2/3)^12, rare but allowed


def dataset(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))


class Classifier(pl.LightningModule):
    """Keeps every batch its training_step got (as Lightning handed it over)."""

    def __init__(self, data: TensorDataset = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        self.data = data if data is not None else dataset()
        self.batches = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH)


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=BATCH)


class NoData(Classifier):
    train_dataloader = pl.LightningModule.train_dataloader


class Epsilons(pl.loggers.Logger):
    """What a logger receives: the metrics Lightning logs, with their step."""

    def __init__(self):
        super().__init__()
        self.logged = []

    name, version = "record", 0

    def log_metrics(self, metrics, step=None):
        self.logged.append(dict(metrics))

    def log_hyperparams(self, *args, **kwargs):
        pass


def trainer(callback, **settings):
    options = dict(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1)
    options.update(settings)
    return pl.Trainer(callbacks=[callback], **options)


def clipped_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor, bound: float, expected_batch: int) -> None:
    """p -= LR * Σ_i clip(g_i) / expected batch, each g_i from sample i alone."""
    params = list(net.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(F.cross_entropy(net(x[i:i + 1]), y[i:i + 1]), params)
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        factor = min(1.0, bound / (norm.item() + 1e-6))
        total = [t + g * factor for t, g in zip(total, grads)]
    with torch.no_grad():
        for p, t in zip(params, total):
            p -= LR * t / expected_batch


def independent_epsilon(sigma: float, rate: float, steps: int, delta: float) -> float:
    accountant = create_accountant("rdp")  # (the tests of ε use RDP: PLD's is the same call, and slower)
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=rate)
    return accountant.get_epsilon(delta)


class Validated(Classifier):
    """Validation (in eval mode, without gradients) between the training epochs, and before them (sanity check)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def val_dataloader(self):
        return DataLoader(dataset(5), batch_size=5)


def test_every_step_is_the_clipped_sum_of_the_batch_lightning_trained():
    module = Validated()
    reference = copy.deepcopy(module.net)
    callback = DPCallback(max_grad_norm=CLIP, noise_multiplier=0.0, target_delta=1e-3)
    trainer(callback, max_epochs=3, num_sanity_val_steps=1).fit(module)
    assert "val_loss" in module.trainer.callback_metrics
    steps = 3 * math.ceil(N / BATCH)
    assert len(module.batches) == steps == callback.optimizer.steps
    sizes = [x.shape[0] for x, _ in module.batches]
    assert len(set(sizes)) > 1, sizes  # Poisson batches: their sizes vary
    assert callback.optimizer.expected_batch_size == BATCH
    for x, y in module.batches:
        clipped_step(reference, x, y, CLIP, BATCH)
    for (name, p), q in zip(module.net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10, msg=name)
    assert not torch.equal(module.net[0].weight, Classifier().net[0].weight)


def test_an_empty_poisson_batch_is_a_noise_only_step():
    """Three samples at rate 1/3: empty batches are frequent; each still steps (and is counted)."""
    torch.manual_seed(5)
    module = Classifier(dataset(3))
    reference = copy.deepcopy(module.net)

    def loader():
        return DataLoader(module.data, batch_size=1)
    module.train_dataloader = loader
    callback = DPCallback(max_grad_norm=CLIP, noise_multiplier=0.0, target_delta=1e-3)
    trainer(callback, max_epochs=6).fit(module)
    sizes = [x.shape[0] for x, _ in module.batches]
    assert 0 in sizes and len(sizes) == 18 == len(callback.privacy_engine.accountant), sizes
    for x, y in module.batches:
        clipped_step(reference, x, y, CLIP, 1)
    for p, q in zip(module.net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10)


def test_epsilon_is_logged_every_epoch_as_an_independent_accountant_computes_it():
    logger = Epsilons()
    callback = DPCallback(max_grad_norm=1.0, noise_multiplier=1.1, target_delta=1e-3, accountant="rdp")
    trainer(callback, max_epochs=3, logger=logger, log_every_n_steps=1).fit(Classifier())
    per_epoch = math.ceil(N / BATCH)
    assert callback.privacy_engine.accountant.history == [(1.1, 1 / per_epoch, 3 * per_epoch)]
    logged = [entry["epsilon"] for entry in logger.logged if "epsilon" in entry]
    expected = [independent_epsilon(1.1, 1 / per_epoch, per_epoch * e, 1e-3) for e in (1, 2, 3)]
    assert logged == pytest.approx(expected, rel=1e-6)
    assert callback.get_epsilon() == pytest.approx(expected[-1], rel=1e-9)


def test_a_target_epsilon_is_met_over_max_epochs_with_a_datamodule():
    callback = DPCallback(max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-3, accountant="rdp")
    module = Classifier()
    trainer(callback, max_epochs=4).fit(module, datamodule=Data())
    assert len(callback.privacy_engine.accountant) == 4 * math.ceil(N / BATCH)
    assert 0.99 * 2.0 <= callback.get_epsilon() <= 2.0


def test_a_checkpoint_keeps_the_accountant_and_a_resumed_fit_counts_on_from_it(tmp_path):
    first = DPCallback(max_grad_norm=1.0, noise_multiplier=1.1, target_delta=1e-3, accountant="rdp")
    run = trainer(first, max_epochs=1)
    run.fit(Classifier())
    path = str(tmp_path / "one_epoch.ckpt")
    run.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved[CHECKPOINT_KEY]["accountant"] == first.privacy_engine.accountant.state_dict()
    per_epoch = math.ceil(N / BATCH)

    resumed = DPCallback(max_grad_norm=1.0, noise_multiplier=1.1, target_delta=1e-3, accountant="rdp")
    module = Classifier()
    trainer(resumed, max_epochs=3).fit(module, ckpt_path=path)
    assert len(module.batches) == 2 * per_epoch  # the first epoch is not trained again
    assert resumed.privacy_engine.accountant.history == [(1.1, 1 / per_epoch, 3 * per_epoch)]
    assert resumed.get_epsilon() == pytest.approx(independent_epsilon(1.1, 1 / per_epoch, 3 * per_epoch, 1e-3))


def test_a_second_fit_with_the_same_callback_is_refused_and_says_how_to_train_on():
    callback = DPCallback(max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-3, accountant="rdp")
    module = Classifier()
    trainer(callback, max_epochs=1).fit(module)
    after = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(PrivacySettingError, match="has made a fit private already.*fit with a new DPCallback and ckpt"):
        trainer(callback, max_epochs=2).fit(module)
    assert all(torch.equal(a, p) for a, p in zip(after, module.parameters()))
    assert len(callback.privacy_engine.accountant) == 3


def test_resuming_from_a_checkpoint_without_the_accountant_is_refused(tmp_path):
    plain = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False)
    plain.fit(Classifier())
    path = str(tmp_path / "plain.ckpt")
    plain.save_checkpoint(path)
    callback = DPCallback(max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-3)
    with pytest.raises(PrivacySettingError, match="cannot resume from this checkpoint: it holds no privacy accountant"):
        trainer(callback, max_epochs=2).fit(Classifier(), ckpt_path=path)
    assert len(callback.privacy_engine.accountant) == 0


@pytest.mark.parametrize("settings, words", [
    (dict(accumulate_grad_batches=2), "accumulate_grad_batches=2: one Poisson batch is one private step"),
    (dict(precision="bf16-mixed"), "precision='bf16-mixed': only 32-true and 64-true are supported"),
    (dict(precision="bf16-true"), "precision='bf16-true': only 32-true and 64-true are supported"),
    (dict(gradient_clip_val=1.0), "gradient_clip_val=1.0: it clips the batch's gradient"),
    (dict(overfit_batches=2), "overfit_batches=2: it replaces the Poisson sampler"),
])
def test_trainer_settings_dp_cannot_train_with_are_refused_before_anything_moves(settings, words):
    module = Classifier()
    before = [p.detach().clone() for p in module.parameters()]
    callback = DPCallback(max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-3)
    with pytest.raises(PrivacySettingError, match="DPCallback cannot train with these Trainer settings") as info:
        trainer(callback, **settings).fit(module)
    assert words in str(info.value)
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters()))
    assert module.batches == [] and len(callback.privacy_engine.accountant) == 0


def test_64_bit_precision_trains_and_steps_as_computed_by_hand():
    module = Classifier()
    module.net.float()
    reference = copy.deepcopy(module.net).double()
    callback = DPCallback(max_grad_norm=CLIP, noise_multiplier=0.0, target_delta=1e-3)
    trainer(callback, max_epochs=1, precision="64-true").fit(module)
    assert module.net[0].weight.dtype == torch.float64 and len(module.batches) == 3
    for x, y in module.batches:
        clipped_step(reference, x, y, CLIP, BATCH)
    for p, q in zip(module.net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10)


def test_a_loader_given_to_fit_is_refused_it_cannot_be_made_poisson():
    with pytest.raises(PrivacySettingError, match="a loader given to trainer.fit.train_dataloaders=.... cannot be"):
        trainer(DPCallback(max_grad_norm=1.0, noise_multiplier=1.0)).fit(
            NoData(), train_dataloaders=DataLoader(dataset(), batch_size=BATCH))


def test_an_optimizer_with_a_scheduler_is_refused():
    class Scheduled(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=LR)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    with pytest.raises(PrivacySettingError, match="learning-rate schedulers returned with it, are not supported"):
        trainer(DPCallback(max_grad_norm=1.0, noise_multiplier=1.0)).fit(Scheduled())


class Manual(Classifier):
    """Manual optimization: training_step steps the optimizer itself."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()


def test_manual_optimization_is_refused_before_anything_moves():
    """Lightning's LightningOptimizer keeps a copy of the optimizer's attributes: DPOptimizer.zero_grad through it
    would reset the copy, not the DP optimizer."""
    module = Manual()
    before = [p.detach().clone() for p in module.parameters()]
    callback = DPCallback(max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-3)
    with pytest.raises(PrivacySettingError, match="DPCallback trains with Lightning's automatic optimization only; "
                                                  "Manual sets automatic_optimization = False"):
        trainer(callback).fit(module)
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters())) and module.batches == []


def test_two_steps_on_one_batch_are_refused_as_in_a_plain_loop():
    """The DP optimizer's flow rules hold under Lightning: a second step on the batch Lightning stepped on is
    refused (the optimizer's own check, as in a plain loop)."""
    class Twice(Classifier):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.trainer.optimizers[0].step()

    callback = DPCallback(max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-3)
    with pytest.raises(StepRefusedError, match="step.. was called again without optimizer.zero_grad.. since the last"):
        trainer(callback).fit(Twice())
    assert len(callback.privacy_engine.accountant) == 1  # the first step, and no other
