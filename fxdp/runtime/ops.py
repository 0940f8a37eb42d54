"""The DP-aware ops that the per_sample pass puts into the compiled graph.

A compiled model's code reads, for a Linear layer ``fc``::

    batch_size = fxdp_runtime_guards_batch_size(self.fxdp_batch_guard, x)
    fc = fxdp_runtime_ops_dp_aware_layer(self.fc, self.fxdp_site_fc, batch_size, x)

The forward is the ordinary one. What differs is backward: a hook on the layer's output receives the
output gradient G, and together with the saved input A (both moved to batch first with the layouts
the batch_dim pass recorded in the *site*) it becomes one :class:`~fxdp.sinks.contract.LayerCapture`
for the model's gradient sink (``site.sink``, the compiled model's ``fxdp_sink``): the layer, A and G
when a hand-written rule applies, and always a function that materialises the per-sample gradients.
The same (A, G, layout) is what book-keeping clipping needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxdp.diagnostics.errors import PerSampleError
from fxdp.grad_sample.accumulate import trainable_parameters
from fxdp.grad_sample.broadcast import added_parameter_grad_samples, added_parameter_sign, summed_dims
from fxdp.grad_sample.generic import (autocast_state, layout_grad_samples, summed_loss_backprops, summed_loss_scale,
                                     under_autocast)
from fxdp.grad_sample.recurrent import recurrent_rule_applies
from fxdp.grad_sample.registry import find_grad_sampler, rule_name
from fxdp.grad_sample.transformer import (bind_block_call, block_forward, encoder_would_nest, has_hooks,
                                          inputs_fit, transformer_rule_applies)
from fxdp.layout import BATCHED, BROADCAST, BatchLayout
from fxdp.runtime.bookkeeping_calls import call_without_param_grads
from fxdp.runtime.compiled_delivery import (added_parameter_delivery, compiled_call_number, deliver as _deliver,
                                            deliver_in_backward, layer_delivery)
from fxdp.runtime.decided import LayerDecision
from fxdp.runtime.guards import BatchGuard, forward_call, run_eagerly
from fxdp.runtime.recurrent import recurrent_forward
from fxdp.sinks.capture import layer_capture
from fxdp.sinks.contract import GradientSink, LayerCapture


@dataclass
class PerSampleSite:
    """What the per_sample pass knows about one parametrised call in the graph.

    ``layouts`` holds, per tensor argument (flattened args then kwargs), the :class:`~fxdp.layout.BatchLayout`
    of where the batch sits (``batch@0``, ``merged@0(inner=8)``, ``broadcast@0``, ``unbatched``);
    ``out_layouts`` the same for each tensor output. The batch guard replaces both lists (never mutates them)
    with the ones analysed for each forward's input shapes: without example inputs they are filled in on the
    first forward, before its backward.
    """

    node: str  # the original node's name
    target: str  # "fc" (module) or "torch.nn.functional.linear" / "mul" (function / method)
    rule: str  # rule name for the report: "Linear" (hand-written), "generic", ...
    loss_reduction: str
    layouts: List[BatchLayout] = field(default_factory=list)
    out_layouts: List[BatchLayout] = field(default_factory=lambda: [BatchLayout.at(0)])  # one per tensor output
    fn: Union[Callable, str, None] = None  # functional uses: the torch function, or the Tensor method's name
    description: str = ""  # for the report: "layer 'fc' (Linear)", "'mul' using 'scale'"
    sink: Optional[GradientSink] = field(default=None, repr=False, compare=False)  # the model's sink
    guard: Optional[BatchGuard] = field(default=None, repr=False, compare=False)  # the model's fxdp_batch_guard
    calls: int = field(default=0, repr=False, compare=False)  # without a guard: calls so far (see forward_call)
    # the site of the stock transformer block this site was made for at one call (the same sink, guard and loss
    # reduction): under torch.compile the backward delivers through it, an object that outlives the trace
    block: Optional["PerSampleSite"] = field(default=None, repr=False, compare=False)
    # what the last call decided, for the next calls while it holds (fxdp/runtime/decided.py)
    decided: Optional[LayerDecision] = field(default=None, repr=False, compare=False)

    def in_layout(self, i: int) -> BatchLayout:
        if i >= len(self.layouts):  # a guess here could read another sample's data as this one's
            raise PerSampleError(
                f"fxdp: node '{self.node}' received more tensor arguments at run time than the {len(self.layouts)} "
                "the per_sample pass recorded layouts for; compile again with example_inputs shaped like the "
                "real inputs"
            )
        return self.layouts[i]


def _expand_broadcast(tensors: List[Any], layouts: List[BatchLayout], n: int) -> Tuple[List[Any], List[BatchLayout]]:
    """Inputs broadcast over the batch (position ids of shape (1, T)) become (N, T): the layer's output
    is then per-sample, so its backprops are too. Consumers broadcast it anyway (checked by the pass)."""
    out_t, out_l = [], []
    for t, lay in zip(tensors, layouts):
        if isinstance(t, torch.Tensor) and lay.kind == BROADCAST:
            shape = list(t.shape)
            shape[lay.dim] = n
            t, lay = t.expand(shape), BatchLayout.at(lay.dim)
        out_t.append(t)
        out_l.append(lay)
    return out_t, out_l


def _tensor_layouts(site: PerSampleSite, leaves: List[Any]) -> List[BatchLayout]:
    layouts, k = [], 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            layouts.append(site.in_layout(k))
            k += 1
        else:
            layouts.append(None)
    return layouts


def _trainable_parameter(leaf) -> bool:
    """``isinstance(leaf, nn.Parameter) and leaf.requires_grad``, answered without Parameter's own
    ``__instancecheck__`` (Python, a microsecond per call) for the usual leaf, a plain tensor."""
    return type(leaf) is not torch.Tensor and isinstance(leaf, nn.Parameter) and leaf.requires_grad


def _output_tensors(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _positional(leaves: List[Any]) -> Tuple[tuple, dict]:
    return tuple(leaves), {}


def _flatten(args: tuple, kwargs: dict) -> Tuple[List[Any], Callable[[List[Any]], Tuple[tuple, dict]]]:
    """A call's leaves, and a function that rebuilds ``(args, kwargs)`` from leaves in their places. The
    common call, a layer on positional tensors (``fc(x)``), does without pytree, whose flattening costs
    about as much as a small layer's forward."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return list(args), _positional
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return leaves, lambda new: pytree.tree_unflatten(list(new), spec)


