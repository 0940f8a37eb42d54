"""Train a small Hugging Face transformers model with differential privacy (DP-SGD) on text that ships
with Python: docstrings of the standard library, classified by the family of modules they document.

    pip install -e ".[examples]" && python examples/finetune_text.py

The data (``examples/text_data.py``) is read from the standard library's source files with ``ast``:
nothing is downloaded. Three balanced classes (text formats, networking, development tools), chance
is 33%. The model is a 2-layer BERT built from a config (``transformers.BertModel``, hidden size
32) with a mean-pooling classifier; the tokenizer hashes words into a fixed vocabulary: no pretrained
weights or tokenizer files are needed. ``fxdp`` compiles the model (torch.fx cannot trace
transformers 5's models, so the graph is captured with ``torch.export``), prints its compile report,
then trains with Poisson sampling, per-sample clipping and Gaussian noise calibrated to the target
epsilon, printing the test accuracy and the epsilon spent after every epoch. ``--non-private`` trains the same model without
privacy, for comparison. ``--noise banded-mf`` or ``--noise blt`` adds noise correlated across steps instead, as in
``train_digits.py`` (docs/correlated_noise.md).

With pretrained weights the same code fine-tunes them: build ``DocstringClassifier``'s ``bert`` with
``BertModel.from_pretrained(...)`` and use that model's tokenizer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # text_data.py sits next to this file
import text_data  # noqa: E402
from noise_options import add_noise_arguments, expected_error_against_dp_sgd, noise_mechanism_for, sampling_of  # noqa

QUICK_EPOCHS = 3  # --quick, for tests: the noise is calibrated for 3 epochs, so it is smaller than for 10


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Private training (DP-SGD) of a small transformers model on stdlib docstrings with fxdp.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=1024,
                        help="expected (Poisson) batch size; the sampling rate is batch size / training set size")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument("--target-epsilon", type=float, default=8.0,
                       help="calibrate the noise so that the whole run spends this epsilon")
    noise.add_argument("--noise-multiplier", type=float, default=None,
                       help="fixed noise multiplier sigma (instead of --target-epsilon)")
    noise.add_argument("--non-private", action="store_true",
                       help="train the same model without privacy (no clipping, no noise), for comparison")
    parser.add_argument("--delta", type=float, default=1e-5)
    add_noise_arguments(parser)
    parser.add_argument("--max-physical-batch-size", type=int, default=None,
                        help="cut each logical batch into physical batches of at most this size "
                             "(BatchMemoryManager); the privacy accounting is unchanged")
    parser.add_argument("--vocab-size", type=int, default=1024, help="hash buckets of the word tokenizer (+2 reserved)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation, sampling and noise")
    parser.add_argument("--train-subset", type=int, default=None,
                        help="train on the first N training samples only; the test set is unchanged")
    parser.add_argument("--quick", action="store_true",
                        help=f"a short run for tests: --epochs {QUICK_EPOCHS}")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = QUICK_EPOCHS
    return args


class DocstringClassifier(nn.Module):
    """A 2-layer BERT (``transformers.BertModel``, built from a config and randomly initialised: no
    download), the mean of its last hidden states over the tokens ``attention_mask`` keeps, and a
    linear classifier.

    Mean pooling rather than BERT's own head (the ``[CLS]`` state through a pooler): trained from
    scratch with DP-SGD, ``BertForSequenceClassification`` stayed at chance at epsilon 8 in our runs,
    while the mean of the token states starts close to a bag of words and gives the noisy gradient
    something to follow from the first step. Dropout is off: the graph fxdp captures keeps the
    training mode it was captured in (``model.eval()`` would not turn dropout off for evaluation), and
    DP-SGD's noise already regularises a model this small."""

    def __init__(self, vocab_size: int, num_labels: int, hidden_size: int = 32):
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=2 * hidden_size, max_position_embeddings=text_data.MAX_TOKENS, type_vocab_size=1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=text_data.PAD,
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(hidden_size, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        keep = attention_mask.unsqueeze(-1).to(states.dtype)  # (N, T, 1): 1 on tokens, 0 on padding
        return self.classifier((states * keep).sum(dim=1) / keep.sum(dim=1))


def example_inputs() -> dict:
    """A batch of the shape the model is trained on (two samples, the second padded), for the compiler.
    Only shapes and dtypes matter, so it is made up rather than drawn from the (private) training set."""
    full, short = [(torch.full((length,), text_data.CLS), 0) for length in (text_data.MAX_TOKENS, 5)]
    input_ids, attention_mask, _ = text_data.pad_batch([full, short])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int = 512) -> float:
    """Test accuracy (the test set is not private here: it never touches the training)."""
    was_training = model.training
    model.eval()
    correct = 0
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=text_data.pad_batch)
    for input_ids, attention_mask, labels in loader:
        logits = model(input_ids=input_ids, attention_mask=attention_mask)
        correct += (logits.argmax(dim=1) == labels).sum().item()
    model.train(was_training)
    return correct / len(dataset)


