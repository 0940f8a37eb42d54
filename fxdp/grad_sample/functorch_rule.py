"""Generic per-sample gradients with ``torch.func``, for code without a hand-written rule.

Each sample is run again as a batch of one (``x[i].unsqueeze(0)``), so the code sees the shapes it
was written for; ``vjp`` against that sample's output gradient gives its parameter gradients, and
``vmap`` over the batch does all samples in one vectorised call. This costs a second forward pass,
which is why the common layers have hand-written rules.

Two entry points:

- :func:`functorch_grad_sampler` — a rule with the usual signature, for a whole module;
- :func:`functional_grad_samples` — for parameters used directly in one torch call of the graph
  (``F.linear(x, self.w)``, ``x * self.scale``, ``x + self.pos_embedding``, ``x @ self.proj``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map

Position = Union[int, str]


def _as_list(backprops) -> List[torch.Tensor]:
    return [backprops] if isinstance(backprops, torch.Tensor) else list(backprops)


def _cotangents(output: Any, sample_backprops: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """The output's tensors and their gradients: the given backprops for the first outputs (as
    batches of one), zeros for the outputs that have none (e.g. attention weights)."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    cotangents = []
    for k, t in enumerate(tensors):
        if k < len(sample_backprops):
            cotangents.append(sample_backprops[k].unsqueeze(0).to(t.dtype))
        else:
            cotangents.append(torch.zeros_like(t))
    return tuple(cotangents)


def _tensor_outputs(output: Any) -> Tuple[torch.Tensor, ...]:
    return tuple(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))


def functorch_grad_sampler(
    module: nn.Module, activations: List[Any], backprops
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``module``'s trainable parameters (all of them, recursively).

    ``activations`` are the module's positional inputs; tensors are batch first and sliced per
    sample, anything else is passed unchanged. ``backprops`` is the gradient of a summed loss
    w.r.t. the output (batch first), or a sequence of them when the module returns several tensors
    (missing trailing ones count as zero). Buffers and frozen parameters are used, not
    differentiated.
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        return {}
    names = [name for name, _ in named]
    params = tuple(p.detach() for _, p in named)
    batched = [isinstance(a, torch.Tensor) for a in activations]
    backprops = _as_list(backprops)

    def one_sample(param_values, sample_activations, sample_backprops):
        def forward(*values):
            inputs = tuple(a.unsqueeze(0) if b else a for a, b in zip(sample_activations, batched))
            return _tensor_outputs(functional_call(module, dict(zip(names, values)), inputs))

        outputs, vjp_fn = vjp(forward, *param_values)
        return vjp_fn(_cotangents(outputs, sample_backprops))

    in_dims = (None, [0 if b else None for b in batched], [0] * len(backprops))
    try:
        grads = vmap_or_loop(one_sample, in_dims, params, list(activations), backprops)
    except Exception as e:  # noqa: BLE001 - re-raised with the module named and the cause kept
        raise RuntimeError(
            f"fxdp: the generic per-sample rule (torch.func) failed on {type(module).__name__} "
            f"({module!r}): {e}. The module is run once per sample as a batch of one; random ops "
            "(dropout) and in-place updates of buffers are not supported there. Register a rule for "
            "it with fxdp.register_grad_sampler."
        ) from e
    return {p: g for (_, p), g in zip(named, grads)}


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
            raise RuntimeError(
                "it uses random ops (dropout), which draw new numbers when a sample is re-run alone, so the "
                "gradient would not be this step's; set the layer's dropout to 0"
            ) from exc
        rows = [fn(*(_take(a, d, i) for a, d in zip(args, in_dims))) for i in range(_batch_size(args, in_dims))]
        return tree_map(lambda *xs: torch.stack(xs), rows[0], *rows[1:])


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

    - ``fn``: a callable (``F.linear``, ``operator.mul``, ``torch.matmul``, ...) or a method name
      (``"matmul"``), called on ``args[0]`` as an fx ``call_method`` node does;
    - ``param_positions``: where the parameters to differentiate are — an int indexes ``args``, a
      str names a keyword argument;
    - ``batched_positions``: the arguments that are batch-first tensors; each sample gets its own
      slice as a batch of one. All other arguments (parameters included) are passed whole;
    - ``backprops``: gradient of a summed loss w.r.t. the call's output, batch first.

    Returns one tensor ``(N, *param.shape)`` per entry of ``param_positions``, in that order. A
    parameter broadcast against the batch (``x + pos`` with ``pos`` of shape ``(1, T, D)``) gets the
    gradient of its own shape.
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
            raise RuntimeError(
                f"fxdp: {getattr(fn, '__name__', fn)} on one sample returned shape {tuple(output.shape)}, "
                f"but the output gradient per sample has shape (1, {', '.join(map(str, sample_backprops.shape))}); "
                "the output must be batch first"
            )
        return vjp_fn(sample_backprops.unsqueeze(0).to(output.dtype))

    return list(vmap_or_loop(one_sample, (None, 0, 0), params, batched, backprops))
