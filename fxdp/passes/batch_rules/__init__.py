"""Batch rules: for one op, where the batch dimension of its output is, and whether it mixes samples.

One registry, keyed by the op the graph calls:

- torch functions (``torch.sum``, ``F.softmax``), ``operator.*`` functions and ``getattr`` (``x.T``);
- Tensor method names, as strings (``"transpose"``), the way ``call_method`` nodes name them;
- ``nn.Module`` types for the layers the graph calls whole; lookup walks the class's MRO, so a
  subclass of ``nn.Linear`` uses the Linear rule.

Every rule has one signature, ``rule(call: OpCall) -> Verdict`` (see :mod:`.core`). A missing rule
is not a guess: the pass reports the op as unverified (or raises in strict mode).

The package, one file per family, each registering its own ops next to its rules:

- :mod:`.core`: :class:`OpCall`, :class:`Verdict`, :class:`Facts`, the registry
  (:func:`register_batch_rule`, :func:`find_batch_rule`) and the helpers rules share;
- :mod:`.elementwise`: elementwise and broadcasting ops, factories, the inplace pass's helpers;
- :mod:`.reductions`: reductions and ops along a dimension (softmax, cumsum, sort, ...);
- :mod:`.views`: views and reshapes through dimension maps (:class:`InputDim`, :class:`Flatten`,
  :class:`Split`, ...), concatenation and splitting;
- :mod:`.contractions`: matmul, einsum, linear, attention, labelled like einsum;
- :mod:`.indexing`: indexing, gathering, scattering, embeddings;
- :mod:`.layers`: convolution, pooling, normalisation, losses, recurrent and attention layers (the rules of the
  layer classes with parameters are registered for those classes in :mod:`fxdp.layers`, beside their per-sample
  rule and book-keeping; ``linear_rule`` and ``embedding_rule`` likewise);
- :mod:`.torchvision`: the functions torchvision's models wrap for fx (stochastic depth, Swin's
  window attention), registered by dotted name;
- :mod:`.aten`: ATen ops (graphs captured by torch.export): each gets the rule of the torch function or
  Tensor method of its name, and the few whose arguments differ have their own;
- :mod:`.nodes`: what the generic interpreter asks about a node besides its rule (facts such as
  ``x.size(0)``, elements of tuple outputs, in-place writes).

Register your own rule with :func:`register_batch_rule` (also ``fxdp.register_batch_rule``)::

    @fxdp.register_batch_rule(MyLayer)       # or a list of ops, a torch function, a method name
    def my_layer_rule(call):
        return keeps_layout(call)            # "treats samples independently, batch stays put"
"""

# the families register their rules when imported; the order is the registration order
from fxdp.passes.batch_rules import elementwise as _elementwise  # noqa: F401
from fxdp.passes.batch_rules import reductions as _reductions  # noqa: F401
from fxdp.passes.batch_rules import views as _views  # noqa: F401
from fxdp.passes.batch_rules import contractions as _contractions  # noqa: F401
from fxdp.passes.batch_rules import layers as _layers  # noqa: F401
from fxdp.passes.batch_rules import indexing as _indexing  # noqa: F401
from fxdp.passes.batch_rules import torchvision as _torchvision  # noqa: F401
from fxdp.passes.batch_rules import aten as _aten  # noqa: F401
from fxdp.passes.batch_rules.contractions import contraction, parse_einsum
from fxdp.passes.batch_rules.core import (
    BatchRule,
    Facts,
    OpCall,
    Verdict,
    find_batch_rule,
    keeps_layout,
    mirror,
    mixes_from,
    carries_batch,
    rearranging,
    register_batch_rule,
    restore_batch_rules,
    snapshot_batch_rules,
    tensor_pairs,
)
from fxdp.passes.batch_rules.elementwise import elementwise
from fxdp.passes.batch_rules.indexing import index_layout
from fxdp.passes.batch_rules.nodes import (
    element_layout,
    is_inplace,
    keeps_sample_index,
    reads_facts,
    record_facts,
    selects_element,
    stores_item,
)
from fxdp.passes.batch_rules.reductions import along, along_dims, reduction
from fxdp.passes.batch_rules.views import (
    Broadcast,
    DimMap,
    DimSpec,
    Flatten,
    InputDim,
    Singleton,
    Split,
    layout_through,
    reshape_map,
    view,
)

__all__ = [
    "BatchRule", "Facts", "OpCall", "Verdict", "find_batch_rule", "register_batch_rule",
    "snapshot_batch_rules", "restore_batch_rules",
    "keeps_layout", "mirror", "mixes_from", "carries_batch", "rearranging", "tensor_pairs",
    "elementwise", "reduction", "along", "along_dims", "view", "contraction", "parse_einsum", "index_layout",
    "DimSpec", "DimMap", "InputDim", "Singleton", "Broadcast", "Flatten", "Split", "layout_through", "reshape_map",
    # what the generic interpreter asks about a node besides its rule (see .nodes)
    "record_facts", "reads_facts", "selects_element", "element_layout", "stores_item", "is_inplace",
    "keeps_sample_index",
]
