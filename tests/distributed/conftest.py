"""What the tests of fxdp.distributed share."""

import pytest


@pytest.fixture
def mesh_of_one():
    """A gloo process group of this one process and its device mesh, for FSDP2 without spawning ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed with gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
