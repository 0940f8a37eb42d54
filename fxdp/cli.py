"""The ``fxdp`` command line.

``fxdp inspect TARGET --input SHAPE ...`` loads a model and prints its compile report. Exit codes:
0 the report has no errors, 1 it has ERROR findings (or a pass raised: with ``--strict``, on the
first problem), 2 usage errors (bad target, shape, dtype, inputs the model does not accept, ...).
Each subcommand is one ``_cmd_*`` function, so later commands (``fxdp train``) slot in next to it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect as pyinspect
import math
import os
import re
import sys
import sysconfig
import traceback
import types
from typing import Optional, Sequence

import torch
from torch import nn

import fxdp
from fxdp.audit import command as audit_command

EXIT_OK = 0
EXIT_ERRORS = 1
EXIT_USAGE = 2

TARGET_EXAMPLE = "examples/models.py:resnet_block"

# dtypes an --input can have (floating ones are drawn from N(0, 1), integer ones from [0, --high)).
DTYPES = {
    "float32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64,
    "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "short": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


class UsageError(Exception):
    """Something on the command line (or the target it names) is wrong; exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``fxdp inspect: error: ...``), not usage text and a line."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


# --------------------------------------------------------------------------- loading the model


def _load_file(path: str):
    if not os.path.exists(path):
        raise UsageError(f"no such file: {path!r}")
    if os.path.isdir(path):
        raise UsageError(f"{path!r} is a directory; expected a Python file, e.g. {TARGET_EXAMPLE}")
    # The file's directory goes on sys.path, as with `python FILE`, so its sibling imports work.
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)
    stem = os.path.splitext(os.path.basename(path))[0]
    name = stem if stem not in sys.modules else f"_fxdp_cli_{stem}"
    module = types.ModuleType(name)
    module.__file__ = os.path.abspath(path)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        with open(path, "rb") as f:
            # Compiled under the path as typed, so reports print it that way (examples/models.py:42)
            # rather than as a long absolute path.
            code = compile(f.read(), path, "exec")
        exec(code, module.__dict__)
    except (Exception, SystemExit) as exc:  # SystemExit in a script body is a failed import too
        del sys.modules[name]
        raise UsageError(f"importing {path!r} failed: {_describe(exc)}") from exc
    return module


def _import_module(name: str):
    # As with `python -m`, modules in the current directory are importable.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as exc:
        as_file = os.path.join(*name.split(".")) + ".py"
        hint = f"; to load the file, give it as {as_file}:FACTORY" if os.path.isfile(as_file) else ""
        raise UsageError(f"cannot import module {name!r}: {_describe(exc)}{hint}") from exc


def _describe(exc: BaseException) -> str:
    """``Type: message`` plus the innermost user-code line that raised, on one line."""
    if isinstance(exc, SyntaxError):  # its str() already carries a location, in another format
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}:{exc.lineno})"
    text = str(exc).strip().splitlines()
    desc = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if frames:
        desc += f" ({frames[-1].filename}:{frames[-1].lineno})"
    return desc


_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, fxdp))


def _is_user_file(filename: str) -> bool:
    # Frames of importlib, the standard library, torch and fxdp are not where the user's problem is.
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_LIBRARY_DIRS):
        return False
    return not (path.startswith(_STDLIB + os.sep) and "site-packages" not in path)


def _needs_arguments(obj) -> bool:
    try:
        params = pyinspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in params)


def available_factories(module) -> list:
    """Names in ``module`` that ``fxdp inspect`` can load: functions and nn.Module instances, then nn.Module
    classes; only those defined there that need no arguments, each group in file order."""
    factories, classes = [], []
    for name, obj in vars(module).items():
        if name.startswith("_"):
            continue
        if isinstance(obj, nn.Module):
            factories.append(name)
        elif getattr(obj, "__module__", None) != module.__name__ or _needs_arguments(obj):
            continue
        elif pyinspect.isfunction(obj):
            factories.append(name)
        elif isinstance(obj, type) and issubclass(obj, nn.Module):
            classes.append(name)
    return factories + classes


