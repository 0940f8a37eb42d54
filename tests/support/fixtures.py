"""Fixtures every test gets: tests/conftest.py imports them."""

import pytest
import torch

from fxdp.grad_sample import registry


@pytest.fixture(autouse=True)
def _restore_grad_sampler_registry():
    """Per-sample rules a test registers (a user rule, a wrong rule, a rule that makes a layer a leaf)
    do not outlive it."""
    saved = dict(registry._GRAD_SAMPLERS)
    yield
    registry._GRAD_SAMPLERS.clear()
    registry._GRAD_SAMPLERS.update(saved)


@pytest.fixture
def float64():
    """Tight comparisons: the test's models are built and run in float64. A file asks for it with
    ``pytestmark = pytest.mark.usefixtures("float64")``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
