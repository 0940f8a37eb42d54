"""A torch.compile backend for the compile tests: it counts the graphs dynamo hands it (graph breaks + 1) and
runs each one eagerly."""

from __future__ import annotations


class CountingBackend:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward
