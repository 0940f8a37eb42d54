"""The ``functorch`` engine (``grad_sample_mode="functorch"``): per-sample gradients of the whole model
at once, with the generic rule (``vmap`` over the samples of ``vjp`` through
``functional_call(model, params, x_i)``) run in a hook on the model's output.

It differs from the compiled graph's whole-model fallback (``fx+whole-model``, :mod:`fxdp.engines.whole_model`),
which knows where the batch sits in every input and output from the batch_dim pass: here positional
tensor arguments carry the batch (at dim 0, or 1 with ``batch_first=False``), keyword arguments are
passed unchanged to every sample (a keyword tensor with the batch's number of rows is refused: it may hold one
row per sample, and fxdp does not guess), and the model must return one tensor. Random ops (dropout in
training mode) cannot be replayed per sample and make vmap raise.

A ``PackedSequence`` input (one positional argument, sequences of different lengths) cannot be split for
vmap: each sample then runs alone, as a PackedSequence of one, in a loop, with its own rows of the output
gradient; the output must then be a PackedSequence too (its rows are what say whose gradient is whose).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

from fxdp.diagnostics.errors import PerSampleError, UnsupportedInputError
from fxdp.engines.base import GradSampleModuleBase, ParameterWatch
from fxdp.grad_sample.generic import autocast_state, summed_loss_backprops
from fxdp.sinks.capture import layer_capture
from fxdp.sinks.contract import SINK_ATTR, LayerCapture


class FunctorchGradSampleModule(GradSampleModuleBase):
    """The whole model under the generic rule (see the module docstring)."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._parameter_watch = ParameterWatch(model)

    def forward(self, *args, **kwargs):
        self.forward_calls += 1
        self._parameter_watch.check(getattr(self, SINK_ATTR))
        out = self._module(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        if any(isinstance(a, PackedSequence) for a in (*args, *kwargs.values())):
            return self._packed(args, kwargs, out)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"fxdp: grad_sample_mode='functorch' differentiates the model's output, which must be a "
                f"single tensor, but {type(self._module).__name__}.forward returned {_describe(out)}. "
                "Use grad_sample_mode='fx' or 'hooks', or wrap the model so that forward returns one tensor."
            )
        if out.requires_grad and any(p.requires_grad for p in self._module.parameters()):
            self._refuse_keywords_with_the_batch(args, kwargs)
            activations = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            out.register_hook(self._whole_model_hook(activations, kwargs, self._output_batch_dim(args, kwargs, out)))
        return out

    def _refuse_keywords_with_the_batch(self, args, kwargs) -> None:
        """Keyword inputs go whole to every sample (shared by all samples): one with the batch's number of rows may
        hold one row per sample, which that reading would get wrong; fxdp does not guess, it refuses."""
        n = next((a.shape[self.batch_dim] for a in args if isinstance(a, torch.Tensor) and a.dim() > self.batch_dim),
                 None)
        rows = {k: tuple(v.shape) for k, v in kwargs.items()
                if isinstance(v, torch.Tensor) and v.dim() > self.batch_dim and v.shape[self.batch_dim] == n}
        if n is not None and n > 1 and rows:
            listed = ", ".join(f"{k}= {shape}" for k, shape in rows.items())
            raise UnsupportedInputError(
                f"fxdp: grad_sample_mode='functorch' gives keyword inputs whole to every sample (shared by all "
                f"samples), but {listed} {'has' if len(rows) == 1 else 'have'} the batch's {n} rows at dimension "
                f"{self.batch_dim}, as if holding one row per sample; read as shared, per-sample gradients would be "
                "wrong if it does. Pass it positionally if it holds one row per sample, or use grad_sample_mode='fx' "
                "and name the batched inputs with batch_inputs= (the others are then shared)")

    def _output_batch_dim(self, args, kwargs, out: torch.Tensor) -> int:
        """Where the batch sits in the model's output, which need not be where it sits in the inputs (a
        batch-second model may return batch-first logits): the one dimension of the batch's size; where several
        have it, the one that becomes 1 when the model runs on the batch's first sample alone."""
        n = next((a.shape[self.batch_dim] for a in args if isinstance(a, torch.Tensor) and a.dim() > self.batch_dim),
                 None)
        candidates = [k for k in range(out.dim()) if out.shape[k] == n]
        if n == 1 and candidates:  # one sample: any dimension of size 1 holds it (moving it moves no data)
            return self.batch_dim if self.batch_dim in candidates else candidates[0]
        if n is None:
            return self.batch_dim
        if len(candidates) > 1:
            one = [a.narrow(self.batch_dim, 0, 1) if isinstance(a, torch.Tensor) and a.dim() > self.batch_dim else a
                   for a in args]
            with torch.no_grad():
                alone = self._module(*one, **kwargs)
            if isinstance(alone, torch.Tensor) and alone.dim() == out.dim():
                candidates = [k for k in candidates if alone.shape[k] == 1]
        if len(candidates) != 1:
            raise PerSampleError(
                f"fxdp: grad_sample_mode='functorch' cannot tell where the batch of {n} samples sits in "
                f"{type(self._module).__name__}'s output of shape {tuple(out.shape)}; use grad_sample_mode='fx' "
                "or 'hooks', which follow the batch through each layer")
        return candidates[0]

    def _whole_model_hook(self, activations, kwargs, out_dim: int):
        """The output gradient, batch first, with the inputs (the engine's layout) becomes one capture: the
        generic rule on the whole model, each sample a batch of one."""
        call, module = self.forward_calls, self._module
        autocast = autocast_state()

        def hook(grad: torch.Tensor) -> None:
            acts, _, n = self._to_batch_first(activations, grad.movedim(out_dim, self.batch_dim))
            backprops = summed_loss_backprops(grad.movedim(out_dim, 0), self.loss_reduction, n)
            capture = layer_capture(module, acts, backprops, batch_size=n, batch_dim=self.batch_dim, kwargs=kwargs,
                                    generic=True, autocast=autocast, out_batch_dim=out_dim)
            capture.call = call
            self._deliver(capture, module)

        return hook


    def _packed(self, args, kwargs, out):
        """The loop for a PackedSequence input (see the module docstring)."""
        if len(args) != 1 or not isinstance(args[0], PackedSequence) or any(
                isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise TypeError("fxdp: grad_sample_mode='functorch' takes a PackedSequence as the model's only tensor "
                            "input; use grad_sample_mode='hooks' for this model")
        if not isinstance(out, PackedSequence):
            raise TypeError(
                f"fxdp: grad_sample_mode='functorch' with a PackedSequence input needs a PackedSequence output, "
                f"whose rows say which sample each gradient row belongs to, but {type(self._module).__name__}."
                f"forward returned {_describe(out)}. Use grad_sample_mode='hooks' for this model.")
        params = {name: p for name, p in self._module.named_parameters() if p.requires_grad}
        if out.data.requires_grad and params:
            inputs, call = _sequences(args[0]), self.forward_calls
            model, reduction = self._module, self.loss_reduction

            def hook(grad: torch.Tensor) -> None:
                grads = _sequences(out._replace(data=summed_loss_backprops(grad, reduction, len(inputs))))

                def grad_samples() -> Dict[nn.Parameter, torch.Tensor]:
                    rows = [_alone(model, params, x, g, kwargs) for x, g in zip(inputs, grads)]
                    return {p: torch.stack([r[i] for r in rows]) for i, p in enumerate(params.values())}

                capture = LayerCapture(len(inputs), grad_samples, params=tuple(params.values()))
                capture.call = call
                self._deliver(capture)

            out.data.register_hook(hook)
        return out


def _sequences(packed: PackedSequence) -> List[torch.Tensor]:
    """Each sample's rows ``(T_i, ...)``, in the caller's order."""
    padded, lengths = pad_packed_sequence(packed, batch_first=True)
    return [padded[i, :length] for i, length in enumerate(lengths.tolist())]


def _alone(model: nn.Module, params: Dict[str, nn.Parameter], x: torch.Tensor, grad: torch.Tensor, kwargs):
    """The gradient of ``<model(x alone), grad>`` for every parameter (zero where it does not reach)."""
    with torch.enable_grad():
        out = torch.func.functional_call(model, params, (pack_sequence([x.detach()]),), kwargs, strict=False)
        found = torch.autograd.grad(out.data, list(params.values()), grad, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(found, params.values())]


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} values"
    return f"a {type(value).__name__}"
