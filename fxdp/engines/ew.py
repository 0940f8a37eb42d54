"""The ``ew`` engine: PyTorch's ExpandedWeights (``torch.nn.utils._per_sample_grad``), for models made of
the layers it knows, batch first.

ExpandedWeights writes ``p.grad_sample`` itself (the uses of the forward calls one backward pass reaches
summed per sample), so this engine delivers no captures to its sink: it hands each backward pass's rows to
the sink's :meth:`~fxdp.sinks.contract.GradSampleSink.add_rows`, which adds them per sample to the step's
(one row per sample), and the sink's read side reads ``p.grad_sample``.
"""

from __future__ import annotations

import traceback
from typing import Dict, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxdp.diagnostics import Kind, PerSampleError, UnverifiedModelError, location_from_traceback
from fxdp.engines import selfcheck
from fxdp.engines.base import GradSampleModuleBase, ParameterWatch, trainable_own_params
from fxdp.sinks.contract import SINK_ATTR, GradientSink, batch_size_problem

# The layers whose functional ops ExpandedWeights implements (F.linear, F.conv*, F.embedding,
# F.group_norm, F.instance_norm, F.layer_norm). Its RNN support is partial, so RNNs are not listed.
EW_SUPPORTED_LAYERS = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Embedding,
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
)


def _stock_layer_ew_cannot_handle(module: nn.Module) -> bool:
    """A layer of torch's own (or a subclass of one) outside ``EW_SUPPORTED_LAYERS``: refused when the engine is
    built. Inside such layers the functional ops may see the batch elsewhere than in dimension 0
    (``nn.MultiheadAttention`` runs its projections sequence first), which ExpandedWeights cannot tell. A module of
    the user's own with parameters is let through, as on Opacus: ExpandedWeights computes the parameters that
    reach ``F.linear``, ``F.conv*``, ... and refuses, in the forward, a parameter used by any other op
    (:meth:`ExpandedWeightsGradSampleModule._explain` names the module and line)."""
    if isinstance(module, EW_SUPPORTED_LAYERS):
        return False
    return any(cls.__module__.split(".")[0] == "torch" for cls in type(module).__mro__
               if cls not in (nn.Module, object))



