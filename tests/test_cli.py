"""The ``fxdp`` command line: what it prints and its exit status, on success and on every usage error."""

from __future__ import annotations

import runpy
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from fxdp.cli import load_model, main

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
    """Line number in examples/models.py of the code line after the comment ``# fxdp-example: <marker>``."""
    lines = (ROOT / MODELS).read_text().splitlines()
    tag = f"# fxdp-example: {marker}"
    tagged = [i for i, text in enumerate(lines, 1)
              if text.strip() == tag or text.strip().startswith(tag + " (")]
    assert len(tagged) == 1, f"marker {marker!r} should tag exactly one line of {MODELS}, found {tagged}"
    line = tagged[0] + 1
    assert not lines[line - 1].strip().startswith("#")
    return line


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


def test_failed_module_import_suggests_the_file_when_it_exists(capsys, tmp_path, monkeypatch):
    # An installed package of the same name shadows the local folder (some wheels ship `examples`).
    (tmp_path / "site" / "fxdp_cli_shadowed").mkdir(parents=True)
    (tmp_path / "site" / "fxdp_cli_shadowed" / "__init__.py").write_text("")
    (tmp_path / "work" / "fxdp_cli_shadowed").mkdir(parents=True)
    (tmp_path / "work" / "fxdp_cli_shadowed" / "nets.py").write_text(
        "from torch import nn\nnet = nn.Linear(4, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.chdir(tmp_path / "work")
    code, out, err = run(capsys, "inspect", "fxdp_cli_shadowed.nets:net")
    assert (code, out) == (2, "")
    assert err == ("fxdp inspect: error: cannot import module 'fxdp_cli_shadowed.nets': ModuleNotFoundError: "
                   "No module named 'fxdp_cli_shadowed.nets'; to load the file, give it as "
                   "fxdp_cli_shadowed/nets.py:FACTORY\n")
    code, out, err = run(capsys, "inspect", "fxdp_cli_shadowed/nets.py:net")
    assert (code, err) == (0, "") and out.startswith("fxdp compile report for Linear\n")


def test_argparse_errors_and_no_command_exit_2(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "inspect" in err and out == ""
    code, out, err = run(capsys, "inspect")
    assert code == 2 and "the following arguments are required: TARGET" in err
    code, out, err = run(capsys, "inspect", f"{MODELS}:mlp", "--batch-dim", "first")
    assert code == 2 and "argument --batch-dim: invalid int value: 'first'" in err


@pytest.mark.parametrize("argv, message", [
    # a negative size looks like an option to argparse; it is read as the value it is
    (["inspect", f"{MODELS}:mlp", "--input", "-1,4"],
     "fxdp inspect: error: --input '-1,4' has a negative size (-1): sizes are positive, e.g. --input 8,3,32,32"),
    (["inspect", f"{MODELS}:mlp", "--inp", "-1x4"],
     "fxdp inspect: error: --input '-1x4' has a negative size (-1): sizes are positive, e.g. --input 8,3,32,32"),
    (["inspect", f"{MODELS}:mlp", "--input=8,-4"],
     "fxdp inspect: error: --input '8,-4' has a negative size (-4): sizes are positive, e.g. --input 8,3,32,32"),
    # argparse's own errors: one line, no usage block
    (["inspect", f"{MODELS}:mlp", "--input"],
     "fxdp inspect: error: argument --input: expected one argument (see fxdp inspect --help)"),
    (["inspect", f"{MODELS}:mlp", "--input", "8,20", "--bogus"],
     "fxdp inspect: error: unrecognized arguments: --bogus (see fxdp inspect --help)"),
    (["inspect", f"{MODELS}:mlp", "8,20"],
     "fxdp inspect: error: unrecognized arguments: 8,20 (see fxdp inspect --help)"),
    (["inspect"], "fxdp inspect: error: the following arguments are required: TARGET (see fxdp inspect --help)"),
    (["inspect", f"{MODELS}:mlp", "--batch-dim", "first"],
     "fxdp inspect: error: argument --batch-dim: invalid int value: 'first' (see fxdp inspect --help)"),
    (["--bogus"], "fxdp: error: unrecognized arguments: --bogus (see fxdp --help)"),
    # values argparse accepts that torch would not
    (["inspect", f"{MODELS}:mlp", "--input", "8,20", "--seed", str(2**64)],
     f"fxdp inspect: error: --seed {2**64} is out of range: use an integer in [-2**63, 2**64)"),
    (["inspect", f"{MODELS}:mlp", "--input", "8,20:int8", "--high", "1000"],
     "fxdp inspect: error: --high 1000 does not fit --input 8,20:int8 (int8: values up to 127); use --high 128 "
     "or less"),
])
def test_every_bad_argument_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", message + "\n")


def test_an_unknown_command_is_one_line_and_exit_2(capsys):
    code, out, err = run(capsys, "inspct", f"{MODELS}:mlp")  # argparse quotes the choices by Python version
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("fxdp: error: argument COMMAND: invalid choice: 'inspct' (choose from ")
    assert err.endswith(") (see fxdp --help)\n") and "inspect" in err.split("choose from ")[1]


def test_a_huge_input_is_refused_before_it_is_allocated(capsys, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("an input was allocated")

    monkeypatch.setattr("fxdp.cli.random_input", no_allocation)
    monkeypatch.setattr("fxdp.cli._free_memory", lambda: 16 * 10**9)
    code, out, err = run(capsys, "inspect", f"{MODELS}:mlp", "--input", "100000,100000,100000")
    assert (code, out) == (2, "")
    assert err == ("fxdp inspect: error: --input 100000,100000,100000 is too large: 1,000,000,000,000,000 elements "
                   "(4,000,000.0 GB); fxdp inspect makes random inputs of at most 2,147,483,648 elements, within "
                   "half the free memory (8.0 GB). The report is the same for small sizes: use a small batch\n")
    # what fits in the element limit but not in memory; inputs are counted together
    monkeypatch.setattr("fxdp.cli._free_memory", lambda: 1000)
    code, out, err = run(capsys, "inspect", f"{MODELS}:mlp", "--input", "8,20", "--input", "2,2:long")
    assert (code, out) == (2, "")
    assert err == ("fxdp inspect: error: --input 8,20 --input 2,2:long is too large: 164 elements (0.0 GB); fxdp "
                   "inspect makes random inputs of at most 2,147,483,648 elements, within half the free memory "
                   "(0.0 GB). The report is the same for small sizes: use a small batch\n")
    monkeypatch.setattr("fxdp.cli._free_memory", lambda: None)  # unknown free memory: the element limit
    code, out, err = run(capsys, "inspect", f"{MODELS}:mlp", "--input", f"{2**16},{2**15 + 1}")
    assert err == (f"fxdp inspect: error: --input {2**16},{2**15 + 1} is too large: 2,147,549,184 elements (8.6 GB); "
                   "fxdp inspect makes random inputs of at most 2,147,483,648 elements. The report is the same for "
                   "small sizes: use a small batch\n")


def test_a_factory_or_forward_that_exits_is_a_usage_error_naming_it(capsys, tmp_path):
    path = tmp_path / "exits.py"
    path.write_text(
        "import sys\n"
        "from torch import nn\n"
        "\n"
        "def model():\n"
        "    raise SystemExit(3)\n"
        "\n"
        "class Quits(nn.Module):\n"
        "    def forward(self, x):\n"
        "        sys.exit()\n"
    )
    code, out, err = run(capsys, "inspect", f"{path}:model", "--input", "8,4")
    assert (code, out, err) == (2, "", f"fxdp inspect: error: {path}:model raised SystemExit: 3 ({path}:5)\n")
    code, out, err = run(capsys, "inspect", f"{path}:Quits", "--input", "8,4")
    assert (code, out, err) == (2, "", f"fxdp inspect: error: the model's forward fails on --input 8,4 (float32): "
                                       f"SystemExit ({path}:9)\n")


def test_version(capsys):
    code, out, err = run(capsys, "--version")
    assert (code, out, err) == (0, f"fxdp {version('fxdp')}\n", "")


# --------------------------------------------------------------------------- reports


def test_resnet_block_lists_every_inplace_rewrite_with_its_line(capsys):
    code, out, err = run(capsys, "inspect", f"{MODELS}:resnet_block", "--input", "8,3,16,16")
    assert (code, err) == (0, "")
    assert out.startswith("fxdp compile report for SmallResNet\ntraced: yes (torch.fx)")
    iadd = report_line(out, f"{MODELS}:{marker_line('iadd')} ")
    assert "operator.iadd" in iadd and "rewrite" in iadd
    for marker in ("relu-stem", "relu-1", "relu-2"):
        relu = report_line(out, f"{MODELS}:{marker_line(marker)} ")
        assert "nn.ReLU(inplace=True)" in relu and "rewrite" in relu
    summary = report_line(out, "inplace ")
    assert summary.split() == ["inplace", "4", "0", "0"]


def test_batchnorm_exits_1_naming_the_module_and_its_line(capsys):
    code, out, err = run(capsys, "inspect", f"{MODELS}:batchnorm_cnn", "--input", "8,3,16,16")
    assert (code, err) == (1, "")
    row = report_line(out, f"{MODELS}:{marker_line('batchnorm')} ")
    assert row.split()[:6] == ["validate", "error", "cannot", "be", "made", "private"]
    assert " bn " in row and "nn.BatchNorm2d" in row


def test_untraceable_says_why_and_where(capsys):
    code, out, err = run(capsys, "inspect", f"{MODELS}:untraceable", "--input", "8,16")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:2] == [
        "fxdp compile report for DataDependent",
        "traced: no, falling back to the hooks engine (GradSampleModule)",
    ]
    # torch.fx stops at the branch; torch.export (the second front end) cannot capture it either
    assert lines[2].startswith(
        f"fallback reason at {MODELS}:{marker_line('control-flow')}: the model cannot be traced by torch.fx "
        "(TraceError: symbolically traced variables cannot be used as inputs to control flow), nor captured by "
        "torch.export (GuardOnDataDependentSymNode: Could not guard on data-dependent expression")


def test_batch_moves_and_sample_mixing_are_reported_with_their_lines(capsys):
    code, out, err = run(capsys, "inspect", f"{MODELS}:time_major", "--input", "8,5,16")
    assert (code, err) == (0, "")
    row = report_line(out, f"{MODELS}:{marker_line('transpose')} ")
    assert "moves the batch" in row and "transpose" in row

    code, out, err = run(capsys, "inspect", f"{MODELS}:mixing", "--input", "8,16")
    assert (code, err) == (1, "")
    row = report_line(out, f"{MODELS}:{marker_line('mixing')} ")
    assert row.split()[:4] == ["batch_dim", "error", "mixes", "samples"]


def test_inputs_the_model_does_not_accept_are_a_usage_error(capsys):
    code, out, err = run(capsys, "inspect", f"{MODELS}:time_major", "--input", "8,5,3")
    assert (code, out) == (2, "")
    assert err.startswith(
        "fxdp inspect: error: the model's forward fails on --input 8,5,3 (float32): RuntimeError: ")
    assert err.endswith(f" ({MODELS}:{marker_line('time-major-linear')})\n")

    code, out, err = run(capsys, "inspect", f"{MODELS}:untraceable", "--input", "8,16",
                         "--input", "8,16:long")
    assert (code, out) == (2, "")
    assert err == ("fxdp inspect: error: the model's forward fails on --input 8,16 --input 8,16:long "
                   "(float32, int64): TypeError: DataDependent.forward() takes 2 positional arguments but 3 "
                   "were given\n")


def test_strict_mode_stops_at_the_first_error_with_exit_1(capsys):
    code, out, err = run(capsys, "inspect", f"{MODELS}:batchnorm_cnn", "--input", "8,3,16,16", "--strict")
    assert (code, out) == (1, "")
    assert err.startswith("fxdp inspect: ")
    assert "bn" in err and "BatchNorm2d" in err and f"{MODELS}:{marker_line('batchnorm')}" in err


def test_without_inputs_the_report_says_batch_dim_was_skipped(capsys):
    code, out, err = run(capsys, "inspect", f"{MODELS}:mlp")
    assert (code, err) == (0, "")
    assert "batch_dim: not run (no example_inputs)" in out
    assert [line.split()[0] for line in out.splitlines() if line.endswith(" 0")] == ["validate", "inplace"]


def test_module_target_and_integer_inputs(capsys, tmp_path, monkeypatch):
    (tmp_path / "fxdp_cli_embed.py").write_text(
        "from torch import nn\n"
        "def model():\n"
        "    return nn.Sequential(nn.Embedding(5, 4), nn.Flatten(), nn.Linear(12, 2))\n"
    )
    monkeypatch.chdir(tmp_path)  # module targets import from the current directory, as `python -m` does
    code, out, err = run(capsys, "inspect", "fxdp_cli_embed:model", "--input", "8x3", "--dtype", "long",
                         "--high", "5")
    assert (code, err) == (0, ""), err
    assert out.startswith("fxdp compile report for Sequential\ntraced: yes (torch.fx)")
    assert "batch_dim" in out and "not run" not in out


EXPECTED_EXIT = {"resnet_block": 0, "batchnorm_cnn": 1, "untraceable": 0, "time_major": 0, "mixing": 1,
                 "mnist_cnn": 0, "mlp": 0}


def test_every_example_factory_builds_a_documented_training_model_for_its_shape(capsys):
    namespace = runpy.run_path(str(ROOT / MODELS))
    assert set(namespace["INPUT_SHAPES"]) == set(EXPECTED_EXIT)
    for name, shape in namespace["INPUT_SHAPES"].items():
        assert namespace[name].__doc__, f"{name} has no docstring"
        model = load_model(f"{MODELS}:{name}")
        assert all(m.training for m in model.modules()), name
        code, out, err = run(capsys, "inspect", f"{MODELS}:{name}", "--input", ",".join(map(str, shape)))
        assert (code, err) == (EXPECTED_EXIT[name], ""), name


def test_python_dash_m_fxdp_runs_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "fxdp", "inspect", f"{MODELS}:resnet_block", "--input", "8,3,16,16"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert "operator.iadd" in report_line(result.stdout, f"{MODELS}:{marker_line('iadd')} ")
