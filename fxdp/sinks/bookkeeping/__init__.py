"""Book-keeping clipping: per-sample gradient norms and clipped sums from each layer's input ``A`` and
output gradient ``G``, without a per-sample gradient per parameter where a cheaper form exists
(Bu et al., "Differentially Private Optimization on Large Model at Small Cost", 2023).

During backward every DP-aware op hands the sink a :class:`~fxdp.sinks.contract.LayerCapture`. The sink
keeps ``A`` and ``G`` (not per-sample gradients) and, when the backward pass ends, computes each
parameter's per-sample squared norms. What reads only ``G`` is formed as ``G`` arrives, while backward has
just written it and it is still in the CPU's cache: a bias's per-sample sums, and the Gram blocks of ``G``
for a ghost norm. After backward the optimizer asks for the norms and, with one clip
factor ``c_i`` per sample, for each parameter's clipped sum ``sum_i c_i g_i``: that is the layer's ordinary
weight-gradient product with ``G`` scaled by ``c_i`` row by row, so no ``(N, *p.shape)`` tensor is needed.

Each layer type that has a cheaper form than its per-sample gradient has ONE registration (a
:class:`LayerBookkeeping`, :mod:`~fxdp.sinks.bookkeeping.registry`), written in one file per family here and
registered beside the layer's per-sample rule and batch rule in :mod:`fxdp.layers`: how it is planned, how its
uses form norms and clipped sums, and how it runs forward without parameter gradients. A layer joins the fast
path by one registration (docs/bookkeeping_a_new_layer.md); one without any is materialised by its rule.
How each layer's norms are computed is chosen from static shapes (:func:`plan_layer`; the sink keeps the
plan of every layer it saw in :attr:`BookkeepingSink.plans` so a report can say which and why):

=============  ====================================================================================
``outer``      Linear on ``(N, d)``: ``||g_i||^2 = ||a_i||^2 ||g_i||^2`` (weight), ``||g_i||^2`` (bias).
``ghost``      Linear on ``(N, T, d)``, Conv through its unfolded ``(N, L, C*k)`` form:
               ``<A_i A_i^T, G_i G_i^T>``, cost ``~ T^2 (d + p)`` per sample.
``per_sample`` the same layers when materialising the weight's per-sample gradient (``~ T d p``) is
               cheaper. Where it is also smaller than A and G it is kept (formed during backward, so A
               and G are freed) and the clipped sum is ``sum_i c_i g_i``; else it is dropped at once.
``index``      Embedding: rows of equal index summed per sample, ``sum_v ||sum_{t: idx_t = v} g_t||^2``
               (the index-equality form of ``sum_{t,s} [idx_t = idx_s] <g_t, g_s>``), no ``(V, D)`` tensor.
``summed``     a parameter added to per-sample data (``x + self.pos``): its per-sample gradient is ``G`` summed
               over the dimensions it is broadcast along (formed in backward, as small as ``G``), then read as
               materialised.
``materialise`` norm layers, the generic rule, anything else: ``capture.grad_samples()`` (their parameters
               are small); norms and clipped sums read from the per-sample tensor.
=============  ====================================================================================

A parameter that receives several captures in one backward pass (tied weights, a layer called twice)
gets the norm of the *sum* of its contributions, ``||sum_k g_i^(k)||``: from cross terms
``sum_{k,l} <A^k_i A^l_i^T, G^k_i G^l_i^T>`` when all its uses are Linear, from the concatenated
indices when all are Embedding. A ``(V, d)`` table used both ways (a language model's input embedding
tied to its output layer, GPT-2's ``wte``/``lm_head``) adds the cross terms
``<G_i^T A_i, E_i> = sum_{s,t} G_i[s, idx_t] (a_s . g_t)``, or ``sum_t W_i[idx_t] . g_t`` where the output
layer's per-sample gradient ``W_i`` is kept: the Embedding's ``(N, V, d)`` gradient is never formed.
Any other mix materialises that parameter alone. Its clipped sum is the sum of each use's re-weighted
product. Successive backward passes before a step append rows in call order, as
``p.grad_sample`` does.

Uses whose G is one tensor in memory (an LSTM's or RNN's input and recurrent projections get the same gate
gradients; a GRU's do not) share the work on it: one Gram matrix ``G_i G_i^T`` for both ghost norms, one
``sum_t G`` for both biases, and, when their clip factors are equal (flat clipping), one product
``G^T [A^1 c, A^2 c]`` for both clipped sums (:attr:`BookkeepingSink.shared` lists the weights that shared).
Ghost-norm Linear weights whose A is one tensor (an attention layer's query, key and value projections, a
gated MLP's gate and up projections) form the Gram blocks of A once (:attr:`BookkeepingSink.shared_inputs`).
"""

from fxdp.sinks.bookkeeping.plans import describe_plans, plan_graph, plan_layer
from fxdp.sinks.bookkeeping.registry import (METHODS, Captured, LayerBookkeeping, LayerPlan, find_bookkeeping,
                                             pick, register_bookkeeping)
from fxdp.sinks.bookkeeping.sink import BookkeepingSink
from fxdp.sinks.bookkeeping.uses import Materialised, Summed, Use
# the built-in book-keeping, one file per family (fxdp/layers/<family>.py registers each for its layer classes;
# broadcast registers itself for the functions that add a parameter to per-sample data)
from fxdp.sinks.bookkeeping import (broadcast, conv, embedding, linear, norms, recurrent,  # noqa: F401
                                    transformer, transformers_conv1d)

__all__ = ["BookkeepingSink", "LayerPlan", "plan_layer", "plan_graph", "describe_plans", "METHODS",
           "LayerBookkeeping", "register_bookkeeping", "find_bookkeeping", "Captured", "pick", "Use", "Materialised",
           "Summed"]
