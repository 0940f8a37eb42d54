"""``ModuleValidator.fix(model, remove_inplace_ops=True)``: the inplace pass applied to a whole model.

Kept apart from :mod:`fxdp.validators` so the validators never import a pass (the passes use the
validators, not the reverse).
"""

from __future__ import annotations

import logging
from typing import Tuple

from torch import nn

from fxdp.diagnostics import Severity
from fxdp.passes.inplace import remove_inplace_ops
from fxdp.frontends.fx import trace

logger = logging.getLogger("fxdp")


def rewrite_inplace_ops(model: nn.Module) -> Tuple[nn.Module, str]:
    """``model`` traced with its in-place ops rewritten out of place (a GraphModule), and a warning for
    the user; ``(model, "")`` when it cannot be traced."""

    traced = trace(model)
    if not traced.ok:
        where = f" at {traced.location}" if traced.location is not None else ""
        logger.info(
            "ModuleValidator.fix(remove_inplace_ops=True): %s cannot be traced (%s%s); returning it "
            "with the module-level fixes only, its in-place ops are left as they are",
            type(model).__name__, traced.reason, where,
        )
        return model, ""
    result = remove_inplace_ops(traced.graph_module)
    warning = (
        f"ModuleValidator.fix(remove_inplace_ops=True) returns a torch.fx.GraphModule, not a "
        f"{type(model).__name__}: isinstance checks, methods defined on {type(model).__name__} and "
        f"pickling by class see the GraphModule type ({len(result.report.changes)} in-place op(s) "
        f"rewritten)."
    )
    kept = [f for f in result.report.findings if f.severity is not Severity.INFO]
    if kept:
        warning += " Not rewritten: " + "; ".join(f"{f.node} at {f.where}: {f.message}" for f in kept)
    return result.graph_module, warning
