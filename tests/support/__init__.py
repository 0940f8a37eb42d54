"""What the tests share: reference per-sample gradients, per-rule harnesses, model catalogues, fixtures.

Nothing here is a test; tests import it as ``tests.support.<module>``.
"""
