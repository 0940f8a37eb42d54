"""Mixture-of-experts blocks (Mixtral-style top-k routing): one unit, each sample re-run alone.

A sparse MoE block flattens its input to tokens ``(N*T, d)``, lets a router pick each token's top-k
experts, and gathers the tokens routed to each expert (``x[token_idx]``, ``index_add_``, a sort by
expert, grouped matmuls). Inside the block the batch has no dimension a hook or a batch rule can
follow: rows are picked by data. But routing is per token, so the block as a whole treats each sample
on its own: sample i's output is what the block gives sample i alone, and so is its gradient. The
block is therefore one layer with :func:`moe_block_grad_sampler`, the generic rule (each sample re-run
alone as a batch of one, vmapped or looped; its routing is that sample's own): exact, whatever the
experts' implementation (a loop over experts, batched or grouped matmuls).

That holds only while nothing couples the samples, so these are refused, with the block named:

- a load-balancing (router auxiliary) loss: computed from the router logits of the whole batch, it
  mixes samples, and it reaches the loss by a path the block's output gradient does not carry
  (Hugging Face's ``output_router_logits=True``): refused by the hooks engine at the forward that records
  them (a captured graph whose block has an output besides its own is left to the hooks engine);
- capacity-limited routing (``expert_capacity`` / ``capacity_factor``: a token is dropped when
  other samples' tokens fill its expert): refused;
- router jitter noise in training (a random draw a per-sample re-run cannot repeat): refused.

Blocks registered (by class path, in :mod:`fxdp.layers.moe`; fxdp never imports transformers): Hugging Face's
Mixtral, Qwen2-MoE (its shared expert too), Qwen3-MoE and OLMoE blocks.
Your own block: ``fxdp.register_moe_block(MyMoE)``: a declaration that its forward routes each token
on its own (top-k, no capacity, no batch statistics) and returns a tensor shaped like its input; the
hooks engine's check on the first batch tests it against batches of one.

The graph engine does not run a registered block on fake tensors (data-dependent shapes, grouped
matmul kernels without fake support): :func:`fake_output` gives its output, shaped like its input.
"""

from __future__ import annotations

import sys
from typing import Dict, Iterable, List, Optional, Tuple, Type, Union

import torch
from torch import nn

from fxdp.diagnostics import Kind
from fxdp.diagnostics.errors import PerSampleError
from fxdp.grad_sample.generic import generic_grad_sampler
from fxdp.grad_sample.registry import find_grad_sampler, register_grad_sampler

# attributes that limit how many tokens an expert takes from the whole batch
_CAPACITY_ATTRIBUTES = ("expert_capacity", "capacity_factor")

_TRANSFORMERS_COLLECTOR = "transformers.utils.output_capturing"