class _OwnOutputs(torch.autograd.Function):
    """The identity on a call's tensor outputs, whose backward hands their gradients to ``record``.

    A hook on an output tensor receives the gradient of every use of it, its uses inside the call included:
    where one returned tensor also feeds another (``h = f(x); return h, g(h)``), ``h``'s would hold ``g``'s
    share too, and the generic rule, which back-propagates through every output, would count that path
    twice. The outputs handed on are new tensors (sharing storage and version counter, so an in-place
    change is still caught where the call saved them): only uses after the call reach this backward."""

    @staticmethod
    def forward(ctx, record, *outputs):
        ctx.record = record
        ctx.set_materialize_grads(False)  # an output the loss does not use: None
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        with torch.enable_grad():  # see _on_backward
            ctx.record(list(grads))
        return (None, *grads)


def _on_backward(out, outputs: List[torch.Tensor], record):
    """``out``, arranged so that ``record(grads)`` is called once the gradients of all ``outputs`` (the
    tensors in ``out``, in order) are known, never if none needs them. Several outputs are replaced (see
    :class:`_OwnOutputs`): the caller hands on what this returns.

    ``record`` runs with grad mode on: backward hooks run with it off, and some kernels (the CPU LSTM)
    then take an inference path that the per-sample vjp cannot differentiate."""
    needing = [k for k, t in enumerate(outputs) if t.requires_grad]
    if not torch.is_grad_enabled() or not needing:
        return out
    if len(outputs) == 1:
        def record_with_grad_mode(g):
            with torch.enable_grad():
                record([g])

        # (eagerly under torch.compile: dynamo would trace the hook's body, Python with side effects on the
        # sink, and break the graph here anyway, after speculating through the sink with symbolic shapes)
        run_eagerly(outputs[0].register_hook, record_with_grad_mode)
        return out

    def all_grads(grads):
        full = [None] * len(outputs)
        for k, g in zip(needing, grads):
            full[k] = g
        record(full)

    own = dict(zip(needing, run_eagerly(_OwnOutputs.apply, all_grads, *[outputs[k] for k in needing])))
    leaves, spec = pytree.tree_flatten(out)
    k = -1
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            k += 1
            leaves[i] = own.get(k, leaf)
    return pytree.tree_unflatten(leaves, spec)


