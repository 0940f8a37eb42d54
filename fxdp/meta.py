"""The ``node.meta`` keys fxdp writes, in one place, and :func:`batch_source`, which reads one back.

Passes mutate the graph in place (re-tracing would drop unknown keys), so a key written by an early
pass is still there for the later ones. A leaf module: it imports only :mod:`fxdp.layout`.
"""

from typing import Tuple

from fxdp.layout import BATCHED, BatchLayout

#: :class:`fxdp.diagnostics.SourceLocation` of the user's line that created the node (or ``None``).
SOURCE = "fxdp.source"

#: Where the batch sits in the node's output (written by the batch_dim pass): a
#: :class:`fxdp.layout.BatchLayout`, a tuple of them for tuple outputs, or ``None`` for values that are
#: not tensors.
BATCH_LAYOUT = "fxdp.batch_layout"

#: Fake tensor (or tuple of them) of the node's output, written by the batch_dim pass.
FAKE_VALUE = "fxdp.fake_value"

#: Set on nodes the inplace pass created, with a short description of what they replaced.
INPLACE_REWRITE = "fxdp.inplace_rewrite"

#: Set on nodes the per_sample pass created: the name of the rule that computes their per-sample
#: gradients (``"Linear"`` for a hand-written rule, ``"generic"`` for the generic rule, ...).
PER_SAMPLE_RULE = "fxdp.per_sample_rule"


def batch_source(placeholders, batch_dim: int) -> Tuple[int, int]:
    """(input index, dim) of the model input that carries the batch, as the batch_dim pass found it
    (``batch_dim`` of the first input where it found none)."""
    for i, ph in enumerate(placeholders):
        layout = ph.meta.get(BATCH_LAYOUT)
        if isinstance(layout, BatchLayout) and layout.kind == BATCHED:
            return i, layout.dim
    return 0, batch_dim
