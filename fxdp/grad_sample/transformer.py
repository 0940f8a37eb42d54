"""Stock transformer blocks (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` /
``nn.TransformerDecoderLayer``, ``nn.TransformerEncoder`` / ``nn.TransformerDecoder``) run as torch runs them
when gradients are needed (their "slow path": same operations, same masks, same dropout), with every
parametrised piece handed to ``call(layer, x, batch_at, name)``: the caller runs the layer and records its
per-sample gradients, so each projection is a Linear layer the sinks book-keep like any other.

``call`` gets the feed-forward ``linear1`` / ``linear2``, the norms, the attention's ``out_proj`` and its packed
query/key/value projection as an :class:`InProjection` (an ``nn.Linear`` sharing ``in_proj_weight`` and
``in_proj_bias``). Self-attention projects one input to ``(.., 3E)``, as torch does. Where the query, key and
value differ (a decoder's cross-attention) the inputs are projected one after another along the sequence
with the whole packed weight, and each takes its own columns: the columns it does not take get a zero
gradient, so the one Linear capture's per-sample gradient ``G_i^T A_i`` is exactly the sum of the three
projections' (at the price of projecting every input three ways).

Only what torch's own code computes is reproduced: a block whose class overrides ``forward``, has a per-sample
rule of its own or a parametrization, or an attention with ``add_bias_kv``, ``add_zero_attn`` or separate
key/value widths (``kdim`` / ``vdim``) is not decomposed (:func:`transformer_rule_applies`); the generic rule
then takes the block whole.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len
from torch.nn.utils import parametrize

from fxdp.grad_sample.linear import linear_grad_sample
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.layout import MERGED, BatchLayout

# call(layer, x, batch_at, name) -> layer(x), recording the layer's per-sample gradients; x has the batch in
# dim batch_at; name: the layer's name inside the block, for reports and errors
Call = Callable[[nn.Module, torch.Tensor, int, str], torch.Tensor]

BLOCKS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
          nn.TransformerDecoder)


class InProjection(nn.Linear):
    """The packed query/key/value projection of an ``nn.MultiheadAttention`` (``in_proj_weight`` (3E, E),
    ``in_proj_bias``) seen as a Linear layer. It shares the attention's parameters and is no submodule of it."""

    def __init__(self, attention: nn.MultiheadAttention):
        nn.Module.__init__(self)
        self.out_features, self.in_features = attention.in_proj_weight.shape
        self.weight = attention.in_proj_weight
        self.register_parameter("bias", attention.in_proj_bias)

    def extra_repr(self) -> str:
        return f"in_proj: {super().extra_repr()}"


_VIEW_ATTR = "_fxdp_in_projection"  # where an attention keeps its InProjection


def in_projection(attention: nn.MultiheadAttention) -> InProjection:
    """The attention's :class:`InProjection`, the same object at every call while the attention keeps its
    parameters (sinks key their plans by layer). Kept in the attention's ``__dict__`` (no submodule: not in its
    ``state_dict`` or ``modules()``), where torch.compile reads it as an attribute of the module; a global weak
    dictionary, dynamo traces and guards entry by entry (and failed building a guard when an entry of another
    model went away while it compiled)."""
    view = attention.__dict__.get(_VIEW_ATTR)
    if view is None or view.weight is not attention.in_proj_weight or view.bias is not attention.in_proj_bias:
        view = InProjection(attention)
        attention.__dict__[_VIEW_ATTR] = view
    return view


def _stock(module: nn.Module, base: type) -> bool:
    return (isinstance(module, base) and type(module).forward is base.forward and find_grad_sampler(module) is None
            and not parametrize.is_parametrized(module))


def _attention_applies(m: nn.Module) -> bool:
    out = getattr(m, "out_proj", None)
    return (_stock(m, nn.MultiheadAttention) and m._qkv_same_embed_dim and m.in_proj_weight is not None
            and m.bias_k is None and m.bias_v is None and not m.add_zero_attn
            # torch reads out_proj's weight and bias itself: the Linear rule must describe what it computes
            and isinstance(out, nn.Linear) and type(out).forward is nn.Linear.forward
            and find_grad_sampler(out) is linear_grad_sample)


