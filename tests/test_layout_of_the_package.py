"""The package's shape: every module imports, the import graph has no cycle, no module is too long,
and the one-way import rules hold through any chain of imports, lazy ones too (diagnostics, layout and
accounting reach nothing else in fxdp, the runtime no pass, the engines not the compiler, the optimizer
only the gradient-sink contract; the validators name no pass)."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
from typing import Dict, Set

import networkx as nx
import pytest

import fxdp

MAX_LINES = 700


def _modules() -> Dict[str, str]:
    """{module name: source file} for fxdp and every module under it."""
    found = {"fxdp": fxdp.__file__}
    for info in pkgutil.walk_packages(fxdp.__path__, prefix="fxdp."):
        found[info.name] = info.module_finder.find_spec(info.name).origin
        if not info.name.endswith("__main__"):  # that one runs the command line when imported
            importlib.import_module(info.name)  # every module imports
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The fxdp module an import names (``fxdp.a.b.func`` -> ``fxdp.a.b``)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: str) -> Set[str]:
    """The fxdp modules ``module`` imports anywhere in its source (lazy imports in functions count)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    targets: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        targets |= {_resolve(n) for n in names if n == "fxdp" or n.startswith("fxdp.")}
    targets.discard(module)
    return targets


GRAPH = nx.DiGraph()
for _name, _path in MODULES.items():
    GRAPH.add_node(_name)
    for _target in _imports(_name, _path):
        GRAPH.add_edge(_name, _target)


def test_the_walk_finds_the_packages_modules():
    for name in ("fxdp.compiler", "fxdp.engines.hooks", "fxdp.engines.whole_model", "fxdp.runtime.ops",
                 "fxdp.diagnostics.errors", "fxdp.grad_sample.generic", "fxdp.grad_sample.sink"):
        assert name in MODULES
    assert GRAPH.has_edge("fxdp.compiler", "fxdp.engines")  # the graph is built from real imports
    assert GRAPH.has_edge("fxdp.validators.module_validator", "fxdp.rewrite_inplace")  # lazy ones too


def test_the_import_graph_has_no_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert not cycles, f"modules that import each other (directly or transitively): {cycles}"


def _reachable(module: str) -> Set[str]:
    return nx.descendants(GRAPH, module)


@pytest.mark.parametrize("prefix", ["fxdp.diagnostics", "fxdp.layout"])
def test_diagnostics_and_layout_import_nothing_else_from_fxdp(prefix):
    for module in [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]:
        outside = {m for m in _reachable(module) if not (m == prefix or m.startswith(prefix + "."))}
        assert not outside, f"{module} imports {sorted(outside)}"


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("importer, forbidden", [
    ("fxdp.runtime", "fxdp.passes"),
    ("fxdp.engines", "fxdp.compiler"),
    ("fxdp.accounting", "fxdp"),  # pure math
])
def test_one_way_imports(importer, forbidden):
    """What a module reaches through any chain of imports (lazy ones too), not only what it names."""
    for module in [m for m in MODULES if _under(m, importer)]:
        reached = {m for m in _reachable(module) if _under(m, forbidden) and not _under(m, importer)}
        assert not reached, f"{module} reaches {sorted(reached)}"


def test_the_optimizer_depends_only_on_the_gradient_sink_contract():
    contract = {"fxdp.grad_sample.sink", "fxdp.diagnostics", "fxdp.diagnostics.errors",
                "fxdp.diagnostics.findings", "fxdp.diagnostics.naming", "fxdp.diagnostics.source"}
    for module in [m for m in MODULES if _under(m, "fxdp.optim")]:
        reached = {m for m in _reachable(module) if not _under(m, "fxdp.optim")} - contract
        assert not reached, f"{module} reaches {sorted(reached)}, beyond the gradient-sink contract"


def test_the_validators_name_no_pass():
    # Direct imports only: the validators still reach fxdp.passes.inplace through the fxdp.rewrite_inplace
    # shim, which the house's next step (issue 24) removes; then this joins the reachability rules above.
    for module in [m for m in MODULES if _under(m, "fxdp.validators")]:
        reached = {m for m in GRAPH.successors(module) if _under(m, "fxdp.passes")}
        assert not reached, f"{module} imports {sorted(reached)}"


def test_no_module_is_over_700_lines():
    root = os.path.dirname(os.path.dirname(fxdp.__file__))
    too_long = {}
    for path in MODULES.values():
        relative = os.path.relpath(path, root)
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            too_long[relative] = lines
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"


# -- the tests mirror the package -----------------------------------------------------------------------------

TESTS = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(os.path.abspath(fxdp.__file__))
# Folders of tests that are not the tests of one package: shared helpers, Opacus's own suite run on fxdp,
# and whole training runs, examples and real models that cross every package.
NOT_A_PACKAGE = {"support", "opacus_compat", "end_to_end"}
# Packages of the target layout (DESIGN.md "Layout as it grows") whose tests are already in place while the
# package itself is still being created. Empty it once fxdp/<name>/ exists.
PACKAGES_ON_THE_WAY = {"frontends", "sinks"}
# Top-level test files that test no one module of fxdp's top level.
NOT_A_MODULE = {"test_layout_of_the_package.py"}


def _test_folders():
    """Every folder under tests/, as a path relative to tests/ (``passes/batch_rules``)."""
    for folder, children, _ in os.walk(TESTS):
        children[:] = sorted(c for c in children if c != "__pycache__")
        if folder != TESTS:
            yield os.path.relpath(folder, TESTS)


def test_no_test_file_is_over_700_lines():
    too_long = {}
    for folder, _, files in os.walk(TESTS):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                lines = sum(1 for _ in f)
            if lines > MAX_LINES:
                too_long[os.path.relpath(path, TESTS)] = lines
    assert not too_long, f"test files over {MAX_LINES} lines: {too_long}"


def test_every_test_folder_names_a_package():
    """tests/<package>/... holds the tests of fxdp/<package>/..., so a file's tests are found by its path."""
    strays = []
    for relative in _test_folders():
        parts = relative.split(os.sep)
        if parts[0] in NOT_A_PACKAGE:
            continue
        if not os.path.isdir(os.path.join(PACKAGE, *parts)) and relative not in PACKAGES_ON_THE_WAY:
            strays.append(relative)
    assert not strays, f"test folders that name no fxdp package (fxdp/<folder>/): {strays}"


def test_packages_on_the_way_are_not_yet_there():
    """Once one of them exists, it leaves PACKAGES_ON_THE_WAY (and its tests are checked like the rest)."""
    arrived = sorted(name for name in PACKAGES_ON_THE_WAY if os.path.isdir(os.path.join(PACKAGE, name)))
    assert not arrived, f"fxdp/{arrived}/ exist now: remove them from PACKAGES_ON_THE_WAY"


def test_top_level_test_files_name_a_top_level_module():
    modules = {name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__init__.py"}
    strays = [name for name in sorted(os.listdir(TESTS))
              if name.startswith("test_") and name.endswith(".py") and name not in NOT_A_MODULE
              and not any(name == f"test_{m}.py" or name.startswith(f"test_{m}_") for m in modules)]
    assert not strays, f"top-level test files that name no top-level module of fxdp: {strays}"


def test_every_test_folder_is_a_package_so_test_files_may_share_a_name():
    """Without ``__init__.py`` two ``test_registry.py`` in different folders would be one module to pytest."""
    missing = [relative for relative in _test_folders()
               if not os.path.isfile(os.path.join(TESTS, relative, "__init__.py"))]
    assert not missing, f"test folders without __init__.py: {missing}"
