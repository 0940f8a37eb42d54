"""The compiler's passes, in the order ``compile_for_dp`` runs them.

Each is a function ``GraphModule -> PassResult(graph_module, report)`` that mutates the graph in place:

1. :mod:`~fxdp.passes.validate`   — layers and configurations DP-SGD cannot train as they are
2. :mod:`~fxdp.passes.inplace`    — in-place ops rewritten out of place
3. :mod:`~fxdp.passes.batch_dim`  — where the batch sits at every node; batch moves; sample mixing
4. :mod:`~fxdp.passes.per_sample` — DP-aware ops that record per-sample gradients

and :mod:`~fxdp.passes.reanalyse`, the re-analysis a compiled model's batch guard asks for at run time
(new input shapes; a model changed since it was compiled).
"""