def _lasting(site: PerSampleSite) -> PerSampleSite:
    """The site a compiled delivery refers to: the site itself, or for a layer inside a stock transformer block,
    whose site is made anew at every call (and, under torch.compile, by dynamo while tracing: an object dynamo
    would hand the delivery without its attributes), the block's."""
    return site.block if site.block is not None else site


def _out_layouts(site: PerSampleSite, count: int) -> List[BatchLayout]:
    layouts = site.out_layouts
    return list(layouts) + [layouts[-1]] * (count - len(layouts))


def _generic_recorder(call, leaves, layouts, positions, out_layouts, n, site):
    """The backward step of the generic rule: per-sample gradients of the leaves at ``positions``, the
    call re-run under the autocast settings of its forward (taken now: this runs as the call runs forward)."""
    forward = forward_call(site)
    call = under_autocast(autocast_state(), call)

    def record(grads) -> None:
        grads = summed_loss_backprops(grads, site.loss_reduction, n)

        def grad_samples():
            if n == 0:  # an empty batch: no sample to re-run
                return {leaves[i]: leaves[i].new_zeros((0, *leaves[i].shape)) for i in positions}
            try:
                samples = layout_grad_samples(call, leaves, layouts, positions, out_layouts, grads, n)
            except Exception as exc:  # re-raised naming the node; the cause is kept
                raise PerSampleError(
                    f"fxdp: the generic per-sample rule, which re-runs each sample alone as a batch of one, failed "
                    f"on '{site.target}' at node '{site.node}': {exc}. Or register a per-sample rule for this layer "
                    "with @fxdp.register_grad_sampler."
                ) from exc
            return {leaves[i]: g for i, g in zip(positions, samples)}

        _deliver(site, LayerCapture(n, grad_samples, params=tuple(leaves[i] for i in positions)), forward)

    return record


