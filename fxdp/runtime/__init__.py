"""What compiled code calls at run time: the DP-aware ops (:mod:`~fxdp.runtime.ops`).

The runtime imports no pass: the per_sample pass builds sites and inserts calls to these ops; the
ops deliver what they see in backward to the model's gradient sink, which each site holds. The
model's batch guard (:mod:`~fxdp.runtime.guards`) checks at every forward that the layouts the sites hold
were analysed for these input shapes, and asks its :class:`~fxdp.runtime.guards.Reanalysis` for the
layouts of new ones.
The compiled model's class (:mod:`~fxdp.runtime.module`) runs them before every forward and keeps
what the compiler attached through deepcopy, pickle and ``torch.save``.
"""

from fxdp.runtime.guards import (GUARD_ATTR, AnalysedLayouts, BatchGuard, FrozenUse, Reanalysis, batch_size,
                                 input_signature)
from fxdp.runtime.structure import StructureWatch
from fxdp.runtime.ops import PerSampleSite, dp_aware_function, dp_aware_layer

__all__ = ["GUARD_ATTR", "AnalysedLayouts", "BatchGuard", "FrozenUse", "PerSampleSite", "Reanalysis",
           "StructureWatch", "batch_size", "dp_aware_function", "dp_aware_layer", "input_signature"]
