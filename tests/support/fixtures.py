"""Fixtures every test gets: tests/conftest.py imports them."""

import pytest

from fxdp.grad_sample import registry


@pytest.fixture(autouse=True)
def _restore_grad_sampler_registry():
    """Per-sample rules a test registers (a user rule, a wrong rule, a rule that makes a layer a leaf)
    do not outlive it."""
    saved = dict(registry._GRAD_SAMPLERS)
    yield
    registry._GRAD_SAMPLERS.clear()
    registry._GRAD_SAMPLERS.update(saved)