def dp_aware_layer(module: nn.Module, site: PerSampleSite, n: int, *args, **kwargs):
    """Call a layer; in backward, add the per-sample gradients of its parameters (and of parameters
    passed to it as arguments, as in ``self.act(self.raw)``)."""
    if not torch.is_grad_enabled():  # evaluation: nothing to record, and layouts are not guarded then
        return module(*args, **kwargs)
    traced = torch.compiler.is_dynamo_compiling()  # (torch.compile: nothing kept, nothing read)
    decided = None if traced else site.decided
    if decided is not None and not kwargs and len(args) == 1 and decided.holds(module, site, args[0]):
        # what the last call decided, all of it checked to hold (fxdp/runtime/decided.py)
        leaves, layouts, rebuild = list(args), decided.layouts, _positional
        arg_params, trainable = [], decided.trainable
    else:
        decided = None
        leaves, rebuild = _flatten(args, kwargs)
        layouts = _tensor_layouts(site, leaves)
        leaves, layouts = _expand_broadcast(leaves, layouts, n)
        args, kwargs = rebuild(leaves)
        arg_params = [i for i, leaf in enumerate(leaves) if _trainable_parameter(leaf)]
        trainable = trainable_parameters(module)
        if not arg_params and n > 0 and trainable and recurrent_rule_applies(module):
            out = _recurrent_call(module, site, n, leaves, layouts, args, kwargs)
            if out is not None:
                return out
        if not arg_params and n > 0 and trainable and transformer_rule_applies(module):
            out = _transformer_call(module, site, n, leaves, layouts, args, kwargs)
            if out is not None:
                return out
    out = None
    if getattr(site.sink, "skips_param_grads", False) and not arg_params:
        # the sink forms each parameter's gradient itself (book-keeping): only input gradients flow
        out = call_without_param_grads(site.sink, module, args, kwargs)
    if out is None:
        out = module(*args, **kwargs)
    outputs = _output_tensors(out)
    if not (trainable or arg_params) or not outputs:
        return out
    out_layouts = _out_layouts(site, len(outputs))

    rule = decided.rule if decided is not None else find_grad_sampler(module)
    if decided is None and not traced:  # kept for the next call where it may be, else dropped
        site.decided = LayerDecision.make(site, module, args, kwargs, layouts, arg_params, trainable, rule, outputs)
    if rule is not None and len(outputs) == 1 and not arg_params:
        # hand-written rule: it sees batch-first activations and backprops
        activations = [
            lay.to_batch_first(t.detach(), n) for t, lay in zip(leaves, layouts) if isinstance(t, torch.Tensor)
        ]

        if compiled_call_number(site) is not None and outputs[0].requires_grad:  # no graph break: compiled_delivery
            return deliver_in_backward(outputs[0], layer_delivery(_lasting(site), module, out_layouts[0]), n,
                                       compiled_call_number(site), activations)
        forward = forward_call(site)

        params = decided.params if decided is not None else tuple(trainable.values())

        def record(grads) -> None:
            # G as it came, with the factor that makes it a summed loss's: a sink that folds the factor
            # into its norms and clip factors saves a copy of G (see LayerCapture)
            backprops = out_layouts[0].to_batch_first(grads[0], n)
            _deliver(site, layer_capture(module, activations, backprops, batch_size=n,
                                         backprops_scale=summed_loss_scale(site.loss_reduction, n),
                                         params=params, rule=rule), forward)

    else:
        # generic rule: the layer as a function of its parameters, each sample alone
        names = list(trainable)
        n_inputs = len(leaves)
        all_leaves = list(leaves) + [trainable[k] for k in names]
        all_layouts = list(layouts) + [None] * len(names)
        positions = arg_params + list(range(n_inputs, len(all_leaves)))

        def call(flat):
            a, k = rebuild(flat[:n_inputs])
            return torch.func.functional_call(module, dict(zip(names, flat[n_inputs:])), a, k, strict=False)

        record = _generic_recorder(call, all_leaves, all_layouts, positions, out_layouts, n, site)

    return _on_backward(out, outputs, record)


def _recurrent_call(module: nn.Module, site: PerSampleSite, n: int, leaves, layouts, args, kwargs):
    """A stock LSTM / GRU / RNN run step by step with its own parameters (the same output), delivering one
    Linear-like capture per projection (:mod:`fxdp.runtime.recurrent`). ``None`` where the batch is not
    where the layer keeps it (then the generic rule decides)."""
    call = dict(zip(("input", "hx"), args), **kwargs)
    x = call.get("input")
    if set(call) - {"input", "hx"} or not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    batch_at = 0 if module.batch_first else 1
    tensors = [lay for leaf, lay in zip(leaves, layouts) if isinstance(leaf, torch.Tensor)]
    if (tensors[0] != BatchLayout.at(batch_at) or any(lay != BatchLayout.at(1) for lay in tensors[1:])
            or x.shape[batch_at] != n):
        return None
    forward = forward_call(site)
    return recurrent_forward(module, x, call.get("hx"), deliver=lambda capture: _deliver(site, capture, forward),
                             loss_reduction=site.loss_reduction,
                             param_grads=not getattr(site.sink, "skips_param_grads", False))


