"""Running the batch_dim pass on a catalogue entry or a model, and finding its nodes by name."""

from __future__ import annotations

from fxdp.passes.batch_dim import propagate_batch_dim
from fxdp.frontends.fx import trace


def analyse(entry_or_model, inputs=None, batch_dim=0, strict=False):
    """(graph module, findings) for a catalogue entry or a model with inputs."""
    if inputs is None:
        model, inputs = entry_or_model.build()
        batch_dim = entry_or_model.batch_dim
    else:
        model = entry_or_model
    gm = trace(model).graph_module
    result = propagate_batch_dim(gm, inputs, batch_dim=batch_dim, strict=strict)
    return gm, list(result.report.findings)


def node_named(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)
