"""Sparse mixture-of-experts blocks of Hugging Face transformers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), registered
by class path (fxdp never imports transformers): each block is one layer whose per-sample gradients come from each
sample re-run alone (:func:`fxdp.grad_sample.moe.moe_block_grad_sampler`; routing, capacity and jitter checks
there). No book-keeping (materialised through the rule) and no batch rule of its own: the graph engine does not
trace into a block with a per-sample rule and takes it to keep the batch where its input has it. A block of your
own: ``fxdp.register_moe_block(MyMoE)``.
"""

from fxdp.grad_sample.moe import moe_block_grad_sampler
from fxdp.layers.registration import register_layer

# blocks whose router picks each token's top-k experts on its own (read in transformers 5's code)
_BLOCKS = [("mixtral", "MixtralSparseMoeBlock"), ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
           ("qwen3_moe", "Qwen3MoeSparseMoeBlock"), ("olmoe", "OlmoeSparseMoeBlock")]

register_layer(by_path=[f"transformers.models.{module}.modeling_{module}.{block}" for module, block in _BLOCKS],
               grad_sampler=moe_block_grad_sampler)
