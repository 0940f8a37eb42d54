"""The ``fxdp`` command line: what it prints and its exit status, on success and on every usage error."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from fxdp.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODELS = "examples/models.py"


@pytest.fixture(autouse=True)
def in_repo_root(monkeypatch):
    # Targets are given relative to the repository root, as a user would type them there.
    monkeypatch.chdir(ROOT)


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def marker_line(marker: str) -> int:
    """Line number in examples/models.py of the line tagged ``# fxdp-example: <marker>``."""
    tag = f"# fxdp-example: {marker}"
    lines = [i for i, text in enumerate((ROOT / MODELS).read_text().splitlines(), 1) if text.rstrip().endswith(tag)]
    assert len(lines) == 1, f"marker {tag!r} should tag exactly one line of {MODELS}, found {lines}"
    return lines[0]


def report_line(out: str, where: str) -> str:
    """The report line that mentions ``where`` (the first row line of a finding or change)."""
    hits = [line for line in out.splitlines() if where in line]
    assert hits, f"{where} not in the report:\n{out}"
    return hits[0]


# --------------------------------------------------------------------------- usage errors (exit 2)

FACTORIES = ("resnet_block, batchnorm_cnn, untraceable, time_major, mixing, mnist_cnn, mlp, BasicBlock, "
             "SmallResNet, BatchNormCNN, DataDependent, TimeMajor, Mixing, MnistCNN")


@pytest.fixture
def factories_file(tmp_path):
    path = tmp_path / "factories.py"
    path.write_text(
        "from torch import nn\n"
        "\n"
        "def boom():\n"
        "    raise ValueError('no weights file')\n"
        "\n"
        "def not_a_model():\n"
        "    return 42\n"
        "\n"
        "def needs_size(n, *, bias=True):\n"
        "    return nn.Linear(n, n, bias=bias)\n"
        "\n"
        "linear = nn.Linear(4, 2)\n"
        "\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(4, 2)\n"
        "\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
    )
    return path


@pytest.mark.parametrize("argv, message", [
    (["inspect", "examples/nope.py:model", "--input", "8,3"],
     "no such file: 'examples/nope.py'"),
    (["inspect", "examples/:model"],
     "'examples/' is a directory; expected a Python file, e.g. examples/models.py:resnet_block"),
    (["inspect", "fxdp_no_such_package.models:model"],
     "cannot import module 'fxdp_no_such_package.models': ModuleNotFoundError: "
     "No module named 'fxdp_no_such_package'"),
    (["inspect", f"{MODELS}:resnet", "--input", "8,3,16,16"],
     f"{MODELS} has no factory 'resnet'; available: {FACTORIES}"),
    (["inspect", MODELS, "--input", "8,3,16,16"],
     f"'{MODELS}' names no factory; use {MODELS}:FACTORY with FACTORY one of: {FACTORIES}"),
    (["inspect", f"{MODELS}:INPUT_SHAPES"],
     f"{MODELS}:INPUT_SHAPES is a dict, not a factory; available: {FACTORIES}"),
    (["inspect", f"{MODELS}:mlp", "--input", "8,a"],
     "malformed --input '8,a': expected positive sizes separated by ',' or 'x', e.g. --input 8,3,32,32"),
    (["inspect", f"{MODELS}:mlp", "--input", "8x0"],
     "malformed --input '8x0': expected positive sizes separated by ',' or 'x', e.g. --input 8,3,32,32"),
    (["inspect", f"{MODELS}:mlp", "--input", "8,20", "--input", ""],
     "malformed --input '': expected positive sizes separated by ',' or 'x', e.g. --input 8,3,32,32"),
    (["inspect", f"{MODELS}:mlp", "--input", "8,20", "--dtype", "float33"],
     "unknown dtype 'float33'; valid: float32, float, float64, double, float16, half, bfloat16, "
     "int64, long, int32, int, int16, short, int8, uint8, bool"),
    (["inspect", f"{MODELS}:mlp", "--input", "8,20:complex"],
     "unknown dtype 'complex'; valid: float32, float, float64, double, float16, half, bfloat16, "
     "int64, long, int32, int, int16, short, int8, uint8, bool"),
    (["inspect", f"{MODELS}:mlp", "--input", "8,20", "--batch-dim", "2"],
     "--batch-dim 2 is out of range for --input 8,20 (2 dimensions)"),
    (["inspect", f"{MODELS}:mlp", "--input", "8,20", "--dtype", "long", "--high", "0"],
     "--high must be positive, got 0"),
])
def test_usage_errors_print_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", f"fxdp inspect: error: {message}\n")


def test_factory_errors_name_the_factory_and_the_line(capsys, factories_file):
    f = str(factories_file)
    cases = {
        "boom": f"{f}:boom raised ValueError: no weights file ({f}:4)",
        "not_a_model": f"{f}:not_a_model returned int, not a torch.nn.Module",
        "needs_size": f"{f}:needs_size needs arguments (n, *, bias=True); fxdp inspect calls it with none: "
                      "wrap it in a function that takes no arguments",
        "missing": f"{f} has no factory 'missing'; available: boom, not_a_model, linear, Net",
    }
    for name, message in cases.items():
        code, out, err = run(capsys, "inspect", f"{f}:{name}", "--input", "8,4")
        assert (code, out, err) == (2, "", f"fxdp inspect: error: {message}\n"), name


def test_file_that_fails_to_import_shows_the_error_and_its_line(capsys, tmp_path):
    path = tmp_path / "needs_extra.py"
    path.write_text("import torch\nimport fxdp_not_installed_extra\n")
    code, out, err = run(capsys, "inspect", f"{path}:model")
    assert (code, out) == (2, "")
    assert err == (f"fxdp inspect: error: importing '{path}' failed: ModuleNotFoundError: "
                   f"No module named 'fxdp_not_installed_extra' ({path}:2)\n")

    path.write_text("def model(:\n    pass\n")
    code, out, err = run(capsys, "inspect", f"{path}:model")
    assert (code, out) == (2, "")
    assert err == f"fxdp inspect: error: importing '{path}' failed: SyntaxError: invalid syntax ({path}:1)\n"


def test_argparse_errors_and_no_command_exit_2(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "inspect" in err and out == ""
    code, out, err = run(capsys, "inspect")
    assert code == 2 and "the following arguments are required: TARGET" in err
    code, out, err = run(capsys, "inspect", f"{MODELS}:mlp", "--batch-dim", "first")
    assert code == 2 and "argument --batch-dim: invalid int value: 'first'" in err


def test_version(capsys):
    code, out, err = run(capsys, "--version")
    assert (code, out, err) == (0, f"fxdp {version('fxdp')}\n", "")
