"""Where the noise of the private gradient is formed: in ``fxdp/optim`` and nowhere else (issue 37, item 5).

A copy of the noise outside the optimizer drifts from it unseen: the FSDP2 optimizer once drew its own (sliced)
noise in ``fxdp/distributed`` and skipped a check the one-process step runs. So no module outside ``fxdp/optim``

- imports a noise function of the optimizer's (``fxdp.optim.noise``, ``fxdp.optim.noise_rows``), but for
  ``IMPORTS_FOR_OTHER_PURPOSES``;
- calls a function that draws Gaussian or Laplace values or adds noise (``DRAWS``: ``torch.normal``, ``randn``,
  ``normal_``, ``add_noise_``, the optimizer's noise helpers, ...), but for the calls named in
  ``DRAWS_FOR_OTHER_PURPOSES``, each with what it draws (inputs, projections for a self-check, a layer's
  initial weights: none reaches a gradient);
- defines a method that forms or adds the step's noise (``NOISE_METHODS``): an optimizer outside ``fxdp/optim``
  overrides what differs (the sums, which rows of the noise it holds, the reduction), never the noise.

The lists may only shrink: an entry no longer found must leave them."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set, Tuple

import fxdp

PACKAGE = os.path.dirname(fxdp.__file__)
OPTIM = os.path.join(PACKAGE, "optim")
NOISE_MODULES = ("fxdp.optim.noise", "fxdp.optim.noise_rows")
DRAWS = {"normal", "normal_", "randn", "randn_like", "Normal", "MultivariateNormal", "Laplace", "laplace",
         "log_normal_", "add_noise", "add_noise_", "add_noise_rows_", "add_gaussian_noise_", "add_gaussian_noise_all_",
         "fused_add_gaussian_noise_", "gaussian_noise", "secure_standard_normal", "unit_draws"}
NOISE_METHODS = {"_add_noise", "add_noise", "add_noise_", "_write_private_grads"}

# (module, the function that imports): why
IMPORTS_FOR_OTHER_PURPOSES: Dict[Tuple[str, str], str] = {
    ("fxdp.privacy_engine", "secure_seed"): "a seed from the OS for the Poisson sampler's generator in secure mode "
                                            "(the sampling, not the noise)",
}
# (module, the enclosing function's qualified name, the function called): what it draws
DRAWS_FOR_OTHER_PURPOSES: Dict[Tuple[str, str, str], str] = {
    ("fxdp.cli", "random_input", "randn"): "example inputs of a float dtype for `fxdp check`",
    ("fxdp.checker", "_projections", "randn"): "random projections of the model's outputs: the checker compares "
                                               "per-sample gradients of their sum with batches of one",
    ("fxdp.engines.hooks", "GradSampleModule._compare_with_batches_of_one", "randn"):
        "random projections of the first batch's outputs for the hooks engine's self-check",
    ("fxdp.graphs.engine", "GraphGradSampleModule._self_check", "randn"):
        "random weights of the first batch's outputs for the graph engine's self-check",
    ("fxdp.audit.digits", "synthetic_digits", "randn"): "the audit's synthetic data set",
    ("fxdp.audit.canaries", "CanaryInputs.like", "randn"): "canary inputs (the audit's inserted samples)",
    ("fxdp.layers.attention", "SequenceBias.reset_parameters", "normal_"): "a layer's initial weights",
}


def _module_of(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return relative[: -len(".__init__")] if relative.endswith(".__init__") else relative


def _sources_outside_optim() -> Dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        if folder == OPTIM or folder.startswith(OPTIM + os.sep):
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[_module_of(path)] = open(path, encoding="utf-8").read()
    return found


def _called_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def noise_findings(module: str, source: str) -> Tuple[Set[tuple], Set[tuple], List[str]]:
    """What ``source`` (the module ``module``) does with noise: its imports of the optimizer's noise functions
    ``{(module, name)}``, its draws ``{(module, enclosing function, called)}``, and its definitions of a noise
    method (``module.qualified name``)."""
    imports, draws, methods = set(), set(), []

    def visit(node: ast.AST, scope: List[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = scope + [child.name]
                if not isinstance(child, ast.ClassDef) and child.name in NOISE_METHODS:
                    methods.append(f"{module}.{'.'.join(inner)}")
            elif isinstance(child, ast.ImportFrom) and child.module in NOISE_MODULES:
                imports.update((module, alias.name) for alias in child.names)
            elif isinstance(child, ast.Import) and any(a.name in NOISE_MODULES for a in child.names):
                imports.add((module, "*"))
            elif isinstance(child, ast.Call) and _called_name(child) in DRAWS:
                draws.add((module, ".".join(scope), _called_name(child)))
            visit(child, inner)

    visit(ast.parse(source), [])
    return imports, draws, methods


def _findings() -> Tuple[Set[tuple], Set[tuple], List[str]]:
    imports, draws, methods = set(), set(), []
    for module, source in _sources_outside_optim().items():
        i, d, m = noise_findings(module, source)
        imports |= i
        draws |= d
        methods += m
    return imports, draws, methods


def test_no_module_outside_optim_forms_a_noised_gradient():
    imports, draws, methods = _findings()
    assert not methods, f"methods that form or add the step's noise outside fxdp/optim: {methods}; override what " \
                        "differs (the sums, _noise_rows, _reduce) and let fxdp/optim form the noise"
    assert imports <= set(IMPORTS_FOR_OTHER_PURPOSES), \
        f"imports of the optimizer's noise outside fxdp/optim: {sorted(imports - set(IMPORTS_FOR_OTHER_PURPOSES))}"
    assert draws <= set(DRAWS_FOR_OTHER_PURPOSES), \
        f"Gaussian/Laplace draws or added noise outside fxdp/optim: {sorted(draws - set(DRAWS_FOR_OTHER_PURPOSES))}; " \
        "form the private gradient's noise in fxdp/optim, or name a draw for another purpose in " \
        "DRAWS_FOR_OTHER_PURPOSES with what it draws"


def test_the_named_exceptions_are_all_still_there():
    imports, draws, _ = _findings()
    assert set(IMPORTS_FOR_OTHER_PURPOSES) <= imports, \
        f"no longer found, take them off: {sorted(set(IMPORTS_FOR_OTHER_PURPOSES) - imports)}"
    assert set(DRAWS_FOR_OTHER_PURPOSES) <= draws, \
        f"no longer found, take them off: {sorted(set(DRAWS_FOR_OTHER_PURPOSES) - draws)}"


def test_the_check_finds_noise_drawn_and_sliced_outside_optim():
    """What the FSDP2 optimizer did in fxdp/distributed before its noise moved to fxdp/optim/noise_rows.py: the
    check finds all three kinds."""
    source = '''
from fxdp.optim.noise import add_gaussian_noise_

class FullyShardedDPOptimizer(DPOptimizer):
    def _add_noise(self, params, shards, std):
        for p, shard in zip(params, shards):
            noise = torch.zeros(p.shape, dtype=shard.dtype, device=p.device)
            add_gaussian_noise_(noise, std, secure_mode=self.secure_mode, generator=self.generator)
            shard += noise[self.rank * self._chunk(p):][:shard.shape[0]]

def elsewhere(grads, std):
    for g in grads:
        g.add_(torch.randn_like(g) * std)
'''
    module = "fxdp.distributed.sharded_optimizer"
    imports, draws, methods = noise_findings(module, source)
    assert imports == {(module, "add_gaussian_noise_")}
    assert draws == {(module, "FullyShardedDPOptimizer._add_noise", "add_gaussian_noise_"),
                     (module, "elsewhere", "randn_like")}
    assert methods == [f"{module}.FullyShardedDPOptimizer._add_noise"]
