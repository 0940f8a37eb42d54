"""Where a line of a test's own code is, for the tests that check a report or an error names it."""

import inspect


def line_of(obj, text: str) -> int:
    """The line number of the first line of ``obj``'s source (a class or a function) that contains ``text``."""
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(lines) if text in line)
