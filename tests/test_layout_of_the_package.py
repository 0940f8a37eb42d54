"""The package's shape: every module imports, the import graph has no cycle (between modules, nor between packages:
``fxdp.<first component>``), no module is too long nor any function (but those named, with why), and the one-way
import rules of the design (DESIGN.md in the shared folder beside the repository, not in it) hold through any chain
of imports, lazy ones too: diagnostics, layout and accounting reach nothing else in fxdp (meta only layout), the
front ends no pass, the runtime no pass and no front end, the engines neither the compiler nor a pass, the passes no
validator (the validators use the passes), the optimizer only the gradient-sink contract; and the README reads at a
glance."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
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


def _package(module: str) -> str:
    """``fxdp.<first component>``: ``fxdp.passes.batch_rules.core`` -> ``fxdp.passes``."""
    return ".".join(module.split(".")[:2])


PACKAGES = nx.DiGraph()  # an edge where any module of one package imports any module of another
for _name in MODULES:
    PACKAGES.add_node(_package(_name))
for _source, _target in GRAPH.edges:
    if _package(_source) != _package(_target):
        PACKAGES.add_edge(_package(_source), _package(_target))

# The gradient-sink contract: all the optimizer may reach in fxdp besides the diagnostics.
SINK_CONTRACT = "fxdp.sinks.contract"


def test_the_walk_finds_the_packages_modules():
    for name in ("fxdp.compiler", "fxdp.engines.hooks", "fxdp.engines.whole_model", "fxdp.runtime.ops",
                 "fxdp.runtime.module", "fxdp.frontends.fx", "fxdp.frontends.export", "fxdp.frontends.folding",
                 "fxdp.diagnostics.errors", "fxdp.grad_sample.generic", SINK_CONTRACT):
        assert name in MODULES
    assert GRAPH.has_edge("fxdp.compiler", "fxdp.engines")  # the graph is built from real imports
    assert GRAPH.has_edge("fxdp.frontends.folding", "fxdp.grad_sample.registry")  # lazy ones too
    assert PACKAGES.has_edge("fxdp.validators", "fxdp.passes")  # and grouped by package


def test_the_import_graph_has_no_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert not cycles, f"modules that import each other (directly or transitively): {cycles}"


def test_no_package_reaches_itself_through_another():
    """No shim module can hide a cycle: the packages' graph has none either, lazy imports included."""
    cycles = [sorted(c) for c in nx.strongly_connected_components(PACKAGES) if len(c) > 1]
    assert not cycles, f"packages that import each other (through any chain of modules): {cycles}"


def _reachable(module: str) -> Set[str]:
    return nx.descendants(GRAPH, module)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("prefix, allowed", [
    ("fxdp.diagnostics", ()),
    ("fxdp.layout", ()),
    ("fxdp.registry", ()),
    ("fxdp.meta", ("fxdp.layout",)),  # the node.meta keys; batch_source reads a BatchLayout back
])
def test_the_leaves_import_nothing_else_from_fxdp(prefix, allowed):
    """What every stage reads (errors and findings, layouts, node.meta keys, the type registry)."""
    for module in [m for m in MODULES if _under(m, prefix)]:
        outside = {m for m in _reachable(module) if not _under(m, prefix) and m not in allowed}
        assert not outside, f"{module} imports {sorted(outside)}"


@pytest.mark.parametrize("importer, forbidden", [
    ("fxdp.frontends", "fxdp.passes"),  # the passes read the graphs the front ends build
    ("fxdp.frontends", "fxdp.compiler"),
    ("fxdp.runtime", "fxdp.passes"),  # compiled code runs without the compiler
    ("fxdp.runtime", "fxdp.frontends"),
    ("fxdp.runtime", "fxdp.compiler"),
    ("fxdp.engines", "fxdp.compiler"),  # the compiler chooses an engine, never the reverse
    ("fxdp.engines", "fxdp.passes"),
    ("fxdp.passes", "fxdp.compiler"),
    ("fxdp.passes", "fxdp.validators"),  # ModuleValidator.fix uses the passes; the validate pass gets its rules
    ("fxdp.accounting", "fxdp"),  # pure math
    ("fxdp.grad_sample", "fxdp.sinks"),  # the sinks read the rules, never the other way round
    ("fxdp.runtime", "fxdp.sinks.bookkeeping"),  # DP-aware ops reach a sink through the contract alone
    # the layer families (fxdp.layers) register rules of the three kinds side by side: no package of rules, nor
    # what runs a compiled model, reaches them (the optimizer's own test covers fxdp.optim)
    ("fxdp.grad_sample", "fxdp.layers"),
    ("fxdp.sinks", "fxdp.layers"),
    ("fxdp.passes", "fxdp.layers"),
    ("fxdp.runtime", "fxdp.layers"),
    ("fxdp.engines", "fxdp.layers"),
])
def test_one_way_imports(importer, forbidden):
    """What a module reaches through any chain of imports (lazy ones too), not only what it names."""
    for module in [m for m in MODULES if _under(m, importer)]:
        reached = {m for m in _reachable(module) if _under(m, forbidden) and not _under(m, importer)}
        assert not reached, f"{module} reaches {sorted(reached)}"


