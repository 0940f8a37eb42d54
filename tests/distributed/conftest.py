"""What the tests of fxdp.distributed share."""

import pytest


@pytest.fixture
def world_of_one():
    """A gloo process group of this one process, for the distributed code paths without spawning ranks."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed with gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def mesh_of_one(world_of_one):
    """The device mesh of :func:`world_of_one`'s process group, for FSDP2 without spawning ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))
