"""How a DP-aware op hands its capture to the sink under ``torch.compile``, without a graph break.

Eagerly a DP-aware op registers a backward hook on its output (:func:`fxdp.runtime.ops._on_backward`): Python
with side effects on the sink, which dynamo cannot put in a graph, so it broke the graph at every layer. Under
torch.compile the op instead passes its output through :class:`_DeliverInBackward`, an autograd Function that
dynamo traces: its forward is the identity and saves the layer's batch-first inputs A, its backward calls
``fxdp::deliver_capture``, a custom op that dynamo, AOTAutograd and inductor treat as opaque (registered as
effectful, so that no compiler drops it, its result being unused). That op runs as Python when the compiled
backward runs, with the real G and A, and builds the same :class:`~fxdp.sinks.contract.LayerCapture` the eager
hook builds.

What the op needs besides tensors (the site, the layer, where the batch sits in G, the batch size and the
forward call) reaches it as integers: the layer's *delivery* is registered when dynamo traces the call
(:func:`register_delivery`, run with the real objects at trace time, ``torch.compiler.assume_constant_result``)
and the graph holds its key. Dynamo guards on the identity of the site and the layer and on the layout values
the graph was traced with, so a replaced layer or a new layout is traced again, with a delivery of its own.
A delivery holds its site, layer and parameter weakly: a model deleted leaves a few integers behind, which the
next registration drops.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import nn

from fxdp.diagnostics.errors import PerSampleError
from fxdp.grad_sample.broadcast import added_parameter_grad_samples
from fxdp.grad_sample.generic import summed_loss_scale
from fxdp.layout import BatchLayout
from fxdp.sinks.capture import layer_capture
from fxdp.sinks.contract import LayerCapture

# Traced on the torch versions it was tested on (2.13 and later, on the CPU). Torch 2.11's dynamo stops at
# register_delivery ("PerSampleSite is not a constant", seen on a GPU machine, docs/torch_compile.md): there the
# DP-aware op keeps its eager hook, a graph break per layer, as before this file.
TRACEABLE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)

# kinds of delivery: a layer with a hand-written rule (A and G), a parameter added to per-sample data (G alone)
LAYER_RULE, ADDED_PARAMETER = "layer rule", "added parameter"


@dataclass
class _Delivery:
    kind: str
    site: weakref.ref
    owner: weakref.ref  # the layer (LAYER_RULE) or the parameter (ADDED_PARAMETER)
    out_layout: BatchLayout  # where the batch sits in G, as traced
    batch_at: int = 0  # ADDED_PARAMETER: the batch dimension of G
    dims: tuple = ()  # ADDED_PARAMETER: the dimensions of G summed into the parameter's
    sign: float = 1.0  # ADDED_PARAMETER: +1 for x + p, -1 for x - p


_DELIVERIES: Dict[int, _Delivery] = {}
_KEYS = itertools.count()


def deliver(site, capture: LayerCapture, call: int) -> None:
    """Hand ``capture``, of the forward call ``call``, to the site's sink (eagerly and compiled alike)."""
    capture.call = call  # captures of different forward calls hold different samples: rows in call order
    if site.sink is None:  # a site is given its model's sink when the per_sample pass creates it
        raise PerSampleError(f"fxdp: node '{site.node}' has no gradient sink; compile the model with fxdp.compile_for_dp")
    site.sink.add(capture)


@torch.compiler.assume_constant_result
def register_delivery(kind: str, site, owner, out_kind: str, out_dim: Optional[int], out_inner: int,
                      batch_at: int = 0, dims: tuple = (), sign: float = 1.0) -> int:
    """The key of a new delivery (run once per trace of a DP-aware op, with the real objects)."""
    for key in [k for k, d in _DELIVERIES.items() if d.site() is None or d.owner() is None]:
        del _DELIVERIES[key]  # of models (or layers) deleted since
    key = next(_KEYS)
    _DELIVERIES[key] = _Delivery(kind, weakref.ref(site), weakref.ref(owner), BatchLayout(out_kind, out_dim, out_inner),
                                 batch_at, tuple(dims), sign)
    return key


