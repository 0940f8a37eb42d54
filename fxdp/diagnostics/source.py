"""Source locations: the line of the user's code behind a graph node, a traceback or an error.

Library frames (torch's and fxdp's own) are skipped, so a location points at the user's code.
"""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass
from typing import Optional

import torch

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

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

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
