"""Fixtures every test gets (defined in tests/support/fixtures.py)."""

from tests.support.fixtures import _restore_grad_sampler_registry, float64  # noqa: F401  (autouse; on request)