def transformer_rule_applies(module: nn.Module) -> bool:
    """A stock block this rule reproduces exactly (see the module); the layers of a stack must be stock
    layers whose attention it reproduces."""
    if isinstance(module, nn.MultiheadAttention):
        return _attention_applies(module)
    if isinstance(module, nn.TransformerEncoderLayer):
        return _stock(module, nn.TransformerEncoderLayer) and _attention_applies(module.self_attn)
    if isinstance(module, nn.TransformerDecoderLayer):
        return (_stock(module, nn.TransformerDecoderLayer) and _attention_applies(module.self_attn)
                and _attention_applies(module.multihead_attn))
    for stack, layer in ((nn.TransformerEncoder, nn.TransformerEncoderLayer),
                         (nn.TransformerDecoder, nn.TransformerDecoderLayer)):
        if isinstance(module, stack):
            return (_stock(module, stack) and len(module.layers) > 0
                    and all(type(m) is layer and transformer_rule_applies(m) for m in module.layers))
    return False


def has_hooks(module: nn.Module) -> bool:
    """Forward or backward hooks on the block or a module in it (or global ones): torch's own forward runs
    them, the decomposition would not, so the block is then called whole (the generic rule)."""
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in module.modules())


def batch_at(module: nn.Module) -> int:
    """Where the block keeps the batch in its batched (3-D) inputs: 0 with ``batch_first``, else 1."""
    attention = module if isinstance(module, nn.MultiheadAttention) else (
        module.self_attn if hasattr(module, "self_attn") else module.layers[0].self_attn)
    return 0 if attention.batch_first else 1


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


# -- nn.MultiheadAttention -----------------------------------------------------------------------------------


def _heads(t: torch.Tensor, b: int, heads: int) -> torch.Tensor:
    """(N, L, E) or (L, N, E) -> (N, heads, L, E / heads), a view."""
    t = t if b == 0 else t.transpose(0, 1)
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def attention_forward(m: nn.MultiheadAttention, query, key, value, key_padding_mask=None, need_weights=True,
                      attn_mask=None, average_attn_weights=True, is_causal=False, *, call: Call, name: str = ""):
    """``m(query, key, value, ...)`` for batched (3-D) inputs, as ``F.multi_head_attention_forward`` computes
    it, the projections through ``call``. A frozen attention is called whole."""
    if not _trainable(m):
        return m(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                 attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
    b, seq = batch_at(m), 1 - batch_at(m)
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError("attention_forward takes batched (3-D) query, key and value")
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=query.dtype)
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                  target_type=query.dtype, check_other=False)
    n, length, source, width, heads = query.shape[b], query.shape[seq], key.shape[seq], m.embed_dim, m.num_heads
    if query.shape[-1] != width or key.shape != value.shape:
        raise AssertionError(f"was expecting embedding dimension of {width} and key and value of one shape, got "
                             f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # torch then hands the hint to scaled_dot_product_attention
    elif key_padding_mask is not None:
        is_causal = False
    mask = None
    if attn_mask is not None:
        expected = (length, source) if attn_mask.dim() == 2 else (n * heads, length, source)
        if tuple(attn_mask.shape) != expected:
            raise RuntimeError(f"The shape of the {attn_mask.dim()}D attn_mask is {attn_mask.shape}, but should be "
                               f"{expected}.")
        mask = attn_mask.view(1, 1, length, source) if attn_mask.dim() == 2 else attn_mask.view(n, heads, length, source)
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (n, source):
            raise AssertionError(f"Expected key_padded_mask of shape {(n, source)}, got {tuple(key_padding_mask.shape)}")
        padding = key_padding_mask.view(n, 1, 1, source)
        mask = padding if mask is None else mask + padding

    proj = in_projection(m)
    if query is key and key is value:  # self-attention: one projection to (.., 3E), as torch does
        q, k, v = _heads(call(proj, query, b, f"{name}in_proj"), b, 3 * heads).chunk(3, dim=1)
    else:  # each input projected by the whole packed weight, one after another along the sequence
        inputs = [query, key] if key is value else [query, key, value]
        packed = call(proj, torch.cat(inputs, dim=seq), b, f"{name}in_proj")
        q = packed.narrow(seq, 0, length)[..., :width]
        k = packed.narrow(seq, length, source)[..., width:2 * width]
        start = length if key is value else length + source
        v = packed.narrow(seq, start, source)[..., 2 * width:]
        q, k, v = (_heads(t, b, heads) for t in (q, k, v))
    dropout = m.dropout if m.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / float(q.shape[-1])), k.transpose(-2, -1))
        weights = F.softmax(scores if mask is None else scores + mask, dim=-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        out = torch.matmul(weights, v)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal)
    # (N, heads, L, head_dim) -> (L, N, E), projected time-major as torch does: the output then has torch's
    # memory layout, and a dropout after it draws its mask in the same order
    out = call(m.out_proj, out.permute(2, 0, 1, 3).reshape(length, n, width), 1, f"{name}out_proj")
    return (out.transpose(0, 1) if b == 0 else out), weights


