"""A torch.compile backend for the compile tests: it counts the graphs dynamo hands it (graph breaks + 1) and
runs each one eagerly, or hands it on to another backend (``CountingBackend(then="aot_eager")``), so that a test
comparing compiled steps with eager ones also knows that they were compiled (dynamo falls back to eager, with a
warning only, e.g. past its recompile limit)."""

from __future__ import annotations

from typing import Optional


class CountingBackend:
    def __init__(self, then: Optional[str] = None):
        self.graphs = 0
        self.then = then

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.then is None:
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(self.then)(gm, example_inputs)
