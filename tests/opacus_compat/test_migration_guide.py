"""docs/migrating_from_opacus.md's import table is the table run_opacus_suite.py rewrites Opacus's tests with,
and every fxdp name in it can be imported."""

import importlib
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("run_opacus_suite", ROOT / "tests/opacus_compat/run_opacus_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc_table():
    rows = re.findall(r"^\| `(\w+)` \| `from ([\w.]+) import (\w+)` \|$",
                      (ROOT / "docs/migrating_from_opacus.md").read_text(), flags=re.M)
    return {name: (module, new) for name, module, new in rows}


def test_the_guide_lists_the_names_the_suite_runner_rewrites():
    assert _doc_table() == _runner().NAMES


@pytest.mark.parametrize("name", sorted(_doc_table()))
def test_every_fxdp_name_in_the_guide_imports(name):
    module, new = _doc_table()[name]
    assert hasattr(importlib.import_module(module), new), f"{name}: from {module} import {new} fails"
