"""Stand-in for names that exist only inside Opacus's implementation (see run_opacus_suite.py)."""


class OpacusInternal:
    """Fails on any use, naming the Opacus internal a test reached for."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is internal to Opacus; fxdp has no counterpart")

    def __getattr__(self, attribute: str):
        raise NotImplementedError(f"{self._name}.{attribute} is internal to Opacus; fxdp has no counterpart")


def placeholder(name: str) -> OpacusInternal:
    return OpacusInternal(name)