class ExpandedWeightsGradSampleModule(GradSampleModuleBase):
    """PyTorch's ExpandedWeights: the forward runs with every trainable parameter replaced by an
    ``ExpandedWeight``, whose backward writes ``grad_sample`` directly.

    A backward pass's rows go to the sink as the other engines' do: this wrapper sets the step's earlier
    rows aside when a backward pass starts, and hands the new ones with the forward calls the pass reached
    to :meth:`~fxdp.sinks.contract.GradSampleSink.add_rows` when it ends.
    """

    def __init__(self, model: nn.Module, batch_first: bool = True, loss_reduction: str = "mean", *,
                 sink: Optional[GradientSink] = None):
        if not batch_first:
            raise ValueError(
                "fxdp: grad_sample_mode='ew' (PyTorch ExpandedWeights) needs the batch in dimension 0 of "
                "every layer's input; batch_first=False is not supported. Use grad_sample_mode='fx', "
                "'hooks' or 'functorch', or make the model batch first."
            )
        super().__init__(model, batch_first=batch_first, loss_reduction=loss_reduction, sink=sink)
        unsupported = [
            f"'{name or '<model>'}' ({type(m).__name__})"
            for name, m in model.named_modules()
            if trainable_own_params(m) and _stock_layer_ew_cannot_handle(m)
        ]
        if unsupported:
            raise ValueError(
                "fxdp: grad_sample_mode='ew' (PyTorch ExpandedWeights) cannot compute per-sample "
                "gradients for the parameters of " + ", ".join(unsupported) + "; of torch's layers it supports "
                + ", ".join(t.__name__ for t in EW_SUPPORTED_LAYERS)
                + ". Use grad_sample_mode='fx', 'hooks' or 'functorch', or freeze those parameters."
            )
        self._parameter_watch = ParameterWatch(model)
        self._in_backward = False
        self._backward_calls: Dict[int, int] = {}  # forward call -> batch size, for the backward in progress

    def forward(self, *args, **kwargs):
        from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

        self._in_backward = False
        self.forward_calls += 1
        self._parameter_watch.check(getattr(self, SINK_ATTR))
        batch_size = _leading_size(args, kwargs)
        if batch_size == 0:  # ExpandedWeights refuses an empty batch: no rows to compute
            out = self._module(*args, **kwargs)
            self._watch_backward(out, 0, first_only=True)
            return out
        params = [p for p in self._module.parameters() if p.requires_grad]
        # call_for_per_sample_grads refuses parameters that still hold grad_sample; ours are kept
        # across the backward passes of a step, so hide them while it checks.
        hidden = _take_grad_samples(params)
        try:
            per_sample_forward = call_for_per_sample_grads(
                self._module, batch_size=batch_size, loss_reduction=self.loss_reduction
            )
        finally:
            _restore_grad_samples(hidden)
        try:
            out = per_sample_forward(*args, **kwargs)
        except RuntimeError as e:
            if "Expanded Weights" not in str(e) and "ExpandedWeights" not in str(e):
                raise
            raise PerSampleError(self._explain(e)) from e
        self._refuse_outputs_without_the_batch(out, batch_size)
        self._watch_backward(out, batch_size)
        return out

    def _refuse_outputs_without_the_batch(self, out, batch_size: int) -> None:
        """ExpandedWeights takes each row of the first input as a sample: an output without one row per sample (a
        loss computed inside the model, a batch of graphs whose layers see one row per node) says the rows were
        not the samples, or were combined, so the per-row gradients could not be per-sample ones. Refused before
        any backward, as the hooks engine refuses what its self-check cannot verify."""
        for k, t in enumerate(selfcheck.output_tensors(out)):
            if t.dim() == 0 or t.shape[0] != batch_size:
                name = type(self._module).__name__
                why = f"output #{k} has shape {tuple(t.shape)}, without the batch ({batch_size} samples) in dimension 0"
                raise UnverifiedModelError(
                    [selfcheck.finding("<model>", name, Kind.UNVERIFIED, why,
                                       "return one row per sample in dimension 0 of every output (compute the loss "
                                       "outside the model); a batch of graphs is not one ExpandedWeights can split: "
                                       "pad each graph to a fixed number of nodes, (N, nodes, features) with a mask",
                                       selfcheck.forward_location(self._module))],
                    f"fxdp (ew engine): {name} cannot be trained: {why}, so the gradients ExpandedWeights computes "
                    "per row of the first input are not known to be per-sample gradients:")

    def _watch_backward(self, out, batch_size: int, first_only: bool = False) -> None:
        """Hooks on this forward call's outputs: a backward pass that reaches one of them reaches the call."""
        if not torch.is_grad_enabled():
            return
        call = self.forward_calls
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: self._backward_reaches(call, batch_size))
                if first_only:
                    break

    def _backward_reaches(self, call: int, batch_size: int) -> None:
        # The first of these runs before any layer's backward (outputs come last in the forward)
        if not self._in_backward:
            self._in_backward = True
            self._backward_calls = {}
            params = [p for p in self._module.parameters() if p.requires_grad]
            earlier = self._earlier = _take_grad_samples(params)
            token = self._backward_token = object()
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._backward_ends(params, earlier, token))
        problem = batch_size_problem([*self._backward_calls.values(), batch_size])
        if problem is not None:
            # ExpandedWeights would add rows of one batch to rows of another inside this backward (a raw
            # torch error at best): refuse before any layer's backward, with the earlier passes' rows kept
            _restore_grad_samples(self._earlier)
            self._backward_calls, self._in_backward, self._backward_token = {}, False, None
            raise PerSampleError(problem)
        self._backward_calls[call] = batch_size

    def _backward_ends(self, params, earlier, token) -> None:
        if token is not self._backward_token:  # (a pass refused above)
            return
        calls, self._backward_calls, self._in_backward = self._backward_calls, {}, False
        rows = _take_grad_samples(params)
        _restore_grad_samples(earlier)
        if not rows and calls and not any(calls.values()):  # an empty batch: rows of no sample
            rows = {p: p.new_zeros((0, *p.shape)) for p in params}
        getattr(self, SINK_ATTR).add_rows(rows, calls)

    def _explain(self, error: RuntimeError) -> str:
        """Name the innermost module of the model that was running when ExpandedWeights gave up."""
        names = {id(m): name or "<model>" for name, m in self._module.named_modules()}
        culprit = None
        for frame, _ in traceback.walk_tb(error.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                culprit = owner
        where = f" in module '{names[id(culprit)]}' ({type(culprit).__name__})" if culprit is not None else ""
        location = location_from_traceback(error.__traceback__)
        if location is not None:
            where += f" at {location} ({location.code})" if location.code else f" at {location}"
        return (
            f"fxdp: grad_sample_mode='ew' (PyTorch ExpandedWeights) failed{where}: {error}. "
            "ExpandedWeights only handles parameters passed to F.linear, F.conv*, F.embedding, "
            "F.group_norm, F.instance_norm and F.layer_norm; use grad_sample_mode='fx', 'hooks' or "
            "'functorch' for this model."
        )


def _take_grad_samples(params) -> Dict[nn.Parameter, torch.Tensor]:
    taken = {}
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if gs is not None:
            taken[p] = gs
            p.grad_sample = None
    return taken


def _restore_grad_samples(taken: Dict[nn.Parameter, torch.Tensor]) -> None:
    for p, gs in taken.items():
        p.grad_sample = gs


def _leading_size(args, kwargs) -> int:
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    raise ValueError(
        "fxdp: grad_sample_mode='ew' found no tensor argument to read the batch size from"
    )
