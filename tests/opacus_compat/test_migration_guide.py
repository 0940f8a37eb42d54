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


def test_every_difference_by_design_is_explained_in_the_guide():
    guide = (ROOT / "docs/migrating_from_opacus.md").read_text()
    for test, (why, section) in _runner().DIFFERENT_BY_DESIGN.items():
        heading, _, item = section.partition(": ")
        assert why and f"\n## {heading}\n" in guide, f"{test}: no section {heading!r} in the guide"
        part = guide.split(f"\n## {heading}\n")[1].split("\n## ")[0]
        assert f"- **{item}" in part, f"{test}: no item {item!r} under {heading!r}"


def test_the_summary_prints_both_figures_and_requires_each(capsys):
    runner = _runner()
    design = sorted(runner.DIFFERENT_BY_DESIGN)[:2]
    tests = ["a_test.py::T::test_one", "a_test.py::T::test_two", "a_test.py::T::test_three", *design]
    outcomes = {tests[0]: ("passed", ""), tests[1]: ("passed", ""), tests[2]: ("failure", "AssertionError: 1 != 2"),
                design[0]: ("failure", "AssertionError: refused"), design[1]: ("failure", "ValueError: no")}
    assert runner.summarise(tests, outcomes, 0.4, 0.6) == 0
    out = capsys.readouterr().out
    assert "2 of 5 counted tests pass on fxdp (40.0%); required 40.0%" in out
    assert "2 of 3 counted tests, less the 2 different by design, pass on fxdp (66.7%); required 60.0%" in out
    assert f"  {design[0]}: AssertionError: refused\n      why: " in out
    assert "failing on fxdp (1):\n  a_test.py::T::test_three: failure: AssertionError: 1 != 2" in out
    assert runner.summarise(tests, outcomes, 0.4, 0.7) == 1
    assert runner.summarise(tests, outcomes, 0.5, 0.6) == 1