# -- encoder and decoder layers --------------------------------------------------------------------------------


def _feed_forward(m, x, b, call: Call, name: str):
    h = call(m.linear1, x, b, f"{name}linear1")
    h = call(m.activation, h, b, f"{name}activation") if isinstance(m.activation, nn.Module) else m.activation(h)
    h = call(m.linear2, call(m.dropout, h, b, f"{name}dropout"), b, f"{name}linear2")
    last = "dropout3" if isinstance(m, nn.TransformerDecoderLayer) else "dropout2"
    return call(getattr(m, last), h, b, f"{name}{last}")


def _attend(layer, attention: str, dropout: str, x, memory, mask, padding, is_causal, b, call: Call, name: str):
    """A layer's attention block, ``layer.dropout(layer.attention(x, memory, memory)[0])``."""
    out = attention_forward(getattr(layer, attention), x, memory, memory, key_padding_mask=padding, attn_mask=mask,
                            need_weights=False, is_causal=is_causal, call=call, name=f"{name}{attention}.")[0]
    return call(getattr(layer, dropout), out, b, f"{name}{dropout}")


def encoder_layer_forward(m: nn.TransformerEncoderLayer, src, src_mask=None, src_key_padding_mask=None,
                          is_causal=False, *, call: Call, name: str = ""):
    """``m(src, ...)`` on a batched input with gradients, as ``nn.TransformerEncoderLayer.forward`` computes it
    outside its fast path (which torch takes only without gradients)."""
    if not _trainable(m):
        return m(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
    padding = F._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                                other_type=F._none_or_dtype(src_mask), other_name="src_mask", target_type=src.dtype)
    src_mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None, other_name="",
                                 target_type=src.dtype, check_other=False)
    b = batch_at(m)

    def sa(x):
        return _attend(m, "self_attn", "dropout1", x, x, src_mask, padding, is_causal, b, call, name)

    def norm(k, x):
        return call(getattr(m, f"norm{k}"), x, b, f"{name}norm{k}")

    x = src
    if m.norm_first:
        x = x + sa(norm(1, x))
        return x + _feed_forward(m, norm(2, x), b, call, name)
    x = norm(1, x + sa(x))
    return norm(2, x + _feed_forward(m, x, b, call, name))


def decoder_layer_forward(m: nn.TransformerDecoderLayer, tgt, memory, tgt_mask=None, memory_mask=None,
                          tgt_key_padding_mask=None, memory_key_padding_mask=None, tgt_is_causal=False,
                          memory_is_causal=False, *, call: Call, name: str = ""):
    """``m(tgt, memory, ...)`` on batched inputs, as ``nn.TransformerDecoderLayer.forward`` computes it."""
    if not _trainable(m):
        return m(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask, tgt_key_padding_mask=tgt_key_padding_mask,
                 memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                 memory_is_causal=memory_is_causal)
    b = batch_at(m)

    def sa(x):
        return _attend(m, "self_attn", "dropout1", x, x, tgt_mask, tgt_key_padding_mask, tgt_is_causal, b, call,
                       name)

    def cross(x):
        return _attend(m, "multihead_attn", "dropout2", x, memory, memory_mask, memory_key_padding_mask,
                       memory_is_causal, b, call, name)

    def norm(k, x):
        return call(getattr(m, f"norm{k}"), x, b, f"{name}norm{k}")

    x = tgt
    if m.norm_first:
        x = x + sa(norm(1, x))
        x = x + cross(norm(2, x))
        return x + _feed_forward(m, norm(3, x), b, call, name)
    x = norm(1, x + sa(x))
    x = norm(2, x + cross(x))
    return norm(3, x + _feed_forward(m, x, b, call, name))


# -- stacks ------------------------------------------------------------------------------------------------------


