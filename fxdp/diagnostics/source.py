"""Source locations: the line of the user's code behind a graph node, a traceback or an error.

Library frames (torch's and fxdp's own) are skipped, so a location points at the user's code. A layer
that torch's own code calls (each layer of an ``nn.Sequential``) is located where the user's code built
it instead (:func:`build_location`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import textwrap
import traceback
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# the fxdp package: this file is fxdp/diagnostics/source.py
_FXDP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class SourceLocation:
    """A line of the user's code."""

    file: str
    line: int
    function: str = ""
    code: str = ""
    # the line that constructed a layer, not the line that called it (``code`` stays empty: messages that
    # quote the calling line must not quote a constructor as if it were the call)
    built: bool = False

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" + (" (where the layer was built)" if self.built else "")

    @property
    def where(self) -> str:
        """``file:line`` (relative, see :attr:`relative`); ``built at file:line`` for a construction line."""
        return f"built at {self.relative}" if self.built else self.relative

    @property
    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"

    @property
    def relative(self) -> str:
        """``file:line`` with the file relative to the working directory when it lies under it."""
        return f"{relative_path(self.file)}:{self.line}"


def relative_path(path: str) -> str:
    """``path`` relative to the working directory when it lies under it, else as it is."""
    try:
        absolute = os.path.abspath(path)
        cwd = os.getcwd()
    except OSError:  # the working directory was removed
        return path
    if absolute == cwd or absolute.startswith(cwd + os.sep):
        return os.path.relpath(absolute, cwd)
    return path


def _under(path: str, directory: str) -> bool:
    # a directory and what lies in it, not its siblings: site-packages/torchvision is not torch's
    return path == directory or path.startswith(directory + os.sep)


def is_library_file(filename: str) -> bool:
    """torch's and fxdp's own files; torchvision's are not (a finding in a torchvision model points there)."""
    path = os.path.abspath(filename)
    return _under(path, _TORCH_DIR) or _under(path, _FXDP_DIR)


_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?:    (?P<code>[^\n]*))?')


def location_from_stack_trace(stack_trace: Optional[str]) -> Optional[SourceLocation]:
    """The innermost frame of a formatted stack trace (``node.stack_trace``) that is in the user's code."""
    if not stack_trace:
        return None
    user = None
    for m in _FRAME_RE.finditer(stack_trace):
        if not is_library_file(m["file"]):
            user = SourceLocation(m["file"], int(m["line"]), m["func"], (m["code"] or "").strip())
    return user


def location_from_traceback(tb) -> Optional[SourceLocation]:
    """The innermost frame of a traceback that is in the user's code."""
    user = None
    for frame in traceback.extract_tb(tb):
        if not is_library_file(frame.filename):
            user = SourceLocation(frame.filename, frame.lineno, frame.name, (frame.line or "").strip())
    return user


def location_of_caller() -> Optional[SourceLocation]:
    """The innermost frame of the current call stack that is in the user's code (who called fxdp)."""
    user = None
    for frame in traceback.extract_stack():
        if not is_library_file(frame.filename):
            user = SourceLocation(frame.filename, frame.lineno, frame.name, (frame.line or "").strip())
    return user


# -- where a layer was built ---------------------------------------------------------------------------
#
# nn.Sequential's forward calls its layers, so their call site is torch's own line. The user's line is
# the one that built the layer: found in the __init__ source of the nearest ancestor whose class is the
# user's, following `self.<attr> = nn.Sequential(...)` (and ModuleList / ModuleDict) down to the layer.
# A root nn.Sequential has no such ancestor: its build is looked for in the file that called fxdp, and
# taken only when exactly one call there matches every layer. Each step is checked against the module
# tree (class names, literal arguments); anything uncertain gives None: no line rather than a wrong one.

_FX_DIR = os.path.join(_TORCH_DIR, "fx")


