"""examples/finetune_text.py: a small transformers model (a 2-layer BERT from a config) trained privately
on standard-library docstrings through fxdp.PrivacyEngine; its data module examples/text_data.py."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason='the example needs the examples extra: pip install -e ".[examples]"')

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load("finetune_text")


@pytest.fixture(scope="module")
def text_data(example):
    return sys.modules["text_data"]  # the example imports it from examples/


@pytest.fixture(scope="module")
def splits(text_data):
    return text_data.load_docstring_classification(text_data.HashingTokenizer(vocab_size=1024))


def test_docstring_splits_are_balanced_disjoint_and_reproducible(text_data, splits):
    train, test = splits
    classes = len(text_data.LABELS)
    assert classes == 3
    for split in (train, test):
        counts = torch.bincount(torch.tensor(split.labels), minlength=classes)
        assert counts.min() == counts.max() > 0, counts
    assert len(train.labels) > 3 * len(test.labels) > 0
    assert not set(train.texts) & set(test.texts)  # no piece of text on both sides
    again = text_data.load_docstring_classification(text_data.HashingTokenizer(vocab_size=1024))
    assert again == splits


def test_tokenizer_is_fixed_in_advance_and_pad_batch_masks_padding(text_data, splits):
    tokenizer = text_data.HashingTokenizer(vocab_size=1024)
    ids = tokenizer("Return the socket's address, (host, port).")
    # CLS, then one id per word, number or punctuation mark, from a hash: the same on every machine
    assert ids[0] == text_data.CLS and len(ids) == 1 + len(tokenizer.words("Return the socket's address, (host, port)."))
    assert ids == text_data.HashingTokenizer(vocab_size=1024)("return THE socket's address, (host, port).")
    train, _ = splits
    every_id = torch.tensor([i for sample in train.ids for i in sample])
    assert every_id.min() >= text_data.CLS and every_id.max() < 1024
    assert max(len(sample) for sample in train.ids) <= text_data.MAX_TOKENS

    samples = [(torch.tensor(tokenizer("a b c")), 0), (torch.tensor(tokenizer("one two three four five six")), 2)]
    input_ids, attention_mask, labels = text_data.pad_batch(samples)
    assert input_ids.shape == attention_mask.shape == (2, text_data.MAX_TOKENS)
    assert attention_mask.sum(dim=1).tolist() == [4, 7] and labels.tolist() == [0, 2]
    assert (input_ids[attention_mask == 0] == text_data.PAD).all()
    assert text_data.pad_batch(samples, length=None)[0].shape == (2, 7)


def test_quick_private_run_prints_the_export_report_accuracy_and_epsilon(example, capsys):
    """--quick: 3 epochs at epsilon 8 (the default run has 10). Chance is 1/3. Measured on Python 3.11,
    torch 2.13, transformers 5.24: this run (seed 0) ends at 46.7% (36.5%, 43.9%, 46.7% per epoch), and
    at 47.5%, 47.9%, 40.3%, 49.7%, 48.4% with seeds 1 to 5; the default run at 61.1%, the same model
    without privacy at 70.7%. A classifier at chance would score 33.3% +- 1.2 on the 1464 test pieces."""
    history = example.main(["--quick"])
    out = capsys.readouterr().out
    assert "fxdp compile report for DocstringClassifier" in out
    assert "traced: yes (torch.export); engine: fx" in out
    assert "front end: torch.export, because torch.fx could not trace the model" in out
    assert "Findings: none" in out
    assert re.search(r"training on \d{4} docstring pieces: Poisson sampling at rate 0\.\d{4} \(\d batches per epoch\), "
                     r"clipping at C = 1\.0, noise multiplier \d+\.\d+", out)
    assert [epoch for epoch, _, _ in history] == [1, 2, 3]
    for epoch, accuracy, epsilon in history:
        assert f"epoch {epoch:3d}   test accuracy {100 * accuracy:5.1f}%   epsilon {epsilon:.2f} (delta 1e-05)" in out
    epsilons = [epsilon for _, _, epsilon in history]
    # the noise was calibrated for the whole run: epsilon grows to just below the target
    assert all(a < b for a, b in zip(epsilons, epsilons[1:])) and 0.99 * 8.0 <= epsilons[-1] <= 8.0
    _, accuracy, epsilon = history[-1]
    assert f"final: test accuracy {100 * accuracy:.1f}% at epsilon {epsilon:.2f}, delta 1e-05" in out
    assert accuracy >= 0.38  # below every seed measured, 4 standard deviations above chance


def test_memory_manager_fixed_noise_and_the_non_private_baseline(example, capsys):
    history = example.main(["--train-subset", "200", "--epochs", "1", "--batch-size", "100",
                            "--max-physical-batch-size", "32", "--noise-multiplier", "1.0"])
    out = capsys.readouterr().out
    assert "training on 200 docstring pieces: Poisson sampling at rate 0.5000 (2 batches per epoch)" in out
    assert "noise multiplier 1.000" in out
    (_, accuracy, epsilon), = history
    assert epsilon > 0 and f"final: test accuracy {100 * accuracy:.1f}% at epsilon {epsilon:.2f}" in out

    history = example.main(["--train-subset", "200", "--epochs", "1", "--non-private"])
    out = capsys.readouterr().out
    assert "fxdp compile report" not in out and "training on 200 docstring pieces without privacy" in out
    (_, accuracy, epsilon), = history
    assert epsilon is None and f"final: test accuracy {100 * accuracy:.1f}% without privacy" in out
