"""Data for DP-SGD: Poisson sampling (also across processes) and the memory manager.

``DPDataLoader``       each sample joins each batch independently with rate q (what the accounting assumes)
``PoissonBatchSampler`` the sampler behind it, usable alone (Opacus's names: ``UniformWithReplacementSampler``,
                       ``DistributedUniformWithReplacementSampler``)
``BatchMemoryManager`` logical batches cut into physical batches that fit, accounting unchanged
``CyclicPoissonDataLoader`` step t samples from part t mod b of a fixed split (banded MF's amplified accounting)
``UserLevelDataLoader`` user-level sampling: users Poisson-sampled, up to k records each (fxdp.data.users)
``padding``            Poisson batches padded to a few fixed sizes with masked rows (``DPDataLoader(padded_batches=)``)
"""

from fxdp.data.cyclic import CyclicPoissonBatchSampler, CyclicPoissonDataLoader
from fxdp.data.loader import DPDataLoader, EmptyBatchCollate, switch_generator, wrap_collate_with_empty
from fxdp.data.memory_manager import BatchMemoryManager
from fxdp.data.users import UserLevelDataLoader, UserPoissonBatchSampler
from fxdp.data.sampler import (DistributedUniformWithReplacementSampler, PoissonBatchSampler,
                               UniformWithReplacementSampler)

__all__ = ["BatchMemoryManager", "CyclicPoissonBatchSampler", "CyclicPoissonDataLoader", "DPDataLoader",
           "DistributedUniformWithReplacementSampler", "EmptyBatchCollate",
           "PoissonBatchSampler", "UniformWithReplacementSampler", "UserLevelDataLoader", "UserPoissonBatchSampler",
           "switch_generator", "wrap_collate_with_empty"]