def moe_block_grad_sampler(module: nn.Module, activations: List, backprops) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of every trainable parameter of a sparse MoE block (router and experts):
    each sample re-run alone through the block (:func:`~fxdp.grad_sample.generic.generic_grad_sampler`)."""
    name = type(module).__name__
    refuse_sample_mixing_routing(name, module)
    x = activations[0] if activations else None
    if not isinstance(x, torch.Tensor) or not isinstance(backprops, torch.Tensor) or backprops.shape != x.shape:
        # the graph engine analysed the layers after the block with an output shaped like its input
        raise PerSampleError(
            f"fxdp: the mixture-of-experts block {name} returned a tensor of shape "
            f"{tuple(getattr(backprops, 'shape', ()))} for an input of shape {tuple(getattr(x, 'shape', ()))}; "
            "fxdp.register_moe_block declares blocks that map a batch-first tensor to one of the same shape. "
            "Register a rule of its own for it with fxdp.register_grad_sampler instead.")
    return generic_grad_sampler(module, activations, backprops)


def check_moe_call(name: str, module: nn.Module) -> None:
    """Run at each forward of the block (hooks engine): refuses what would make this call's per-sample
    gradients wrong before its backward runs."""
    refuse_sample_mixing_routing(name, module)
    collector = getattr(sys.modules.get(_TRANSFORMERS_COLLECTOR), "_active_collector", None)
    recorded = collector.get() if collector is not None else None
    if isinstance(recorded, dict) and "router_logits" in recorded:
        raise PerSampleError(
            f"fxdp: the mixture-of-experts block '{name}' ({type(module).__name__}) runs with "
            "output_router_logits=True: its router logits leave the block, and the load-balancing (router "
            "auxiliary) loss computed from them averages over every token of the batch, which mixes samples; its "
            "gradient would also bypass the block's per-sample rule. Set output_router_logits=False (in the "
            "config and in the call) to train with DP-SGD; the routing itself stays per token.")


moe_block_grad_sampler.check_call = check_moe_call  # the hooks engine runs a rule's check_call at each forward
moe_block_grad_sampler.label = "mixture-of-experts (the whole block, each sample re-run alone with its own routing)"


def routing_problems(name: str, module: nn.Module) -> List[Tuple[Kind, str, str]]:
    """(kind, message, fix) for what keeps a block (or its router) from being re-run sample by sample: a
    capacity limit across the batch, router jitter noise in training. The validate pass reports them."""
    problems = []
    for sub_name, sub in module.named_modules():
        for attr in _CAPACITY_ATTRIBUTES:
            if getattr(sub, attr, None) is not None:
                where = f"'{name}.{sub_name}'" if sub_name else f"'{name}'"
                problems.append((Kind.MIXES_SAMPLES,
                                 f"the mixture-of-experts block {where} ({type(sub).__name__}) has {attr}="
                                 f"{getattr(sub, attr)!r}: capacity-limited routing drops a token when other samples' "
                                 "tokens fill its expert, so each sample's output depends on the rest of the batch",
                                 "use top-k routing without a capacity limit"))
    if module.training and (getattr(module, "jitter_noise", 0) or 0) > 0:
        problems.append((Kind.NOT_YET_SUPPORTED,
                         f"the mixture-of-experts block '{name}' ({type(module).__name__}) multiplies its input by "
                         f"random jitter noise in training (jitter_noise={module.jitter_noise}); per-sample gradients "
                         "re-run each sample, which would draw other numbers", "set router_jitter_noise=0 in the config"))
    return problems


moe_block_grad_sampler.check_module = routing_problems  # the validate pass reports them with the node


def refuse_sample_mixing_routing(name: str, module: nn.Module) -> None:
    """Raise the first of :func:`routing_problems`, naming the block."""
    for _, message, fix in routing_problems(name, module)[:1]:
        raise PerSampleError(f"fxdp: {message}, so DP-SGD cannot train it. To train it: {fix}.")


def register_moe_block(classes: Union[Type[nn.Module], Iterable[Type[nn.Module]]]):
    """Declare ``classes`` sparse mixture-of-experts blocks: each call maps a batch-first input to an output
    of the same shape, routing every token on its own (top-k, no capacity limit, no statistics over the
    batch). Each block is then one layer under :func:`moe_block_grad_sampler`, in every engine. Usable as
    a class decorator; returns its argument."""
    register_grad_sampler(classes)(moe_block_grad_sampler)
    return classes


def is_moe_block(module: nn.Module) -> bool:
    return find_grad_sampler(module) is moe_block_grad_sampler


def describe_moe_blocks(model: nn.Module) -> List[str]:
    """The report's note on the model's mixture-of-experts blocks (empty when it has none)."""
    blocks = [(name, type(m).__name__) for name, m in model.named_modules() if is_moe_block(m)]
    if not blocks:
        return []
    names = ", ".join(f"'{name}'" for name, _ in blocks[:4]) + (f" and {len(blocks) - 4} more" if len(blocks) > 4 else "")
    classes = ", ".join(sorted({cls for _, cls in blocks}))
    return [f"mixture-of-experts: {len(blocks)} block(s) ({classes}: {names}) are layers of their own; their per-sample "
            "gradients (router and experts) come from each sample re-run alone through the block, with its own "
            "routing (fxdp.grad_sample.moe)"]


def fake_output(module: nn.Module, args) -> Optional[torch.Tensor]:
    """What the graph engine's fake run of a registered MoE block returns (a tensor like its input), or
    ``None`` for any other module."""
    if not is_moe_block(module) or not args or not isinstance(args[0], torch.Tensor):
        return None
    return torch.empty_like(args[0])

