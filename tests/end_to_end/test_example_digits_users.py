"""examples/train_digits_users.py: user-level DP-SGD on digits with synthetic users; it prints the user-level ε,
the accuracy, and the group-privacy ε of example-level training for contrast."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason='the example needs the examples extra: pip install -e ".[examples]"')

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_digits_users", ROOT / "examples" / "train_digits_users.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synthetic_users_have_1_to_50_records(example):
    ids = example.synthetic_users(1437, 1, 50)
    sizes = [ids.count(u) for u in set(ids)]
    assert len(ids) == 1437 and ids == sorted(ids)
    assert min(sizes[:-1]) >= 1 and max(sizes) <= 50  # (the last user is cut to fit)


def test_short_run_prints_user_level_epsilon_accuracy_and_group_contrast(example, capsys):
    result = example.main(["--epochs", "2", "--train-subset", "300", "--target-epsilon", "4", "--accountant", "rdp"])
    out = capsys.readouterr().out
    users, largest = result["users"], result["largest"]
    assert f"300 training records of {users} users (1-50 records each, the largest {largest})" in out
    assert "users sampled at rate q = 0.5000, up to 16 records each" in out
    assert 4.0 - 0.01 <= result["epsilon"] <= 4.0
    assert f"final: test accuracy {100 * result['accuracy']:.1f}% at user-level epsilon {result['epsilon']:.2f}" in out
    assert "privacy unit: user" in out
    # the group bound for the largest user is far weaker than the per-record figure of the same history
    assert result["group"] > result["largest"] * result["per_record"] * 0.99
    assert f"a user of {result['largest']} records gets epsilon" in out
