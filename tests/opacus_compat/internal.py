"""Stand-in for names that exist only inside Opacus's implementation (see run_opacus_suite.py).

Most fail on any use. A test-data generator is replaced by one of ours (``STAND_INS``): the test then
checks fxdp on the same kind of data rather than being excluded.
"""

import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence


class OpacusInternal:
    """Fails on any use, naming the Opacus internal a test reached for."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is internal to Opacus; fxdp has no counterpart")

    def __getattr__(self, attribute: str):
        raise NotImplementedError(f"{self._name}.{attribute} is internal to Opacus; fxdp has no counterpart")


def random_packed_sequences(batch_size: int, max_length: int, features: int, batch_first: bool,
                            sorted_: bool = False):
    """A PackedSequence of ``batch_size`` random sequences of random lengths in ``1..max_length``, longest
    first when ``sorted_`` (packed with ``enforce_sorted=True``), in random order otherwise."""
    lengths = torch.randint(1, max_length + 1, (batch_size,)).tolist()
    if sorted_:
        lengths.sort(reverse=True)
    padded = pad_sequence([torch.randn(n, features) for n in lengths], batch_first=batch_first)
    return pack_padded_sequence(padded, lengths, batch_first=batch_first, enforce_sorted=sorted_)


STAND_INS = {"_gen_packed_data": random_packed_sequences}


def placeholder(name: str):
    return STAND_INS.get(name) or OpacusInternal(name)
