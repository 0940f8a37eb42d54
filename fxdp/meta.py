"""The ``node.meta`` keys fxdp writes, in one place.

Passes mutate the graph in place (re-tracing would drop unknown keys), so a key written by an early
pass is still there for the later ones.
"""

#: :class:`fxdp.diagnostics.SourceLocation` of the user's line that created the node (or ``None``).
SOURCE = "fxdp.source"

#: Where the batch dimension sits in the node's output: a :class:`fxdp.layout.BatchLayout`,
#: a tuple of them for tuple outputs, or ``None`` for values that are not tensors.
BATCH_DIM = "fxdp.batch_dim"

#: Fake tensor (or tuple of them) of the node's output, written by the batch_dim pass.
FAKE_VALUE = "fxdp.fake_value"

#: Set on nodes the inplace pass created, with a short description of what they replaced.
INPLACE_REWRITE = "fxdp.inplace_rewrite"

#: Set on nodes the per_sample pass created: the name of the rule that computes their per-sample
#: gradients (``"Linear"`` for a hand-written rule, ``"generic"`` for the generic rule, ...).
PER_SAMPLE_RULE = "fxdp.per_sample_rule"
