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

ROOT = Path(__file__).resolve().parents[1]


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
    history = example.main(["--quick"])
    out = capsys.readouterr().out
    assert "fxdp compile report for DocstringClassifier" in out
    assert "traced: yes (torch.export); engine: fx" in out
    assert "front end: torch.export, because torch.fx could not trace the model" in out
    assert "Findings: none" in out
    assert re.search(r"training on 600 docstring pieces: Poisson sampling at rate 0\.2500 \(4 batches per epoch\), "
                     r"clipping at C = 1\.0, noise multiplier \d+\.\d+", out)
    (e1, _, eps1), (e2, accuracy, eps2) = history
    assert (e1, e2) == (1, 2)
    assert "epoch   1   test accuracy" in out and "epoch   2   test accuracy" in out
    # the noise was calibrated for the whole run: epsilon grows to just below the target
    assert 0 < eps1 < eps2 and 0.99 * 8.0 <= eps2 <= 8.0
    assert f"final: test accuracy {100 * accuracy:.1f}% at epsilon {eps2:.2f}, delta 1e-05" in out
    assert 0.0 <= accuracy <= 1.0
