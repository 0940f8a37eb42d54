"""Gradient sinks: where the DP-aware ops deliver each layer's (A, G) in backward, and where the DP optimizer
reads per-sample norms and clipped sums after it.

- ``contract``: the seam (:class:`~fxdp.sinks.contract.LayerCapture`, :class:`~fxdp.sinks.contract.GradientSink`
  and its three reads) and the materialising :class:`~fxdp.sinks.contract.GradSampleSink`, which writes
  ``p.grad_sample`` (the optimizer's default reading, so it is part of the contract the optimizer depends on);
- ``capture``: the capture a layer hands its sink, built from the layer's per-sample rule;
- ``bookkeeping``: norms and clipped sums from (A, G) without per-sample gradients, with one registration per
  layer type (:func:`~fxdp.sinks.bookkeeping.register_bookkeeping`; see docs/bookkeeping_a_new_layer.md);
- ``model_methods``: Opacus's ``GradSampleModule`` methods on every model fxdp returns, acting through its sink.

This package imports nothing here on purpose: the optimizer imports ``fxdp.sinks.contract`` alone.
"""
