"""The front ends: the model as a graph the passes can read, each node knowing the user's line.

Tried in order (:func:`fxdp.frontends.fx.trace` runs both and says which graph it returns and why):

- :mod:`~fxdp.frontends.fx`      — torch.fx symbolic tracing first: torch functions, Tensor methods and
  whole layers (modules with a per-sample rule stay leaves); in-place ops recorded as such;
- :mod:`~fxdp.frontends.export`  — torch.export (non-strict) second, when torch.fx cannot follow the
  model's Python and example inputs are given: ATen ops, the batch dimension dynamic, the sizes it
  built in checked at every forward;
- :mod:`~fxdp.frontends.folding` — the ATen calls of a captured graph folded back into the layers they
  came from (an op matched to the layer that holds its parameters, with the layer's configuration), so
  the layers' own per-sample rules and book-keeping serve them.

A model neither captures is not an error here: the compiler then takes the hooks engine. The front ends
import no pass; the passes read the graphs they build.
"""