def called_by_torch(stack_trace: Optional[str]) -> bool:
    """Whether the innermost frame of ``stack_trace`` outside the tracer (torch.fx's and fxdp's frames) is
    torch's own code: a layer called by ``nn.Sequential.forward``."""
    for m in reversed(list(_FRAME_RE.finditer(stack_trace or ""))):
        path = os.path.abspath(m["file"])
        if not (_under(path, _FX_DIR) or _under(path, _FXDP_DIR)):
            return _under(path, _TORCH_DIR)
    return False


def build_location(root: nn.Module, qualname: str, caller_file: Optional[str] = None) -> Optional[SourceLocation]:
    """The line of the user's code that constructed the submodule ``qualname`` of ``root`` (``built``
    set), or None when it cannot be told for sure. Never raises.

    Found in the ``__init__`` of the nearest ancestor whose class is the user's. When there is none (the
    root is an ``nn.Sequential`` a function built), in ``caller_file`` (the user's code that called
    fxdp), only if exactly one call there builds a container matching the root in every layer's class
    and every literal argument."""
    try:
        path = qualname.split(".")
        chain = [root]
        for name in path:
            chain.append(chain[-1]._modules[name])
        for k in range(len(path) - 1, -1, -1):
            if _is_user_class(type(chain[k])):
                return _built_in_init(chain[k:], path[k:])
        return _built_in_file(caller_file, chain, path) if caller_file else None
    except Exception:  # noqa: BLE001 - a location is a courtesy: any failure leaves it unknown
        return None


def _built_in_file(file: str, chain: List[nn.Module], path: List[str]) -> Optional[SourceLocation]:
    if is_library_file(file):
        return None
    tree = _parsed_file(file, os.path.getmtime(file))
    if tree is None:
        return None
    calls = [n for n in ast.walk(tree) if _matches(n, chain[0])]
    found = _follow(calls[0], chain, path) if len(calls) == 1 else None
    if found is None:
        return None
    return SourceLocation(file, found.lineno, built=True)


@functools.lru_cache(maxsize=32)
def _parsed_file(file: str, mtime: float):
    try:
        with open(file, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None


def _matches(expr, module: nn.Module) -> bool:
    """Whether ``expr`` matches ``module``: it calls the module's class with arguments that agree with its
    attributes, and (for a container) each of its arguments matches the corresponding layer."""
    if _callee(expr) != type(module).__name__ or not _literals_agree(expr, module):
        return False
    if not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return True
    return all(_matches(_child(expr, module, key), child) for key, child in module._modules.items())


_UNKNOWN = object()


def _literal(node):
    try:
        return ast.literal_eval(node)
    except Exception:  # noqa: BLE001 - not a literal
        pass
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)):
        left, right = _literal(node.left), _literal(node.right)
        if type(left) is int and type(right) is int:  # `16 * 4 * 4`
            ops = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}
            return ops[type(node.op)](left, right)
    return _UNKNOWN


def _literals_agree(call: ast.Call, module: nn.Module) -> bool:
    """No literal argument of ``call`` contradicts the attribute of ``module`` of the same name."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return False
    try:
        bound = inspect.signature(type(module)).bind_partial(
            *map(_literal, call.args), **{k.arg: _literal(k.value) for k in call.keywords})
    except (TypeError, ValueError):
        return False
    for name, value in bound.arguments.items():
        attr = getattr(module, name, _UNKNOWN)
        if value is _UNKNOWN or not isinstance(attr, (int, float, str, tuple)):
            continue
        if isinstance(attr, tuple) and not isinstance(value, tuple):
            value = (value,) * len(attr)  # kernel_size=3 is stored as (3, 3)
        if attr != value:
            return False
    return True


def _is_user_class(cls: type) -> bool:
    try:
        file = inspect.getsourcefile(cls)
    except TypeError:  # its module is not in sys.modules (loaded from a path): its methods know their file
        codes = [v.__code__ for v in vars(cls).values() if hasattr(v, "__code__")]
        file = codes[0].co_filename if codes else None
    return file is not None and not is_library_file(file)


def _built_in_init(chain: List[nn.Module], path: List[str]) -> Optional[SourceLocation]:
    """``chain[0]`` is a module of the user's class; ``path`` leads from it down to ``chain[-1]``."""
    for klass in type(chain[0]).__mro__:  # the __init__ that built the attribute may be a base class's
        if "__init__" not in vars(klass) or not _is_user_class(klass):
            continue
        parsed = _parsed_init(vars(klass)["__init__"])
        if parsed is None:
            continue
        tree, file, first_line = parsed
        found = _unique(_follow(expr, chain[1:], path[1:]) for expr in _assigned(tree, chain[0], path[0]))
        if found is not None:
            return SourceLocation(file, found.lineno + first_line - 1, "__init__", built=True)
    return None


