"""What compiled code calls at run time: the DP-aware ops (:mod:`~fxdp.runtime.ops`).

The runtime imports no pass: the per_sample pass builds sites and inserts calls to these ops; the
ops deliver what they see in backward to the model's gradient sink, which each site holds.
"""

from fxdp.runtime.ops import BatchSource, PerSampleSite, batch_size, per_sample_call, per_sample_function

__all__ = ["BatchSource", "PerSampleSite", "batch_size", "per_sample_call", "per_sample_function"]
