"""examples/train_digits.py's private digit classifier, trained by PyTorch Lightning with fxdp's DPCallback.

    pip install -e ".[examples,lightning]" && python examples/train_digits_lightning.py

The data (scikit-learn's digits, nothing downloaded), the model and the hyper-parameters are those of
examples/train_digits.py. The LightningModule is written as for non-private training; ``DPCallback`` makes the fit
private: a Poisson-sampled training loader, the DP optimizer (per-sample clipping, Gaussian noise calibrated to
``--target-epsilon`` over ``--epochs``), and ε logged after every epoch. The script prints the test accuracy and ε
after every epoch. ``--checkpoint PATH`` saves Lightning's checkpoint at the end (the accountant's history in it);
``--resume PATH`` continues a fit from one, counting the privacy already spent.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from train_digits import load_digits_split, make_model  # the script's own folder is on sys.path

try:
    import pytorch_lightning as pl
except ImportError as error:
    raise SystemExit('this example needs PyTorch Lightning: pip install -e ".[examples,lightning]"') from error


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Private training (DP-SGD) on digits with PyTorch Lightning and fxdp.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=256, help="expected (Poisson) batch size")
    parser.add_argument("--lr", type=float, default=1.0, help="SGD learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--accountant", default="pld", choices=["pld", "rdp"],
                        help="pld: privacy-loss distributions, the tightest bound (the default); rdp: Renyi DP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-subset", type=int, default=None, help="train on the first N training samples only")
    parser.add_argument("--checkpoint", metavar="PATH", default=None, help="save Lightning's checkpoint at the end")
    parser.add_argument("--resume", metavar="PATH", default=None, help="continue a fit from this checkpoint")
    return parser.parse_args(argv)


class DigitClassifier(pl.LightningModule):
    """An ordinary LightningModule: nothing in it is about privacy."""

    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.net = make_model()
        self.train_set, self.test_set = load_digits_split(args.train_subset)

    def forward(self, images):
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if len(labels) == 0:  # an empty Poisson batch: the loss is 0, and the step still adds its noise
            return self(images).sum()
        return F.cross_entropy(self(images), labels)

    def validation_step(self, batch, batch_idx):  # the test set is not private: it never touches the training
        images, labels = batch
        self.log("test_accuracy", (self(images).argmax(dim=1) == labels).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.args.lr)

    def train_dataloader(self):  # an ordinary loader: DPCallback replaces it by a Poisson one (rate batch / N)
        return DataLoader(self.train_set, batch_size=self.args.batch_size)

    def val_dataloader(self):
        return DataLoader(self.test_set, batch_size=len(self.test_set))


class PrintEpochs(pl.Callback):
    """Prints the test accuracy (validation runs at the end of each training epoch) and the ε spent so far."""

    def __init__(self, privacy, delta: float):
        self.privacy, self.delta, self.history = privacy, delta, []

    def on_train_epoch_end(self, trainer, pl_module):
        epoch, accuracy = trainer.current_epoch + 1, float(trainer.callback_metrics["test_accuracy"])
        epsilon = self.privacy.get_epsilon()  # what DPCallback logs as "epsilon" for this epoch
        self.history.append((epoch, accuracy, epsilon))
        print(f"epoch {epoch:3d}   test accuracy {100 * accuracy:5.1f}%   epsilon {epsilon:.2f} (delta {self.delta:g})")


def main(argv: Optional[List[str]] = None) -> List[tuple]:
    args = parse_args(argv)
    from fxdp.integrations.lightning import DPCallback

    torch.manual_seed(args.seed)
    privacy = DPCallback(max_grad_norm=args.max_grad_norm, target_epsilon=args.target_epsilon, target_delta=args.delta,
                         accountant=args.accountant)
    printer = PrintEpochs(privacy, args.delta)
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, callbacks=[privacy, printer],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(DigitClassifier(args), ckpt_path=args.resume)
    optimizer = privacy.optimizer
    print(f"noise multiplier {optimizer.noise_multiplier:.3f}, clipping at C = {optimizer.max_grad_norm}, "
          f"Poisson sampling at rate {privacy.data_loader.sample_rate:.4f}, {optimizer.steps} private steps")
    if args.checkpoint:
        trainer.save_checkpoint(args.checkpoint)
        print(f"checkpoint written to {args.checkpoint}")
    _, accuracy, epsilon = printer.history[-1]
    print(f"final: test accuracy {100 * accuracy:.1f}% at epsilon {epsilon:.2f}, delta {args.delta:g}")
    return printer.history


if __name__ == "__main__":
    main()
