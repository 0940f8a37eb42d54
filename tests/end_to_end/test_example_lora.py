"""examples/finetune_lora.py: a GPT-2-architecture model with LoRA adapters (peft) trained privately with
DPTrainer on standard-library docstrings, in its --quick mode."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason='the example needs: pip install -e ".[examples,transformers]"')
pytest.importorskip("peft", reason='the example needs: pip install -e ".[examples,transformers]"')

ROOT = Path(__file__).resolve().parents[2]


def test_the_lora_example_trains_privately_and_prints_epsilon_and_accuracy(capsys):
    spec = importlib.util.spec_from_file_location("finetune_lora", ROOT / "examples" / "finetune_lora.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--quick"])
    out = capsys.readouterr().out
    assert result["steps"] == 6  # 600 samples at an expected batch of 100: 6 Poisson batches, one epoch
    assert 0.99 * 8.0 <= result["epsilon"] <= 8.0
    assert 0.0 <= result["accuracy"] <= 1.0
    assert f"final: test accuracy {100 * result['accuracy']:.1f}% at epsilon {result['epsilon']:.2f}" in out
    listed = next(line for line in out.splitlines() if line.startswith("private parameters"))
    assert "lora_A.default.weight" in listed and "score.modules_to_save.default.weight" in listed
    assert "'epsilon'" in out  # the Trainer's logs carry it
