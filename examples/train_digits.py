"""Train a digit classifier with differential privacy (DP-SGD) on scikit-learn's digits.

    pip install -e ".[examples]" && python examples/train_digits.py

The digits data set (1797 images of 8x8 pixels, 10 classes) ships inside scikit-learn: nothing is
downloaded. The script compiles the model with fxdp, prints its compile report, then trains with
Poisson sampling, per-sample clipping and Gaussian noise calibrated to the target epsilon, printing
the test accuracy and the epsilon spent after every epoch. ``--plot curve.png`` also draws them.

Every hyper-parameter is a command-line option (``--help``). With ``--noise-multiplier`` the noise is
fixed and epsilon is whatever it comes to; otherwise the noise is calibrated so that the whole run
spends ``--target-epsilon`` (default 3) at ``--delta`` (default 1e-5).

``--noise banded-mf`` or ``--noise blt`` adds noise correlated across steps instead of DP-SGD's independent
noise (docs/correlated_noise.md): banded matrix factorization (``--bands``, a strategy optimised for the run's
steps, with cyclic Poisson sampling) or a BLT (``--buffers``, optimised for the run's steps with each sample in one
fixed batch per epoch). The loader and the accountant change with it; ``--accountant pld`` only.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noise_options.py sits next to this file
from noise_options import add_noise_arguments, expected_error_against_dp_sgd, noise_mechanism_for, sampling_of  # noqa

SPLIT_SEED = 0  # the train/test split is the same for every --seed, so accuracies compare
TEST_FRACTION = 0.2


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Private training (DP-SGD) on scikit-learn's digits with fxdp.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=256,
                        help="expected (Poisson) batch size; the sampling rate is batch size / training set size")
    parser.add_argument("--lr", type=float, default=1.0, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument("--target-epsilon", type=float, default=3.0,
                       help="calibrate the noise so that the whole run spends this epsilon")
    noise.add_argument("--noise-multiplier", type=float, default=None,
                       help="fixed noise multiplier sigma (instead of --target-epsilon)")
    parser.add_argument("--delta", type=float, default=1e-5)
    add_noise_arguments(parser)
    parser.add_argument("--accountant", default="pld", choices=["pld", "rdp"],
                        help="pld: privacy-loss distributions, the tightest bound (the default); rdp: Renyi DP")
    parser.add_argument("--grad-sample-mode", default="fx", choices=["fx", "hooks", "ew", "functorch"],
                        help="fx: the compiled graph; hooks: the backward-hook engine")
    parser.add_argument("--max-physical-batch-size", type=int, default=None,
                        help="cut each logical batch into physical batches of at most this size "
                             "(BatchMemoryManager); the privacy accounting is unchanged")
    parser.add_argument("--secure-mode", action="store_true",
                        help="noise and sampling from the operating system's cryptographic source")
    parser.add_argument("--compile", action="store_true",
                        help="make_private(compile=True): the private model torch.compile'd (inductor), its Poisson "
                             "batches padded to a fixed size (docs/torch_compile.md)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation, sampling and noise")
    parser.add_argument("--train-subset", type=int, default=None,
                        help="train on the first N training samples only (quick runs and tests)")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="write a PNG of test accuracy and epsilon per epoch (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def load_digits_split(train_subset: Optional[int] = None):
    """(train, test) TensorDatasets of scikit-learn's digits: 8x8 images in [0, 1], int64 labels.

    Pixels are divided by their known maximum (16), not standardised with statistics of the
    training set: that would be a computation on private data outside the privacy accounting.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as error:
        raise SystemExit('this example needs scikit-learn: pip install "fxdp[examples]"') from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=labels.numpy()
    )
    train_idx, test_idx = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
    if train_subset is not None:
        train_idx = train_idx[:train_subset]
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[test_idx], labels[test_idx])


