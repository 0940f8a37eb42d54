"""A catalogue of small models for the batch-dimension analysis (and for per-sample-gradient checks).

Each entry has a name, a factory for the model, a factory for its example inputs, its category and,
for the lines the analysis must report, a marker comment on that line of the model's source:

- ``benign`` (benign.py): keeps samples apart and the batch in place (or moves it only where it comes
  back); nothing may be reported;
- ``moves`` (moving.py): moves the batch somewhere a batch-first assumption would miss (each marked
  ``# MOVE`` or ``# MOVE <what>``, with the layout the node must record) but keeps samples apart; these
  models return batch-first outputs, work for any batch size (also 1) and have parameters after the
  move, so per-sample gradients can be compared with batches of one;
- ``mixes`` (mixing.py): lets samples influence each other at the line marked ``# MIX``.

Expected lines are found from the markers with ``inspect`` (:func:`marker_line`), never written down.

    for entry in by_category("moves"):
        model, inputs = entry.build()
        ...
"""

from .catalogue import CATALOGUE, CatalogueModel, Expect, by_category, by_name, marker_line
from .mixing import BatchNormTraining
from .sizes import D, E, N, T

__all__ = ["CATALOGUE", "CatalogueModel", "Expect", "by_category", "by_name", "marker_line",
           "BatchNormTraining", "D", "E", "N", "T"]
