"""Pass 1, validate: findings about layers and configurations that DP-SGD cannot train as they are.

Per node, with the user's source line:

- errors: what the ModuleValidator rules say about each called module (BatchNorm in training,
  InstanceNorm with running statistics, user rules); ``F.batch_norm`` / ``torch.batch_norm`` in
  training; ``F.instance_norm`` updating running statistics; a model not in training mode; a
  trainable model whose forward writes into a buffer (directly in the graph, or inside a leaf module);
- notes: frozen parameters, parameters used more than once (tied weights, a module called twice),
  parametrised leaf modules without a hand-written per-sample rule (they use the functorch rule),
  parametrized modules (``weight_norm``, ``spectral_norm``: their real parameters use the generic rule);
- errors: a parametrization that updates buffers in training (``spectral_norm``) on a layer called
  more than once per forward.

The graph is not changed.

The module rules (which layer types DP-SGD cannot train as they are) come in as ``validator_class``:
the compiler passes ``fxdp.validators.ModuleValidator`` (a subclass brings rules of its own).
The pass does not import the validators: ``ModuleValidator`` is the user's tool above the pipeline (its
``fix(remove_inplace_ops=True)`` runs the front end and the inplace pass), so the imports go one way,
validators -> passes, and the pass reads the rules through the small :class:`ModuleRules` interface.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from fxdp.diagnostics import (ROOT_NAME, Finding, IllegalModuleConfigurationError, Kind, PassReport, PassResult,
                              Severity, SourceLocation, UnsupportedError, UnsupportedModuleError, error_from_finding,
                              op_name)
from fxdp.grad_sample.recurrent import recurrent_rule_applies
from fxdp.grad_sample.transformer import transformer_rule_applies
from fxdp.grad_sample.registry import find_grad_sampler, parametrized_grad_sampler
from fxdp.passes.inplace import alias_root, attribute_kind, find_inplace_op
from fxdp.frontends.fx import DPTracer, source_location

PASS_NAME = "validate"


class ModuleRules(Protocol):
    """What the pass reads of the module rules (``fxdp.validators.ModuleValidator`` or a subclass)."""

    def module_errors(self, module: nn.Module, *, prefix: str = "") -> List[UnsupportedError]:
        """What the rules say about ``module`` and its submodules (``prefix``: its qualified name)."""


_BUFFER_WRITE_FIX = (
    "do not update buffers or parameters in the forward pass of a model trained with DP-SGD: compute "
    "the value without storing it, or update the state outside the training step from public data."
)


def validate_graph(
    gm: torch.fx.GraphModule,
    *,
    validator_class: ModuleRules,
    strict: bool = False,
) -> PassResult:
    """Check every node of ``gm`` (unchanged) and report what stands in the way of DP-SGD.

    ``validator_class`` holds the module rules: ``fxdp.validators.ModuleValidator``, or a subclass of it
    that brings its own.

    Raises:
        UnsupportedModuleError: with ``strict=True``, if any finding is an error; its ``errors``
            list them all.
    """
    findings: List[Finding] = []
    if not gm.training:
        findings.append(model_not_training_error(gm).to_finding(PASS_NAME, node=ROOT_NAME, op=type(gm).__name__))
    trainable = any(p.requires_grad for p in gm.parameters())
    uses: Dict[nn.Parameter, List[Node]] = {}
    for node in gm.graph.nodes:
        location = source_location(node)
        if node.op == "call_module":
            findings += _check_module_call(gm, node, location, validator_class, uses)
        elif node.op == "get_attr":
            findings += _check_attribute(gm, node, location, uses)
        elif node.op == "call_function":
            findings += _check_function(node, location)
        if trainable:
            findings += _check_buffer_write(gm, node, location)
    findings += _check_shared_parameters(gm, uses)
    findings += _check_stateful_parametrizations(gm)
    if strict:
        errors = [f for f in findings if f.severity is Severity.ERROR]
        if errors:
            raise UnsupportedModuleError.aggregate(
                [error_from_finding(f) for f in errors],
                header=f"{len(errors)} problem(s) prevent training {type(gm).__name__} with DP-SGD:",
            )
    return PassResult(gm, PassReport(PASS_NAME, (), tuple(findings)))


def model_not_training_error(module: nn.Module) -> IllegalModuleConfigurationError:
    """The model is in eval mode (this pass and ``ModuleValidator.validate`` both say so)."""
    return IllegalModuleConfigurationError(
        "the model is in eval mode; DP-SGD trains it, and layers such as Dropout and the per-sample "
        "gradient computation need training mode.",
        module_name=ROOT_NAME,
        module_type=type(module),
        fix="call model.train() before making it private.",
    )


def _finding(node: str, op: str, kind: Kind, severity: Severity, message: str, fix: str = "",
             location: Optional[SourceLocation] = None) -> Finding:
    return Finding(PASS_NAME, node, op, kind, severity, message, fix, location)


def _check_module_call(gm, node: Node, location, validator_class, uses) -> List[Finding]:
    module = gm.get_submodule(node.target)
    op = op_name(module)
    findings = [
        _finding(node.name, op if e.module_name == node.target else e.type_name, e.kind, Severity.ERROR,
                 e.message if e.module_name == node.name else f"`{e.module_name}`: {e.message}", e.fix, location)
        for e in validator_class.module_errors(module, prefix=node.target)
    ]
    check_module = getattr(find_grad_sampler(module), "check_module", None)  # what the layer's rule refuses
    for kind, message, fix in (check_module(node.target, module) if check_module is not None else ()):
        findings.append(_finding(node.name, op, kind, Severity.ERROR, message, fix, location))
    has_errors = bool(findings)
    params = dict(module.named_parameters())
    for p in params.values():
        uses.setdefault(p, []).append(node)
    frozen = [name for name, p in params.items() if not p.requires_grad]
    if frozen:
        findings.append(_finding(
            node.name, op, Kind.NOTE, Severity.INFO,
            f"`{node.target}` has frozen parameters (requires_grad=False): "
            f"{', '.join(f'`{n}`' for n in frozen)}; they get no per-sample gradients and are not updated.",
            "", location,
        ))
    if any(p.requires_grad for p in params.values()) and not has_errors:
        if find_grad_sampler(module) is None and not recurrent_rule_applies(module) and not transformer_rule_applies(module):
            findings.append(_finding(
                node.name, op, Kind.NOTE, Severity.INFO,
                f"`{node.target}` ({op}) has no hand-written per-sample gradient rule; it will use the "
                f"generic functorch rule (correct, usually slower).",
                "register one with @fxdp.register_grad_sampler if it is a hot spot.", location,
            ))
        elif find_grad_sampler(module) is parametrized_grad_sampler:
            real = ", ".join(f"`{name}`" for name, p in params.items() if p.requires_grad)
            findings.append(_finding(
                node.name, op, Kind.NOTE, Severity.INFO,
                f"`{node.target}` is parametrized (torch.nn.utils.parametrize: weight_norm, spectral_norm, ...): "
                f"its trainable parameters {real} get per-sample gradients by the generic rule, through the "
                f"parametrization (not the rule of {type(module).__mro__[1].__name__}).",
                "", location,
            ))
        findings += _check_leaf_buffer_writes(node, module, op, location)
    return findings


def _check_leaf_buffer_writes(node: Node, module: nn.Module, op: str, location) -> List[Finding]:
    """A trainable leaf module that writes into its own buffers in forward (e.g. running statistics)."""
    if not any(True for _ in module.buffers()) or type(module).__module__.startswith("torch.nn"):
        return []  # torch.nn layers with buffers are the norms, which the validators cover
    tracer = DPTracer()  # buffers are get_attr nodes: writes into them show up (and do not run)
    try:
        inner_gm = torch.fx.GraphModule(module, tracer.trace(module))
    except Exception as exc:  # untraceable Python is a reported outcome, not a failure of the pass
        return [_finding(
            node.name, op, Kind.UNVERIFIED, Severity.INFO,
            f"`{node.target}` has buffers and could not be traced to check whether its forward updates "
            f"them ({type(exc).__name__}: {exc}).",
            "", location,
        )]
    findings, seen = [], set()
    for inner in inner_gm.graph.nodes:
        written = _written_state(inner_gm, inner)
        if written is not None and written not in seen:
            seen.add(written)
            findings.append(_finding(
                node.name, op, Kind.CANNOT_BE_PRIVATE, Severity.ERROR,
                f"`{node.target}` ({op}) has trainable parameters and updates its {written[0]} "
                f"`{written[1]}` in forward; state computed from the batch is released without noise.",
                _BUFFER_WRITE_FIX, location,
            ))
    return findings


def _written_state(gm, node: Node) -> Optional[Tuple[str, str]]:
    """The buffer or parameter ``node`` writes into in place, if any: (kind, qualified name)."""
    op = find_inplace_op(node, gm)
    if op is None or not isinstance(op.mutated, Node):
        return None
    root = alias_root(op.mutated, gm)
    if root.op != "get_attr":
        return None
    kind = attribute_kind(gm, root.target)
    return (kind, root.target) if kind in ("buffer", "parameter") else None


def _check_buffer_write(gm, node: Node, location) -> List[Finding]:
    written = _written_state(gm, node)
    if written is None:
        return []
    op = find_inplace_op(node, gm)
    return [_finding(
        node.name, op.old, Kind.CANNOT_BE_PRIVATE, Severity.ERROR,
        f"forward writes into {written[0]} `{written[1]}` in place; state computed from the batch is "
        f"released without noise, and the write cannot be rewritten out of place.",
        _BUFFER_WRITE_FIX, location,
    )]


def _check_attribute(gm, node: Node, location, uses) -> List[Finding]:
    value = _get_attr(gm, node.target)
    if not isinstance(value, nn.Parameter):
        return []
    for user in node.users:
        uses.setdefault(value, []).append(user)
    if value.requires_grad:
        return []
    return [_finding(
        node.name, "get_attr", Kind.NOTE, Severity.INFO,
        f"parameter `{node.target}` is frozen (requires_grad=False); it gets no per-sample gradient and "
        f"is not updated.",
        "", location,
    )]


def _get_attr(gm, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _argument(node: Node, index: int, name: str, default=None):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def _check_function(node: Node, location) -> List[Finding]:
    target = node.target
    if target is F.batch_norm or target is torch.batch_norm:
        training = _argument(node, 5, "training", False)
        if training is True or isinstance(training, Node):
            return [_finding(
                node.name, op_name(target), Kind.CANNOT_BE_PRIVATE, Severity.ERROR,
                f"`{op_name(target)}` with training=True normalises each sample with statistics of "
                f"the whole batch, so samples influence each other.",
                "use F.group_norm / nn.GroupNorm (or F.layer_norm), or pass training=False with fixed "
                "running statistics.",
                location,
            )]
    if target is F.instance_norm or target is torch.instance_norm:
        functional = target is F.instance_norm
        running_mean = _argument(node, 1 if functional else 3, "running_mean")
        use_input_stats = _argument(node, 5, "use_input_stats", True if functional else None)
        if running_mean is not None and use_input_stats is not False:
            return [_finding(
                node.name, op_name(target), Kind.ILLEGAL_CONFIGURATION, Severity.ERROR,
                f"`{op_name(target)}` updates running statistics from the batch; they would be "
                f"released without noise.",
                "pass running_mean=None and running_var=None (nn.InstanceNorm: track_running_stats=False).",
                location,
            )]
    return []


def _check_stateful_parametrizations(gm) -> List[Finding]:
    """A parametrization that updates buffers in training (spectral_norm's power iteration) on a layer
    called more than once per forward: each call updates them, and the per-sample rule, run in
    backward, sees only the last values, so the earlier calls' per-sample gradients would be wrong."""
    calls: Dict[str, List[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls.setdefault(node.target, []).append(node)
    findings = []
    for target, nodes in calls.items():
        module = gm.get_submodule(target)
        if len(nodes) < 2 or find_grad_sampler(module) is not parametrized_grad_sampler:
            continue
        stateful = [m for m in module.parametrizations.modules() if m.training and any(True for _ in m.buffers(recurse=False))]
        if stateful:
            findings.append(_finding(
                nodes[1].name, op_name(module), Kind.NOT_YET_SUPPORTED, Severity.ERROR,
                f"`{target}` is called {len(nodes)} times per forward and its parametrization "
                f"({type(stateful[0]).__name__}) updates its buffers in each call in training mode; per-sample "
                "gradients are computed in backward with the buffers of the last call only, so the other calls' "
                "would be wrong.",
                f"call `{target}` once per forward, or put its parametrizations in eval mode "
                f"(`model.{target}.parametrizations.eval()`) so that they use their buffers as they are.",
                source_location(nodes[1]),
            ))
    return findings


def _check_shared_parameters(gm, uses: Dict[nn.Parameter, List[Node]]) -> List[Finding]:
    names: Dict[nn.Parameter, List[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    findings = []
    for p, nodes in uses.items():
        if not p.requires_grad:
            continue
        aliases = names.get(p, [])
        if len(nodes) < 2 and len(aliases) < 2:
            continue
        first = nodes[0]
        also = f" (also reachable as {', '.join(f'`{a}`' for a in aliases[1:])})" if len(aliases) > 1 else ""
        findings.append(_finding(
            first.name, "parameter", Kind.NOTE, Severity.INFO,
            f"parameter `{aliases[0] if aliases else '?'}`{also} is used by {len(nodes)} node(s): "
            f"{', '.join(n.name for n in nodes)}; its per-sample gradient is the sum over these uses.",
            "", source_location(first),
        ))
    return findings