def load_model(target: str) -> nn.Module:
    """``path/to/file.py:factory`` or ``package.module:factory`` -> the nn.Module the factory builds."""
    source, sep, factory_name = target.rpartition(":")
    if not sep:
        source, factory_name = target, ""
    is_file = source.endswith(".py") or "/" in source or os.sep in source
    module = _load_file(source) if is_file else _import_module(source)
    available = ", ".join(available_factories(module)) or "none"
    if not factory_name:
        raise UsageError(f"{target!r} names no factory; use {source}:FACTORY with FACTORY one of: "
                         f"{available}")
    obj = module
    for part in factory_name.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{source} has no factory {factory_name!r}; available: {available}")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise UsageError(f"{target} is a {type(obj).__name__}, not a factory; available: {available}")
    if _needs_arguments(obj):
        raise UsageError(f"{target} needs arguments {pyinspect.signature(obj)}; fxdp inspect calls it "
                         f"with none: wrap it in a function that takes no arguments")
    try:
        model = obj()
    except (Exception, SystemExit) as exc:  # sys.exit() in a factory is a failure to build the model
        raise UsageError(f"{target} raised {_describe(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(f"{target} returned {type(model).__name__}, not a torch.nn.Module")
    return model


# --------------------------------------------------------------------------- example inputs


def parse_shape(text: str) -> tuple:
    """``8,3,32,32`` or ``8x3x32x32`` -> (8, 3, 32, 32)."""
    parts = text.replace("x", ",").replace("X", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    negative = [s for s in shape if s < 0]
    if negative:
        raise UsageError(f"--input {text!r} has a negative size ({negative[0]}): sizes are positive, "
                         f"e.g. --input 8,3,32,32")
    if not shape or any(s <= 0 for s in shape):
        raise UsageError(f"malformed --input {text!r}: expected positive sizes separated by ',' or 'x', "
                         f"e.g. --input 8,3,32,32")
    return shape


# The most elements fxdp inspect makes random inputs of (and at most half the free memory): the report
# is the same for a small batch, so a huge --input is a typo or a misunderstanding, not a need.
MAX_INPUT_ELEMENTS = 2**31


def _free_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on Linux
        return None


def check_input_sizes(specs: list, texts: list) -> None:
    """Refuse inputs too large to allocate comfortably, before allocating them."""
    sizes = [(math.prod(shape), torch.empty((), dtype=dtype).element_size()) for shape, dtype in specs]
    elements = sum(n for n, _ in sizes)
    nbytes = sum(n * b for n, b in sizes)
    free = _free_memory()
    if elements > MAX_INPUT_ELEMENTS or (free is not None and nbytes > free // 2):
        given = " ".join(f"--input {t}" for t in texts)
        within = f", within half the free memory ({_gigabytes(free // 2)})" if free is not None else ""
        raise UsageError(f"{given} is too large: {elements:,} elements ({_gigabytes(nbytes)}); fxdp inspect "
                         f"makes random inputs of at most {MAX_INPUT_ELEMENTS:,} elements{within}. The report "
                         f"is the same for small sizes: use a small batch")


def _gigabytes(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}") from None


def parse_input(text: str, default_dtype: torch.dtype) -> tuple:
    """``SHAPE`` or ``SHAPE:DTYPE`` -> (shape, dtype)."""
    shape_text, sep, dtype_name = text.partition(":")
    return parse_shape(shape_text), (parse_dtype(dtype_name) if sep else default_dtype)


def random_input(shape: tuple, dtype: torch.dtype, high: int) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.randint(0, 2, shape).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(0, high, shape, dtype=dtype)


def _make_input(shape: tuple, dtype: torch.dtype, high: int, text: str) -> torch.Tensor:
    try:
        return random_input(shape, dtype, high)
    except (RuntimeError, MemoryError) as exc:  # out of memory despite the size check
        raise UsageError(f"cannot make --input {text}: {_describe(exc)}") from exc


# --------------------------------------------------------------------------- commands


def _check_inputs_fit(model: nn.Module, example_inputs: tuple, texts: list) -> None:
    """Run the model once, so inputs of the wrong shape or dtype are a one-line usage error rather than a
    failure deep inside the analysis (and untraceable models, which the analysis never runs, are checked
    too)."""
    try:
        with torch.no_grad():
            model(*example_inputs)
    except (Exception, SystemExit) as exc:
        given = " ".join(f"--input {t}" for t in texts)
        dtypes = ", ".join(str(x.dtype).replace("torch.", "") for x in example_inputs)
        raise UsageError(f"the model's forward fails on {given} ({dtypes}): {_describe(exc)}") from exc


def _cmd_inspect(args) -> int:
    default_dtype = parse_dtype(args.dtype)
    specs = [parse_input(text, default_dtype) for text in args.input]
    if args.high <= 0:
        raise UsageError(f"--high must be positive, got {args.high}")
    for (shape, dtype), text in zip(specs, args.input):
        if not 0 <= args.batch_dim < len(shape):
            raise UsageError(f"--batch-dim {args.batch_dim} is out of range for --input {text} "
                             f"({len(shape)} dimensions)")
        if not dtype.is_floating_point and dtype is not torch.bool and args.high > torch.iinfo(dtype).max + 1:
            raise UsageError(f"--high {args.high} does not fit --input {text} ({str(dtype)[6:]}: values up to "
                             f"{torch.iinfo(dtype).max}); use --high {torch.iinfo(dtype).max + 1} or less")
    if not -2**63 <= args.seed < 2**64:
        raise UsageError(f"--seed {args.seed} is out of range: use an integer in [-2**63, 2**64)")
    check_input_sizes(specs, args.input)

    torch.manual_seed(args.seed)  # the same weights and inputs on every run
    model = load_model(args.target)
    example_inputs = tuple(_make_input(shape, dtype, args.high, text)
                           for (shape, dtype), text in zip(specs, args.input)) or None
    if example_inputs is not None:
        _check_inputs_fit(model, example_inputs, args.input)

    try:
        report = fxdp.inspect(model, example_inputs, batch_dim=args.batch_dim, strict=args.strict)
    except (Exception, SystemExit) as exc:
        # With --strict a pass raises instead of reporting: the model's problem, so no traceback.
        text = f"{type(exc).__name__}: {exc}"
        cause = exc.__cause__
        while cause is not None:
            if str(cause) not in text:  # PassError already quotes its cause
                text += f"\n  caused by {type(cause).__name__}: {cause}"
            cause = cause.__cause__
        print(f"fxdp inspect: {text}", file=sys.stderr)
        return EXIT_ERRORS
    print(report)
    return EXIT_ERRORS if report.errors else EXIT_OK


def _cmd_audit(args) -> int:
    return audit_command.run(args)  # fxdp/audit/command.py: train on digits while auditing


def _version() -> str:
    try:
        return importlib.metadata.version("fxdp")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree, not installed
        return fxdp.__version__


def _cmd_layers(args: argparse.Namespace) -> int:
    from fxdp.supported import layers_table

    print(layers_table(), end="")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fxdp", description="Compile PyTorch models for differentially private training (DP-SGD).")
    parser.add_argument("--version", action="version", version=f"fxdp {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = commands.add_parser(
        "inspect", help="print a model's compile report without compiling it",
        description="Load a model and print its compile report: passes, rewrites, findings with "
                    "source lines, and why it falls back to hooks if it cannot be traced. "
                    "Exit status: 0 no errors, 1 the report has ERROR findings, 2 usage error.",
        epilog=f"example: fxdp inspect {TARGET_EXAMPLE} --input 8,3,16,16")
    p.add_argument("target", metavar="TARGET",
                   help="FILE.py:FACTORY or package.module:FACTORY; FACTORY is a function returning an "
                        "nn.Module, an nn.Module class, or an nn.Module instance, taking no arguments")
    p.add_argument("--input", metavar="SHAPE[:DTYPE]", action="append", default=[],
                   help="shape of one positional input, e.g. 8,3,32,32 or 8x3x32x32; repeat for more "
                        "inputs. Without --input the shape-dependent batch_dim analysis is skipped")
    p.add_argument("--dtype", default="float32", metavar="DTYPE",
                   help=f"dtype of the inputs (default float32); one of {', '.join(DTYPES)}")
    p.add_argument("--high", type=int, default=10,
                   help="integer inputs are drawn uniformly from [0, HIGH) (default 10)")
    p.add_argument("--batch-dim", type=int, default=0, metavar="N",
                   help="which dimension of the inputs is the batch (default 0)")
    p.add_argument("--strict", action="store_true",
                   help="strict mode: passes raise on problems instead of reporting them (exit 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the weights and inputs (default 0)")
    p.set_defaults(func=_cmd_inspect, command_parser=p)

    p = commands.add_parser("layers", help="print the layers fxdp has a per-sample rule, book-keeping plan or "
                                           "batch rule for",
                            description="Print, as Markdown, every layer class fxdp's three registries name: "
                                        "per-sample rules, book-keeping plans, batch rules (docs/layers.md).")
    p.set_defaults(func=_cmd_layers, command_parser=p)

    p = commands.add_parser("audit", help="audit a private training run on digits: epsilon lower bound vs claim",
                            description=audit_command.DESCRIPTION, epilog=f"example: {audit_command.EXAMPLE}")
    audit_command.add_arguments(p)
    p.set_defaults(func=_cmd_audit, command_parser=p)
    return parser


def _attach_option_values(argv: Sequence[str]) -> list:
    """``--input -1,4`` -> ``--input=-1,4``: argparse takes a value that starts with '-' for an option
    (unless it is a plain number), and would answer "expected one argument"; the shape check then
    says what is wrong with it."""
    argv, out, i = list(argv), [], 0
    while i < len(argv):
        arg = argv[i]
        if len(arg) > 2 and "--input".startswith(arg) and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"--input={argv[i + 1]}")
            i += 2
            continue
        if arg == "--":  # everything after it is positional already
            out.extend(argv[i:])
            break
        out.append(arg)
        i += 1
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = _attach_option_values(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the command's parser: "fxdp inspect: error: ..."
            getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version and argparse's own usage errors
        return EXIT_OK if exc.code is None else exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"fxdp {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