def encoder_would_nest(m: nn.TransformerEncoder, src, mask=None, src_key_padding_mask=None) -> bool:
    """Whether ``nn.TransformerEncoder.forward`` may turn the batch into a nested tensor (its inference fast
    path; padded positions then come out as zeros), which the decomposition does not reproduce."""
    first = m.layers[0]
    if first.training or src_key_padding_mask is None or mask is not None or not getattr(m, "use_nested_tensor", False):
        return False
    tensors = [src, *first.parameters()]
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def encoder_forward(m: nn.TransformerEncoder, src, mask=None, src_key_padding_mask=None, is_causal=None, *,
                    call: Call, name: str = ""):
    """``m(src, ...)`` on a batched input, as ``nn.TransformerEncoder.forward`` computes it when it does not
    nest the batch (:func:`encoder_would_nest`)."""
    padding = F._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                                other_type=F._none_or_dtype(mask), other_name="mask", target_type=src.dtype)
    mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="", target_type=src.dtype,
                             check_other=False)
    b = batch_at(m)
    is_causal = _detect_is_causal_mask(mask, is_causal, _get_seq_len(src, b == 0))
    out = src
    for i, layer in enumerate(m.layers):
        out = encoder_layer_forward(layer, out, src_mask=mask, is_causal=is_causal, src_key_padding_mask=padding,
                                    call=call, name=f"{name}layers.{i}.")
    return out if m.norm is None else call(m.norm, out, b, f"{name}norm")


def decoder_forward(m: nn.TransformerDecoder, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                    memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False, *, call: Call,
                    name: str = ""):
    """``m(tgt, memory, ...)`` on batched inputs, as ``nn.TransformerDecoder.forward`` computes it."""
    b = batch_at(m)
    tgt_is_causal = _detect_is_causal_mask(tgt_mask, tgt_is_causal, _get_seq_len(tgt, b == 0))
    out = tgt
    for i, layer in enumerate(m.layers):
        out = decoder_layer_forward(layer, out, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                                    tgt_key_padding_mask=tgt_key_padding_mask,
                                    memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                                    memory_is_causal=memory_is_causal, call=call, name=f"{name}layers.{i}.")
    return out if m.norm is None else call(m.norm, out, b, f"{name}norm")


FORWARDS = {nn.MultiheadAttention: attention_forward, nn.TransformerEncoderLayer: encoder_layer_forward,
            nn.TransformerDecoderLayer: decoder_layer_forward, nn.TransformerEncoder: encoder_forward,
            nn.TransformerDecoder: decoder_forward}


def block_forward(module: nn.Module) -> Optional[Callable]:
    """The decomposed forward of a block :func:`transformer_rule_applies` to."""
    return next((fn for base, fn in FORWARDS.items() if isinstance(module, base)), None)


SEQUENCES = ("query", "key", "value", "src", "tgt", "memory")


@functools.lru_cache(maxsize=None)
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


def bind_block_call(module: nn.Module, args: tuple, kwargs: dict) -> Optional[Dict[str, Any]]:
    """The block's arguments by name, defaults filled in (the names of torch's own ``forward``); None where
    they do not bind."""
    try:
        bound = _signature(block_forward(module)).bind_partial(module, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(list(bound.arguments.items())[1:])


def stack_fake_output(module: nn.Module, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """What a fake run of a stock ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` on a batched (3-D) input
    returns: a tensor like that input (its forward asks whether a mask is causal by comparing values, which
    fake tensors do not hold). None for any other module or input."""
    if not isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) or not transformer_rule_applies(module):
        return None
    arguments = bind_block_call(module, args, kwargs) or {}
    first = arguments.get("src", arguments.get("tgt"))
    return torch.empty_like(first) if isinstance(first, torch.Tensor) and first.dim() == 3 else None


def inputs_fit(module: nn.Module, arguments: Dict[str, Any], shape_of: Callable[[Any], Optional[tuple]],
               layout_of: Callable[[Any], BatchLayout], n: int) -> bool:
    """Every sequence (query/key/value, src/tgt/memory) is batched (3-D) with the batch where the block keeps
    it, and every mask holding per-sample rows has them where the block reads them: a key padding mask (N, S)
    one row per sample, a 3-D attention mask (N * heads, L, S) each sample's heads one after another.
    ``shape_of(value)``: None for what is no tensor; ``layout_of(tensor)``: where its batch sits."""
    b = batch_at(module)
    heads = {m.num_heads for m in module.modules() if isinstance(m, nn.MultiheadAttention)}
    for name, value in arguments.items():
        shape = shape_of(value)
        if shape is None:
            continue
        lay = layout_of(value)
        if name in SEQUENCES:
            if len(shape) != 3 or lay != BatchLayout.at(b) or shape[b] != n:
                return False
        elif lay.is_batched:
            if name.endswith("key_padding_mask"):
                if lay != BatchLayout.at(0):
                    return False
            elif not (len(shape) == 3 and len(heads) == 1 and lay == BatchLayout(MERGED, 0, next(iter(heads)))):
                return False
    return True