def make_model() -> nn.Module:
    """A small convolutional network for 8x8 digits (GroupNorm, not BatchNorm: batch norm mixes the
    samples of a batch, which DP-SGD cannot allow)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.GroupNorm(4, 16),
        nn.Tanh(),
        nn.MaxPool2d(2),  # 4x4
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        nn.Tanh(),
        nn.Linear(64, 10),
    )


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset) -> float:
    """Test accuracy (the test set is not private here: it never touches the training)."""
    was_training = model.training
    model.eval()
    images, labels = dataset.tensors
    accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
    model.train(was_training)
    return accuracy


def train(
    args: argparse.Namespace,
    privacy_engine,
    on_epoch: Optional[Callable[[int, float, float], None]] = None,
    progress: bool = True,
    on_private: Optional[Callable[[nn.Module, torch.optim.Optimizer, DataLoader], None]] = None,
    **make_private_kwargs,
):
    """Trains privately with ``privacy_engine`` (anything with fxdp's PrivacyEngine interface) and
    returns ``[(epoch, test accuracy, epsilon), ...]``. The caller seeds torch first.
    ``make_private_kwargs`` go to ``make_private`` / ``make_private_with_epsilon`` as they are."""
    train_set, test_set = load_digits_split(args.train_subset)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    # An ordinary loader: make_private replaces it by a Poisson loader with rate batch_size / N.
    loader = DataLoader(train_set, batch_size=args.batch_size)
    if getattr(args, "noise", "gaussian") != "gaussian":
        make_private_kwargs = dict(make_private_kwargs, noise_mechanism=noise_mechanism_for(args, len(loader)))
    common = dict(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=args.max_grad_norm,
                  grad_sample_mode=args.grad_sample_mode, **make_private_kwargs)
    if args.noise_multiplier is not None:
        model, optimizer, loader = privacy_engine.make_private(noise_multiplier=args.noise_multiplier, **common)
    else:
        model, optimizer, loader = privacy_engine.make_private_with_epsilon(
            target_epsilon=args.target_epsilon, target_delta=args.delta, epochs=args.epochs, **common
        )
    if on_private is not None:
        on_private(model, optimizer, loader)

    history = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        _train_one_epoch(model, optimizer, loader, args, epoch, progress)
        accuracy = evaluate(model, test_set)
        epsilon = privacy_engine.get_epsilon(args.delta)
        history.append((epoch, accuracy, epsilon))
        if on_epoch is not None:
            on_epoch(epoch, accuracy, epsilon)
    return history


def _train_one_epoch(model, optimizer, loader, args, epoch, progress):
    if args.max_physical_batch_size is None:
        _run_batches(model, optimizer, loader, args, epoch, progress)
        return
    from fxdp.data import BatchMemoryManager

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.max_physical_batch_size,
                            optimizer=optimizer) as physical_loader:
        _run_batches(model, optimizer, physical_loader, args, epoch, progress)


def _run_batches(model, optimizer, loader, args, epoch, progress):
    batches = _progress_bar(loader, f"epoch {epoch}/{args.epochs}") if progress else loader
    for images, labels in batches:
        optimizer.zero_grad()
        # A Poisson batch can be empty: the loss is then 0, and the step still adds its noise.
        loss = F.cross_entropy(model(images), labels) if len(labels) else model(images).sum()
        loss.backward()
        optimizer.step()
        if progress:
            batches.set_postfix(loss=f"{loss.item():.3f}", batch=len(labels))


def _progress_bar(iterable, description):
    try:
        from tqdm import tqdm
    except ImportError as error:
        raise SystemExit('the progress bar needs tqdm: pip install "fxdp[examples]" (or pass --no-progress)') from error
    return tqdm(iterable, desc=description, leave=False, file=sys.stdout)


def plot_history(history, path: str, title: str) -> None:
    """Test accuracy and epsilon per epoch, one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as error:
        raise SystemExit('--plot needs matplotlib: pip install "fxdp[examples]"') from error
    epochs = [e for e, _, _ in history]
    fig, acc_axis = plt.subplots(figsize=(5.5, 3.2), dpi=100)
    acc_axis.plot(epochs, [100 * a for _, a, _ in history], marker="o", markersize=3, color="tab:blue")
    acc_axis.set_xlabel("epoch")
    acc_axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    acc_axis.set_ylabel("test accuracy (%)", color="tab:blue")
    eps_axis = acc_axis.twinx()
    eps_axis.plot(epochs, [e for _, _, e in history], marker="s", markersize=3, color="tab:red")
    eps_axis.set_ylabel("epsilon spent", color="tab:red")
    eps_axis.set_ylim(bottom=0)
    acc_axis.set_title(title, fontsize=9)
    acc_axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> List[tuple]:
    args = parse_args(argv)
    import fxdp
    from fxdp.privacy_engine import PrivacyEngine

    torch.manual_seed(args.seed)
    engine = PrivacyEngine(accountant=args.accountant, secure_mode=args.secure_mode)

    def show_setup(model, optimizer, loader):
        print(fxdp.report(model))
        print(f"training on {len(loader.dataset)} digits: {sampling_of(args, loader)} at rate {loader.sample_rate:.4f} "
              f"({len(loader)} batches per epoch), clipping at C = {optimizer.max_grad_norm}, "
              f"noise multiplier {optimizer.noise_multiplier:.3f}")
        if args.noise != "gaussian" and args.noise_multiplier is None:
            print(expected_error_against_dp_sgd(args, optimizer, len(loader)))

    def log(epoch, accuracy, epsilon):
        print(f"epoch {epoch:3d}   test accuracy {100 * accuracy:5.1f}%   epsilon {epsilon:.2f} (delta {args.delta:g})")

    # Example inputs (only their shape matters) let the compiler finish its analysis before training.
    compiled = {}
    if args.compile:  # (BatchMemoryManager cuts batches to sizes of its own: no padding then)
        compiled = dict(compile=True, padded_batches=False if args.max_physical_batch_size else None)
    history = train(args, engine, on_epoch=log, progress=not args.no_progress, on_private=show_setup,
                    example_inputs=torch.zeros(2, 1, 8, 8), **compiled)
    _, accuracy, epsilon = history[-1]
    print(f"final: test accuracy {100 * accuracy:.1f}% at epsilon {epsilon:.2f}, delta {args.delta:g}")
    if args.plot:
        plot_history(history, args.plot, f"fxdp DP-SGD on digits (delta = {args.delta:g})")
        print(f"plot written to {args.plot}")
    return history


if __name__ == "__main__":
    main()