def test_the_optimizer_depends_only_on_the_gradient_sink_contract():
    contract = {SINK_CONTRACT, "fxdp.diagnostics", "fxdp.diagnostics.errors", "fxdp.diagnostics.findings",
                "fxdp.diagnostics.naming", "fxdp.diagnostics.source"}
    for module in [m for m in MODULES if _under(m, "fxdp.optim")]:
        reached = {m for m in _reachable(module) if not _under(m, "fxdp.optim")} - contract
        assert not reached, f"{module} reaches {sorted(reached)}, beyond the gradient-sink contract"


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


def _subclasses(cls: type) -> Set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def test_every_fxdp_error_is_defined_in_diagnostics_errors():
    """One home for every error class (MODULES imported every fxdp module, so all of them are defined);
    users read them as fxdp.errors."""
    from fxdp.diagnostics.errors import FxdpError

    elsewhere = {f"{c.__module__}.{c.__qualname__}" for c in _subclasses(FxdpError)
                 if c.__module__.startswith("fxdp") and c.__module__ != "fxdp.diagnostics.errors"}
    assert not elsewhere, f"FxdpError subclasses defined outside fxdp/diagnostics/errors.py: {sorted(elsewhere)}"
    assert {c.__name__ for c in _subclasses(FxdpError) if c.__module__ == "fxdp.diagnostics.errors"} \
        <= set(fxdp.errors.__all__)


README_MAX_LINES = 150


def test_the_readme_reads_at_a_glance():
    # the details (the speed analysis, the pipeline's files, every option) live in docs/; the README links them
    root = os.path.dirname(os.path.dirname(fxdp.__file__))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    lines = readme.count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move details to docs/ (at most {README_MAX_LINES - 1})"
    linked = set(re.findall(r"docs/[\w./-]+\.md", readme))
    missing = sorted(d for d in linked if not os.path.exists(os.path.join(root, d)))
    assert linked and not missing, f"the README links documents that do not exist: {missing}"


# -- the tests mirror the package -----------------------------------------------------------------------------

TESTS = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(os.path.abspath(fxdp.__file__))
# Folders of tests that are not the tests of one package: shared helpers, Opacus's own suite run on fxdp,
# and whole training runs, examples and real models that cross every package.
NOT_A_PACKAGE = {"support", "opacus_compat", "end_to_end"}
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
        if not os.path.isdir(os.path.join(PACKAGE, *parts)):
            strays.append(relative)
    assert not strays, f"test folders that name no fxdp package (fxdp/<folder>/): {strays}"


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


MAX_FUNCTION_LINES = 80
# The functions still longer, each with why; the list may only shrink (a function that is no longer too long must
# leave it, so that it cannot grow back unnoticed).
LONG_FUNCTIONS = {
    "fxdp.passes.batch_rules.indexing.index_layout": "one case per indexing form (int, slice, None, Ellipsis, "
                                                     "tensor), each a few lines; to be split by form",
    "fxdp.passes.per_sample.insert_per_sample_ops": "the per-sample pass over every node kind in one loop; to be "
                                                    "split by node kind",
}


def _code_lines(node: ast.AST) -> int:
    """A function's lines of code: from its first statement after the docstring to its end."""
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)
    start = body[1].lineno if has_doc and len(body) > 1 else body[0].lineno
    return node.end_lineno - start + 1


def test_no_function_is_over_80_lines_of_code_but_the_named_ones():
    too_long = {}
    for module, path in MODULES.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > MAX_FUNCTION_LINES:
                too_long[f"{module}.{node.name}"] = _code_lines(node)
    assert set(too_long) <= set(LONG_FUNCTIONS), \
        f"functions over {MAX_FUNCTION_LINES} lines of code (docstring aside): " \
        f"{ {k: v for k, v in too_long.items() if k not in LONG_FUNCTIONS} }; split them"
    assert set(LONG_FUNCTIONS) <= set(too_long), \
        f"no longer over {MAX_FUNCTION_LINES} lines: {sorted(set(LONG_FUNCTIONS) - set(too_long))}; take them off " \
        "LONG_FUNCTIONS"
