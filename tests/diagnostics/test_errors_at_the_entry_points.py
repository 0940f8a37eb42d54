"""Errors a person reads at the entry points: what is not a model, example inputs of the wrong shape.

These once gave raw AttributeErrors, and torch printed its own logged traceback (and pasted its
frames into fxdp's message) before fxdp's error.
"""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdp
from fxdp.passes.batch_dim import BatchDimAnalysisError

ROOT = Path(__file__).resolve().parents[2]
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"  # what printed the traceback


def a_function(x):
    return x * 2


@pytest.mark.parametrize("entry, call", [(fxdp.compile_for_dp, "fxdp.compile_for_dp(model, ...)"),
                                         (fxdp.inspect, "fxdp.inspect(model, ...)")])
@pytest.mark.parametrize("given, described", [
    (a_function, "the function 'a_function'; wrap it in an nn.Module whose forward calls it, with its "
                 "parameters registered on the module"),
    (None, "None"),
    (nn.Linear, "the class nn.Linear itself, not an instance; pass one, e.g. Linear(...)"),
    ({"fc": nn.Linear(2, 2)}, "a dict"),
])
def test_what_is_not_a_model_is_a_type_error_naming_it(entry, call, given, described):
    with pytest.raises(TypeError) as info:
        entry(given, torch.randn(2, 2))
    assert str(info.value) == f"{call} expects a torch.nn.Module, got {described}"


def wrong_shape(at: str = "") -> str:
    return (
        f"fxdp batch_dim: running nn.Linear (node _0){at} on the example inputs' shapes failed: RuntimeError: a "
        "and b must have same reduction dim, but got [8, 5] X [4, 3].\n"
        "  node: %_0 : [num_users=1] = call_module[target=0](args = (%input_1,), kwargs = {})\n"
        "Check that example_inputs have the shapes and dtypes the model is trained with.")


def mlp():
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


# called from this file, the layer is located where this file built it; from `python -c`, nowhere
WRONG_SHAPE = wrong_shape(f" at {os.path.abspath(__file__)}:{inspect.getsourcelines(mlp)[1] + 1} "
                          "(where the layer was built)")


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def torch_log():
    """What torch's fake-tensor logger emits (torch gives it a stderr handler of its own)."""
    logger, recorder = logging.getLogger(FAKE_TENSOR_LOGGER), Recorder()
    level = logger.level
    logger.addHandler(recorder)
    yield recorder
    logger.removeHandler(recorder)
    assert logger.level == level  # the analysis left the logger as it was


@pytest.mark.parametrize("analyse", [
    lambda m, x: fxdp.inspect(m, x),
    lambda m, x: fxdp.compile_for_dp(m, x),
    lambda m, x: fxdp.find_batch_dim_violations(m, x),
    lambda m, x: fxdp.compile_for_dp(m)(x),  # without example inputs: analysed on the first batch
], ids=["inspect", "compile_for_dp", "find_batch_dim_violations", "first_batch"])
def test_wrong_shaped_example_inputs_show_fxdps_error_and_nothing_else(torch_log, analyse):
    with pytest.raises(BatchDimAnalysisError) as info:
        analyse(mlp(), torch.randn(8, 5))
    assert str(info.value) == WRONG_SHAPE  # no "While executing ... Original traceback" pasted in
    assert torch_log.messages == []  # no logged traceback


def test_the_logger_keeps_a_level_the_user_set_and_logs_again_after_the_analysis(torch_log):
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    saved = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pytest.raises(BatchDimAnalysisError):
            fxdp.inspect(mlp(), torch.randn(8, 5))
        assert logger.level == logging.INFO
        logger.error("outside the analysis")
    finally:
        logger.setLevel(saved)
    assert torch_log.messages == ["outside the analysis"]  # torch's own logging still works


SCRIPT = """
import torch, fxdp
from torch import nn
model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
for analyse in (lambda: fxdp.inspect(model, torch.randn(8, 5)), lambda: fxdp.compile_for_dp(model)(torch.randn(8, 5))):
    try:
        analyse()
    except Exception as exc:
        print(type(exc).__name__, exc, sep=": ")
"""


def test_what_the_terminal_shows_for_wrong_shaped_inputs():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stderr == ""
    assert result.stdout == 2 * f"BatchDimAnalysisError: {wrong_shape()}\n"
