"""examples/train_digits_lightning.py: the digits example trained by PyTorch Lightning with DPCallback, briefly
(resuming from a checkpoint is tested in tests/integrations/test_lightning.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason='the example needs the examples extra: pip install -e ".[examples]"')
pytest.importorskip("pytorch_lightning", reason='the example needs the lightning extra: pip install -e ".[lightning]"')

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(ROOT / "examples"))  # it imports train_digits from its own folder, as when run
    try:
        spec = importlib.util.spec_from_file_location("train_digits_lightning",
                                                      ROOT / "examples" / "train_digits_lightning.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_a_short_run_prints_accuracy_and_epsilon_and_writes_its_checkpoint(example, capsys, tmp_path):
    checkpoint = tmp_path / "two_epochs.ckpt"
    common = ["--train-subset", "120", "--batch-size", "30", "--target-epsilon", "3.0", "--accountant", "rdp"]
    history = example.main(["--epochs", "2", "--checkpoint", str(checkpoint)] + common)
    out = capsys.readouterr().out
    assert "epoch   1   test accuracy" in out and "epoch   2   test accuracy" in out
    assert "Poisson sampling at rate 0.2500, 8 private steps" in out
    (e1, _, eps1), (e2, accuracy, eps2) = history
    assert (e1, e2) == (1, 2) and 0.0 <= accuracy <= 1.0
    assert 0 < eps1 < eps2 and 0.99 * 3.0 <= eps2 <= 3.0  # calibrated over the run's 2 epochs
    assert f"final: test accuracy {100 * accuracy:.1f}% at epsilon {eps2:.2f}, delta 1e-05" in out
    assert f"checkpoint written to {checkpoint}" in out and checkpoint.stat().st_size > 0