@torch.library.custom_op("fxdp::deliver_capture", mutates_args=())
def deliver_capture(grad: torch.Tensor, saved: List[torch.Tensor], key: int, batch_size: int,
                    call: torch.Tensor) -> None:
    """Build the capture of delivery ``key`` from the output gradient ``grad`` and the saved batch-first inputs,
    and hand it to the site's sink (run by the compiled backward, as Python)."""
    delivery = _DELIVERIES.get(key)
    site = None if delivery is None else delivery.site()
    owner = None if delivery is None else delivery.owner()
    if site is None or owner is None:
        raise PerSampleError(
            "fxdp: a torch.compile'd backward reached a DP-aware layer whose model (or layer) no longer exists, so its "
            "per-sample gradients have nowhere to go; keep the private model alive until its backward has run"
        )
    # A sink may keep A and G until the optimizer step (book-keeping does), but the compiled backward owns their
    # memory: inductor writes later results into a buffer once its last reader in the graph (this op) is done with
    # it, G's and the saved A's alike (AOTAutograd donates saved tensors to the backward)
    grad, saved = grad.clone(), [t.clone() for t in saved]
    with torch.enable_grad():  # as the eager hook's record does (see fxdp.runtime.ops._on_backward)
        deliver(site, _capture(delivery, site, owner, grad, saved, batch_size), int(call))


@deliver_capture.register_fake
def _(grad, saved, key, batch_size, call) -> None:
    return None


# effectful: its result is unused, and a compiler drops an op whose result is unused unless told otherwise
torch.library._register_effectful_op("fxdp::deliver_capture", torch._library.effects.EffectType.ORDERED)


def _capture(delivery: _Delivery, site, owner, grad: torch.Tensor, saved: List[torch.Tensor], n: int) -> LayerCapture:
    scale = summed_loss_scale(site.loss_reduction, n)
    if delivery.kind == LAYER_RULE:  # as ops.dp_aware_layer's record, from what the forward saved
        return layer_capture(owner, list(saved), delivery.out_layout.to_batch_first(grad, n), batch_size=n,
                             backprops_scale=scale)
    gs = added_parameter_grad_samples(grad, delivery.batch_at, owner, list(delivery.dims), delivery.sign * scale)
    return LayerCapture(n, lambda: {owner: gs}, params=(owner,))


def compiled_call_number(site) -> Optional[torch.Tensor]:
    """Under torch.compile, the number of the forward call the site runs in, as a tensor (the model's batch guard
    sets it at every forward, eagerly); None otherwise, or for a site without such a guard (the DP-aware op then
    registers its eager hook, a graph break)."""
    if not TRACEABLE or not torch.compiler.is_dynamo_compiling():
        return None
    return getattr(site.guard, "call_number", None)


class _DeliverInBackward(torch.autograd.Function):
    """The identity on a layer's output, whose backward hands the output gradient and the saved inputs to
    ``fxdp::deliver_capture``, then passes the gradient on unchanged."""

    @staticmethod
    def forward(ctx, out, key, batch_size, call, *saved):
        ctx.key, ctx.batch_size = key, batch_size
        ctx.save_for_backward(call, *saved)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        call, *saved = ctx.saved_tensors
        torch.ops.fxdp.deliver_capture(grad, saved, ctx.key, ctx.batch_size, call)
        return (grad, None, None, None) + (None,) * len(saved)


def deliver_in_backward(out: torch.Tensor, key: int, batch_size: int, call: torch.Tensor, saved: List[torch.Tensor]):
    """``out``, arranged so that the compiled backward delivers the capture of ``key`` (see the module docstring)."""
    return _DeliverInBackward.apply(out, key, batch_size, call, *saved)


def layer_delivery(site, module: nn.Module, out_layout: BatchLayout) -> int:
    return register_delivery(LAYER_RULE, site, module, out_layout.kind, out_layout.dim, out_layout.inner)


def added_parameter_delivery(site, param: nn.Parameter, batch_at: int, dims, sign: float) -> int:
    at = BatchLayout.at(batch_at)
    return register_delivery(ADDED_PARAMETER, site, param, at.kind, at.dim, at.inner, batch_at, tuple(dims), sign)