@functools.lru_cache(maxsize=256)
def _parsed_init(init):
    try:
        lines, first_line = inspect.getsourcelines(init)
        return ast.parse(textwrap.dedent("".join(lines))), inspect.getsourcefile(init), first_line
    except (TypeError, OSError, SyntaxError):
        return None


def _unique(nodes) -> Optional[ast.AST]:
    lines = {n.lineno: n for n in nodes if n is not None}
    return next(iter(lines.values())) if len(lines) == 1 else None


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _assigned(tree: ast.AST, module: nn.Module, name: str):
    """The expressions ``__init__`` gives the attribute ``name``: ``self.name = ...``,
    ``self.add_module("name", ...)``, and for a container subclass ``super().__init__(...)``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Attribute) and _is_self(t.value) and t.attr == name for t in targets):
                yield node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (node.func.attr == "add_module" and _is_self(node.func.value) and len(node.args) == 2
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == name):
                yield node.args[1]
            elif (node.func.attr == "__init__" and isinstance(node.func.value, ast.Call)
                  and getattr(node.func.value.func, "id", None) == "super"):
                yield _child(node, module, name)


def _callee(node) -> Optional[str]:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _follow(expr, chain: Sequence[nn.Module], path: Sequence[str]) -> Optional[ast.AST]:
    """The node of ``expr`` that built ``chain[-1]``, where ``expr`` built ``chain[0]`` (checked by the
    name it calls) and ``path`` leads from ``chain[0]`` to ``chain[-1]``."""
    if isinstance(expr, ast.IfExp):  # `nn.ReLU() if relu else nn.GELU()`: the branch that fits
        return _unique([_follow(expr.body, chain, path), _follow(expr.orelse, chain, path)])
    name = _callee(expr)
    if name is None or not chain:
        return None
    if name != type(chain[0]).__name__ and (name[:1].isupper() or path):
        return None  # another class; or a factory function, whose insides this cannot see
    if not path:
        return expr
    child = _child(expr, chain[0], path[0])
    return None if child is None else _follow(child, chain[1:], path[1:])


def _child(call: ast.Call, container: nn.Module, key: str) -> Optional[ast.AST]:
    """The argument of ``call`` (which built ``container``) that built its child ``key``."""
    args = call.args
    if call.keywords or any(isinstance(a, ast.Starred) for a in args):
        return None
    if isinstance(container, nn.Sequential) and len(args) == len(container) and key.isdigit():
        return args[int(key)]
    if len(args) != 1:
        return None
    arg = args[0]
    if isinstance(container, nn.ModuleList) and key.isdigit():
        if isinstance(arg, (ast.List, ast.Tuple)) and len(arg.elts) == len(container):
            return None if any(isinstance(e, ast.Starred) for e in arg.elts) else arg.elts[int(key)]
        if isinstance(arg, (ast.ListComp, ast.GeneratorExp)):
            return arg.elt  # every element is built by this expression
    if isinstance(container, nn.ModuleDict):
        if isinstance(arg, ast.Dict) and all(isinstance(k, ast.Constant) for k in arg.keys):
            values = [v for k, v in zip(arg.keys, arg.values) if k.value == key]
            return values[0] if len(values) == 1 else None
        if isinstance(arg, ast.DictComp):
            return arg.value
    return None
