"""The layers fxdp knows by name, one module per family, and Opacus's DP layers.

A layer family's module registers, side by side and with one call (:func:`register_layer`), what fxdp must know
about each of its layer classes: its per-sample rule (:mod:`fxdp.grad_sample`), its book-keeping
(:mod:`fxdp.sinks.bookkeeping`) and its batch rule (:mod:`fxdp.passes.batch_rules`). The rules themselves stay in
those packages, beside the other rules of their kind; a family's module says which of them serve which classes.
Adding a layer is one call in one file (docs/pipeline.md, "Where to add a layer"); ``fxdp layers`` lists what the
registries hold (docs/layers.md).

- :mod:`.registration`: :func:`register_layer` (also ``fxdp.register_layer``);
- :mod:`.linear`, :mod:`.conv`, :mod:`.embedding`, :mod:`.norms`: torch's layers with hand-written rules;
- :mod:`.recurrent`: ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` and the cells, and ``DPLSTM`` / ``DPGRU`` / ``DPRNN``;
- :mod:`.transformer`: ``nn.MultiheadAttention`` and torch's transformer blocks;
- :mod:`.transformers_conv1d`, :mod:`.moe`: classes of Hugging Face transformers, registered by class path (fxdp
  never imports transformers);
- :mod:`.attention`: ``DPMultiheadAttention`` and ``SequenceBias``.

Opacus needs its own recurrent and attention layers because its hooks see only Linear-like layers. fxdp
computes per-sample gradients of the stock ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` / ``nn.MultiheadAttention``
itself, so the DP layers here *are* the stock modules: subclasses that keep torch's ``forward``, its
parameters and its ``state_dict`` keys (those of Opacus's layers too), trained by the same per-sample rules
as the stock modules in every engine. Nothing needs replacing: they exist so that imports and
``ModuleValidator.fix`` behave as in Opacus. ``SequenceBias`` (a learned step appended to a sequence) is a
layer of its own, without a hand-written rule: the generic rule gives its per-sample gradients.

Importing this package registers the built-in families (``import fxdp`` does). It imports the rules' packages;
none of them, nor the runtime, the engines or the optimizer, imports it (tests/test_layout_of_the_package.py).
"""

from fxdp.layers.registration import register_layer
# the built-in families (importing them registers them)
from fxdp.layers import conv, embedding, linear, moe, norms, transformer, transformers_conv1d  # noqa: F401
from fxdp.layers.attention import DPMultiheadAttention, SequenceBias
from fxdp.layers.recurrent import DPGRU, DPLSTM, DPRNN

__all__ = ["register_layer", "DPLSTM", "DPGRU", "DPRNN", "DPMultiheadAttention", "SequenceBias"]