def train(args: argparse.Namespace, on_epoch: Optional[Callable[[int, float, Optional[float]], None]] = None,
          on_private: Optional[Callable] = None):
    """Trains (privately unless ``args.non_private``) and returns ``[(epoch, test accuracy, epsilon or None)]``.
    The caller seeds torch first."""
    from fxdp.privacy_engine import PrivacyEngine

    tokenizer = text_data.HashingTokenizer(vocab_size=args.vocab_size)
    train_split, test_split = text_data.load_docstring_classification(tokenizer)
    if args.train_subset is not None:
        train_split = text_data.TextSplit(*(column[:args.train_subset] for column in
                                            (train_split.texts, train_split.ids, train_split.labels)))
    train_set, test_set = text_data.TokenizedText(train_split), text_data.TokenizedText(test_split)

    model = DocstringClassifier(tokenizer.vocab_size, len(text_data.LABELS))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # An ordinary loader: make_private replaces it by a Poisson loader with rate batch_size / N, and keeps
    # its collate function. That pads every sequence to MAX_TOKENS: the graph fxdp captures with
    # torch.export has the sequence length of the example inputs built in.
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=args.non_private,
                        collate_fn=text_data.pad_batch)
    engine = None
    if not args.non_private:
        engine = PrivacyEngine()
        common = dict(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=args.max_grad_norm,
                      example_inputs=example_inputs(), noise_mechanism=noise_mechanism_for(args, len(loader)))
        if args.noise_multiplier is not None:
            model, optimizer, loader = engine.make_private(noise_multiplier=args.noise_multiplier, **common)
        else:
            model, optimizer, loader = engine.make_private_with_epsilon(
                target_epsilon=args.target_epsilon, target_delta=args.delta, epochs=args.epochs, **common)
    if on_private is not None:
        on_private(model, optimizer, loader, train_set)

    history = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        if args.max_physical_batch_size is None or engine is None:
            _run_batches(model, optimizer, loader)
        else:
            from fxdp.data import BatchMemoryManager

            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.max_physical_batch_size,
                                    optimizer=optimizer) as physical_loader:
                _run_batches(model, optimizer, physical_loader)
        accuracy = evaluate(model, test_set)
        epsilon = engine.get_epsilon(args.delta) if engine is not None else None
        history.append((epoch, accuracy, epsilon))
        if on_epoch is not None:
            on_epoch(epoch, accuracy, epsilon)
    return history


def _run_batches(model, optimizer, loader):
    for input_ids, attention_mask, labels in loader:
        optimizer.zero_grad()
        if len(labels):
            logits = model(input_ids=input_ids, attention_mask=attention_mask)
            F.cross_entropy(logits, labels).backward()
        # A Poisson batch can be empty (BERT cannot run on it): the optimizer still steps and adds
        # its noise, since skipping the step would change the privacy analysis.
        optimizer.step()


def main(argv: Optional[List[str]] = None) -> List[tuple]:
    args = parse_args(argv)
    import fxdp

    torch.manual_seed(args.seed)
    start = time.perf_counter()

    def show_setup(model, optimizer, loader, train_set):
        if args.non_private:
            print(f"training on {len(train_set)} docstring pieces without privacy, batches of {args.batch_size}")
            return
        print(fxdp.report(model))
        print(f"training on {len(train_set)} docstring pieces: {sampling_of(args, loader)} at rate "
              f"{loader.sample_rate:.4f} ({len(loader)} batches per epoch), clipping at C = {optimizer.max_grad_norm}, "
              f"noise multiplier {optimizer.noise_multiplier:.3f}")
        if args.noise != "gaussian" and args.noise_multiplier is None:
            print(expected_error_against_dp_sgd(args, optimizer, len(loader)))

    def log(epoch, accuracy, epsilon):
        spent = f"   epsilon {epsilon:.2f} (delta {args.delta:g})" if epsilon is not None else ""
        print(f"epoch {epoch:3d}   test accuracy {100 * accuracy:5.1f}%{spent}", flush=True)

    history = train(args, on_epoch=log, on_private=show_setup)
    _, accuracy, epsilon = history[-1]
    if epsilon is None:
        print(f"final: test accuracy {100 * accuracy:.1f}% without privacy")
    else:
        print(f"final: test accuracy {100 * accuracy:.1f}% at epsilon {epsilon:.2f}, delta {args.delta:g}")
    print(f"({time.perf_counter() - start:.0f} s, chance is {100 / len(text_data.LABELS):.1f}%)")
    return history


if __name__ == "__main__":
    main()