def _transformer_call(module: nn.Module, site: PerSampleSite, n: int, leaves, layouts, args, kwargs):
    """A stock transformer block run as torch runs it with gradients, each of its projections, feed-forward
    layers and norms a DP-aware call of its own with the batch where the block keeps it
    (:mod:`fxdp.grad_sample.transformer`). ``None`` where a sequence does not have the batch there, or a mask
    holds per-sample rows where the block does not read them, or the block has hooks (then the generic rule
    decides)."""
    given = None if has_hooks(module) else bind_block_call(module, args, kwargs)
    if given is None or not inputs_fit(module, given, lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None,
                                       lambda t: next(lay for leaf, lay in zip(leaves, layouts) if leaf is t), n):
        return None
    if isinstance(module, nn.TransformerEncoder) and encoder_would_nest(
            module, given["src"], given["mask"], given["src_key_padding_mask"]):
        return None
    guard = site.guard if site.guard is not None else SimpleNamespace(calls=forward_call(site))

    def call(layer: nn.Module, x: torch.Tensor, at: int, name: str) -> torch.Tensor:
        if not any(p.requires_grad for p in layer.parameters()):
            return layer(x)
        lay = [BatchLayout.at(at)]
        child = PerSampleSite(f"{site.node}.{name}", f"{site.target}.{name}", rule_name(layer) or "generic",
                              site.loss_reduction, lay, lay, None, f"layer '{site.target}.{name}' "
                              f"({type(layer).__name__})", site.sink, guard, block=_lasting(site))
        return dp_aware_layer(layer, child, n, x)

    return block_forward(module)(module, **given, call=call)


def dp_aware_function(site: PerSampleSite, n: int, *args, **kwargs):
    """Call a torch function (or Tensor method, by name) that uses parameters directly
    (``F.linear(x, self.w)``, ``x * self.scale``); in backward, add their per-sample gradients."""
    fn = site.fn
    call_fn = (lambda *a, **k: getattr(a[0], fn)(*a[1:], **k)) if isinstance(fn, str) else fn
    out = call_fn(*args, **kwargs)
    leaves, rebuild = _flatten(args, kwargs)
    param_positions = [i for i, leaf in enumerate(leaves) if _trainable_parameter(leaf)]
    outputs = _output_tensors(out)
    if not param_positions or not outputs or not torch.is_grad_enabled():
        return out
    layouts = _tensor_layouts(site, leaves)
    out_layouts = _out_layouts(site, len(outputs))
    if len(param_positions) == 1 and len(outputs) == 1 and out_layouts[0].kind == BATCHED:
        arranged = _added_parameter_call(site, n, args, kwargs, param_positions[0], out, out_layouts[0].dim)
        if arranged is not None:
            return arranged

    def call(flat):
        a, k = rebuild(flat)
        return call_fn(*a, **k)

    return _on_backward(out, outputs, _generic_recorder(call, leaves, layouts, param_positions, out_layouts, n, site))


def _added_parameter_call(site: PerSampleSite, n: int, args, kwargs, position: int, out, batch_at: int):
    """``out`` of ``x + p`` / ``x - p`` for a parameter ``p`` broadcast against per-sample data, arranged so that
    backward delivers p's per-sample gradient: the output gradient summed over p's broadcast dimensions
    (:mod:`fxdp.grad_sample.broadcast`). None where that form does not apply (the generic rule decides)."""
    sign = added_parameter_sign(site.fn, position, len(args), bool(kwargs))
    param = args[position] if sign is not None and position < len(args) else None
    if param is None or not isinstance(args[1 - position], torch.Tensor) or out.shape[batch_at] != n:
        return None
    dims = summed_dims(out.shape, batch_at, param.shape)
    if dims is None:
        return None
    if compiled_call_number(site) is not None and out.requires_grad:  # no graph break: see compiled_delivery
        return deliver_in_backward(out, added_parameter_delivery(_lasting(site), param, batch_at, dims, sign), n,
                                   compiled_call_number(site), [])
    forward = forward_call(site)
    scale = sign * summed_loss_scale(site.loss_reduction, n)

    def record(grads) -> None:
        gs = added_parameter_grad_samples(grads[0], batch_at, param, dims, scale)
        _deliver(site, LayerCapture(n, lambda: {param: gs}, params=(param,)), forward)

    return _on_backward(out, [out], record)
