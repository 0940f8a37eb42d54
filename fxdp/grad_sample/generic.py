"""The one generic per-sample rule: vmap of a vjp, sample by sample where vmap cannot run.

Each sample is run again alone, as a batch of one in the layout the code was written for; ``vjp``
against that sample's output gradient gives its parameter gradients, and ``vmap`` over the batch does
all samples in one vectorised call (:func:`vmap_or_loop` falls back to a loop for kernels vmap cannot
run). This costs a second forward pass, which is why the common layers have hand-written rules.

Every engine and the compiled graph's DP-aware ops use it, in one of three shapes:

- :func:`generic_grad_sampler` — a module as a whole, with the usual rule signature
  ``(module, activations, backprops)`` (the hooks and functorch engines, layers without a rule);
- :func:`functional_grad_samples` — the parameters used in one call ``fn(*args, **kwargs)``;
- :func:`layout_grad_samples` — a call whose inputs and outputs hold the batch anywhere (a batch at
  dim 1, merged ``(N*T, d)``, broadcast, or no batched input at all): the compiled graph's sites and
  the whole-model op.

Backprops are always those of a *summed* loss: :func:`summed_loss_backprops` is the one place that
undoes a mean reduction's ``1/N``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten, tree_map

from fxdp.diagnostics.errors import PerSampleError
from fxdp.layout import PACKED, BatchLayout

Position = Union[int, str]


AUTOCAST_DEVICES = ("cpu", "cuda")
AutocastState = Tuple[Tuple[str, bool, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """The autocast settings in force now, per device type: taken as a layer runs forward, so that the
    generic rule re-runs it (in backward, usually after the user's autocast region has ended) in the same
    precision, i.e. computes the per-sample gradients of the function the forward computed."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES)


def under_autocast(state: Optional[AutocastState], call: Callable) -> Callable:
    """``call`` run with the autocast settings ``state`` (from :func:`autocast_state`); ``call`` itself when
    none was on in forward and none is on now."""
    if state is None:
        return call
    differs = [(d, on, dtype) for d, on, dtype in state if on or torch.is_autocast_enabled(d)]
    if not differs:
        return call

    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for d, on, dtype in differs:
                stack.enter_context(torch.autocast(d, dtype=dtype, enabled=on))
            return call(*args, **kwargs)

    return run


def summed_loss_scale(loss_reduction: str, batch_size: int) -> float:
    """What the output gradient of a loss reduced this way is multiplied by to be a summed loss's: a
    mean's backprops carry ``1/N``."""
    return float(batch_size) if loss_reduction == "mean" else 1.0


def summed_loss_backprops(backprops, loss_reduction: str, batch_size: int):
    """The output gradient of a summed loss (see :func:`summed_loss_scale`). ``backprops`` may be a tensor
    or a sequence of them (``None`` entries stay)."""
    if loss_reduction != "mean":
        return backprops
    if isinstance(backprops, torch.Tensor):
        return backprops * batch_size
    return [None if g is None else g * batch_size for g in backprops]


def _tensor_outputs(output: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]


def _take(value: Any, spec: Any, i: int) -> Any:
    """Sample i of ``value`` under a vmap ``in_dims`` spec (None: whole; int: that dim; list: per item)."""
    if spec is None:
        return value
    if isinstance(spec, int):
        return tree_map(lambda t: t.select(spec, i) if isinstance(t, torch.Tensor) else t, value)
    return type(value)(_take(v, s, i) for v, s in zip(value, spec))


def _batch_size(args: Sequence[Any], in_dims: Sequence[Any]) -> int:
    for value, spec in zip(args, in_dims):
        if isinstance(spec, int):
            return next(t.shape[spec] for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
        if isinstance(spec, (list, tuple)):
            for v, s in zip(value, spec):
                if s is not None:
                    return _batch_size([v], [s])
    raise ValueError("fxdp: nothing to map over")


def vmap_or_loop(fn: Callable, in_dims: tuple, *args: Any) -> Any:
    """``vmap(fn, in_dims)(*args)``, or the same calls one sample at a time where a kernel cannot be
    vmapped (the fused RNN kernels, data-dependent control flow). Random ops are an error: re-running
    a sample draws new numbers, so its gradient would not be this step's."""
    try:
        return vmap(fn, in_dims=in_dims)(*args)
    except RuntimeError as exc:
        if "randomness" in str(exc):
            raise PerSampleError(
                "it uses random ops (dropout), which draw new numbers when a sample is re-run alone, so the "
                "gradient would not be this step's; set the layer's dropout to 0"
            ) from exc
        rows = [fn(*(_take(a, d, i) for a, d in zip(args, in_dims))) for i in range(_batch_size(args, in_dims))]
        return tree_map(lambda *xs: torch.stack(xs), rows[0], *rows[1:])


def generic_grad_sampler(
    module: nn.Module,
    activations: Sequence[Any],
    backprops,
    *,
    batch_dim: int = 0,
    kwargs: Optional[Mapping[str, Any]] = None,
    out_batch_dim: Optional[int] = None,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``module``'s trainable parameters (all of them, recursively).

    ``activations`` are the module's positional inputs; tensors are batch first and run one sample at a
    time, as a batch of one with the batch at ``batch_dim`` (the module's own layout); anything else,
    and ``kwargs``, is passed unchanged. ``backprops`` is the gradient of a summed loss w.r.t. the
    output (batch first), or a sequence of them when the module returns several tensors (missing
    trailing ones count as zero), whose batch sits at ``out_batch_dim`` in the module's outputs (default
    ``batch_dim``). Buffers and frozen parameters are used, not differentiated.
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        return {}
    if activations and isinstance(activations[0], PackedSequence):
        return _packed_grad_samples(module, named, activations, backprops, dict(kwargs or {}))
    names = [name for name, _ in named]
    params = tuple(p.detach() for _, p in named)
    batched = [isinstance(a, torch.Tensor) for a in activations]
    backprops = [backprops] if isinstance(backprops, torch.Tensor) else list(backprops)
    kwargs = dict(kwargs or {})
    out_dim = batch_dim if out_batch_dim is None else out_batch_dim

    def one_sample(param_values, sample_activations, sample_backprops):
        def forward(*values):
            inputs = tuple(a.unsqueeze(batch_dim) if b else a for a, b in zip(sample_activations, batched))
            return tuple(_tensor_outputs(functional_call(module, dict(zip(names, values)), inputs, kwargs,
                                                         strict=False)))

        outputs, vjp_fn = vjp(forward, *param_values)
        cotangents = tuple(
            sample_backprops[k].unsqueeze(out_dim).to(t.dtype) if k < len(sample_backprops) else torch.zeros_like(t)
            for k, t in enumerate(outputs)
        )
        return vjp_fn(cotangents)

    in_dims = (None, [0 if b else None for b in batched], [0] * len(backprops))
    try:
        grads = vmap_or_loop(one_sample, in_dims, params, list(activations), backprops)
    except Exception as e:  # noqa: BLE001 - re-raised with the module named and the cause kept
        raise PerSampleError(
            f"fxdp: the generic per-sample rule (torch.func) failed on {type(module).__name__} "
            f"({module!r}): {e}. The module is run once per sample as a batch of one; random ops "
            "(dropout) and in-place updates of buffers are not supported there. Register a rule for "
            "it with fxdp.register_grad_sampler."
        ) from e
    return {p: g for (_, p), g in zip(named, grads)}


def _packed_grad_samples(module, named, activations, backprops, kwargs) -> Dict[nn.Parameter, torch.Tensor]:
    """An RNN fed a PackedSequence: ``backprops`` is packed like the input (one row per time step
    of every sample), so the batch has no dimension; each sample is unpacked and run alone, as a
    packed batch of one of its own length, which is what the packed batch computes for it. An initial
    state ``hx`` (positional or keyword) is in the samples' original order, the batch at dim 1."""
    packed = activations[0]
    if isinstance(backprops, (list, tuple)):
        backprops = backprops[0]
    padded, lengths = pad_packed_sequence(PackedSequence(packed.data.detach(), packed.batch_sizes,
                                                         packed.sorted_indices, packed.unsorted_indices),
                                          batch_first=True)
    grads, _ = pad_packed_sequence(PackedSequence(backprops, packed.batch_sizes, packed.sorted_indices,
                                                  packed.unsorted_indices), batch_first=True)
    hx = activations[1] if len(activations) > 1 else kwargs.pop("hx", None)
    params = [p for _, p in named]
    rows = []
    for i, length in enumerate(lengths.tolist()):
        sample = pack_padded_sequence(padded[i:i + 1, :length], [length], batch_first=True)
        sample_hx = tree_map(lambda h: h.detach()[:, i:i + 1] if isinstance(h, torch.Tensor) else h, hx)
        args = (sample,) if sample_hx is None else (sample, sample_hx)
        with torch.enable_grad():
            out = _tensor_outputs(module(*args, **kwargs))[0]  # the output's packed data: (length, H)
            rows.append(torch.autograd.grad(out, params, grads[i, :length].to(out.dtype), allow_unused=True))
    return {p: torch.stack([torch.zeros_like(p) if row[k] is None else row[k] for row in rows])
            for k, p in enumerate(params)}


def _get(args: Sequence[Any], kwargs: Mapping[str, Any], pos: Position) -> Any:
    return kwargs[pos] if isinstance(pos, str) else args[pos]


def _call(fn: Union[Callable, str], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    if isinstance(fn, str):  # an fx call_method target: a method of the first argument
        return getattr(args[0], fn)(*args[1:], **kwargs)
    return fn(*args, **kwargs)


def functional_grad_samples(
    fn: Union[Callable, str],
    args: Sequence[Any],
    kwargs: Optional[Mapping[str, Any]],
    param_positions: Sequence[Position],
    batched_positions: Sequence[Position],
    backprops: torch.Tensor,
) -> List[torch.Tensor]:
    """Per-sample gradients of the parameters used in one call ``fn(*args, **kwargs)``.

    - ``fn``: a callable (``F.linear``, ``operator.mul``, ...) or a method name (``"matmul"``), called on
      ``args[0]`` as an fx ``call_method`` node does;
    - ``param_positions``: where the parameters to differentiate are — an int indexes ``args``, a str
      names a keyword argument;
    - ``batched_positions``: the arguments that are batch-first tensors; each sample gets its own slice
      as a batch of one. All other arguments (parameters included) are passed whole;
    - ``backprops``: gradient of a summed loss w.r.t. the call's output, batch first.

    Returns one tensor ``(N, *param.shape)`` per entry of ``param_positions``, in that order. A parameter
    broadcast against the batch (``x + pos`` with ``pos`` of shape ``(1, T, D)``) gets the gradient of
    its own shape.
    """
    kwargs = dict(kwargs or {})
    clash = set(param_positions) & set(batched_positions)
    if clash:
        raise ValueError(f"fxdp: positions {sorted(map(str, clash))} are both parameters and batched inputs")
    params = tuple(_get(args, kwargs, pos).detach() for pos in param_positions)
    batched = [_get(args, kwargs, pos) for pos in batched_positions]

    def substitute(values: Dict[Position, Any]):
        new_args = [values.get(i, a) for i, a in enumerate(args)]
        new_kwargs = {k: values.get(k, v) for k, v in kwargs.items()}
        return new_args, new_kwargs

    def one_sample(param_values, sample_inputs, sample_backprops):
        def forward(*values):
            replaced: Dict[Position, Any] = dict(zip(param_positions, values))
            replaced.update({pos: x.unsqueeze(0) for pos, x in zip(batched_positions, sample_inputs)})
            return _call(fn, *substitute(replaced))

        output, vjp_fn = vjp(forward, *param_values)
        if output.dim() == 0 or output.shape[0] != 1 or output.shape[1:] != sample_backprops.shape:
            raise PerSampleError(
                f"fxdp: {getattr(fn, '__name__', fn)} on one sample returned shape {tuple(output.shape)}, "
                f"but the output gradient per sample has shape (1, {', '.join(map(str, sample_backprops.shape))}); "
                "the output must be batch first"
            )
        return vjp_fn(sample_backprops.unsqueeze(0).to(output.dtype))

    return list(vmap_or_loop(one_sample, (None, 0, 0), params, batched, backprops))


def layout_grad_samples(
    call: Callable[[List[Any]], Any],
    leaves: List[Any],
    layouts: List[Optional[BatchLayout]],
    param_positions: List[int],
    out_layouts: List[BatchLayout],
    grads: List[Optional[torch.Tensor]],
    n: int,
) -> List[torch.Tensor]:
    """Per-sample gradients of ``call(leaves)`` w.r.t. the leaves at ``param_positions``.

    ``layouts`` says where the batch sits in each leaf (``None`` for non-tensors and parameters),
    ``out_layouts`` in each tensor output, and ``grads`` holds each tensor output's gradient of a summed
    loss (``None`` where the loss did not use it). Each sample runs alone, as a batch of one in the
    layout the graph gives it (a batch at dim 1 stays at dim 1), vmapped over the batch: the definition
    of a per-sample gradient, for any op. Several outputs are handled as one scalar per sample,
    ``sum_k <out_k, grad_k>``, whose gradient is the vjp. A call without batched inputs (a parameter
    expanded to the batch, ``cls.expand(N, -1, -1)``) builds per-sample rows from shared values:
    sample i's gradient is then the vjp of the whole call against row i of the output gradient.
    """
    if any(lay is not None and lay.kind == PACKED for lay in layouts):
        raise PerSampleError(  # passed whole, every sample would see all samples' entries
            "an input holds the samples' entries packed one after another (the flat indices of an "
            "EmbeddingBag with offsets), which the generic rule cannot split into samples; give the EmbeddingBag "
            "its indices straight from the model's input")
    batched = [i for i, lay in enumerate(layouts) if lay is not None and lay.is_batched]
    if not batched:
        return _per_row_grad_samples(call, leaves, param_positions, out_layouts, grads, n)
    args = [
        layouts[i].to_batch_first(leaf.detach(), n) if i in batched
        else leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
        for i, leaf in enumerate(leaves)
    ]
    used = [k for k, g in enumerate(grads) if g is not None]
    cotangents = [out_layouts[k].to_batch_first(grads[k], n) for k in used]
    n_args = len(args)

    def sample_loss(*flat):  # one sample, batch first -> the layout the graph gives it -> <out, grad>
        inputs = [layouts[i].from_batch_first(v) if i in batched else v for i, v in enumerate(flat[:n_args])]
        outs = _tensor_outputs(call(inputs))
        total = sum((out_layouts[k].to_batch_first(outs[k], 1) * g).sum() for k, g in zip(used, flat[n_args:]))
        return total.reshape(1)

    ones = torch.ones(n, dtype=cotangents[0].dtype, device=cotangents[0].device)
    cotangent_positions = list(range(n_args, n_args + len(used)))
    return functional_grad_samples(sample_loss, args + cotangents, {}, param_positions,
                                   batched + cotangent_positions, ones)


def _per_row_grad_samples(call, leaves, param_positions, out_layouts, grads, n):
    fixed = [leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

    def whole(*param_values):
        flat = list(fixed)
        for i, v in zip(param_positions, param_values):
            flat[i] = v
        return tuple(_tensor_outputs(call(flat)))

    outs, vjp_fn = vjp(whole, *[fixed[i] for i in param_positions])
    rows = [lay.to_batch_first(g if g is not None else torch.zeros_like(o), n)
            for lay, g, o in zip(out_layouts, grads, outs)]

    def sample(i):
        own = [lay.from_batch_first(r * (torch.arange(n, device=r.device) == i).view(n, *[1] * (r.dim() - 1)))
               for lay, r in zip(out_layouts, rows)]
        return vjp_fn(tuple(own))

    return vmap(sample)(torch.arange(n))
