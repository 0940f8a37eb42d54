"""What compiled code calls at run time: the DP-aware ops (:mod:`~fxdp.runtime.ops`).

The runtime imports no pass: the per_sample pass builds sites and inserts calls to these ops; the
ops deliver what they see in backward to the model's gradient sink, which each site holds. The
guards (:mod:`~fxdp.runtime.guards`) check at every forward that the layouts the sites hold were
analysed for these input shapes. The compiled model's class (:mod:`~fxdp.runtime.module`) runs them
before every forward and keeps what the compiler attached through deepcopy, pickle and ``torch.save``.
"""

from fxdp.runtime.guards import BatchSource, FrozenUse, TrainabilityChangedError, batch_size, input_signature
from fxdp.runtime.structure import StructureWatch
from fxdp.runtime.ops import PerSampleSite, per_sample_call, per_sample_function

__all__ = ["BatchSource", "FrozenUse", "PerSampleSite", "StructureWatch", "TrainabilityChangedError", "batch_size",
           "input_signature", "per_sample_call", "per_sample_function"]
