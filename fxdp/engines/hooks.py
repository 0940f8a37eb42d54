"""The hooks engine: per-sample gradients for a model that is not compiled.

:class:`GradSampleModule` wraps a model (sharing its parameters) and puts two hooks on every *layer*:
a forward hook that keeps the layer's tensor inputs, and a tensor hook on the layer's output that
receives the output gradient and hands (inputs, output gradient) to the model's gradient sink, which
turns them into ``p.grad_sample`` with the layer's registered rule (or the generic rule). Tensor hooks
on outputs, unlike full backward hooks, keep working when an in-place op (``ReLU(inplace=True)``, ``out += x``) follows the layer: a
hook registered before the in-place op receives the gradient of the value the layer returned.

Which modules are layers (decided once, walking the model from the top):

- a module with a registered rule owns its whole subtree (the rule returns every trainable parameter
  in it), whether or not it has parameters of its own;
- a module with trainable parameters of its own and no rule owns its whole subtree too, with the
  generic rule over every trainable parameter in it: its forward may use a child's parameters in any way (``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling
  ``out_proj``; a container may call ``self.fc`` *and* use ``self.fc.weight`` functionally), and one
  vjp through that forward counts every use exactly once.

Non-tensor keyword arguments reach the generic rule; tensor ones are refused (the hooks cannot tell
whether they are batched). What the hooks cannot see: the batch dimension is assumed at 0 (1 with
``batch_first=False``) in every layer's input and output, and a parameter used by a module without
parameters of its own that does not own it (``F.linear(x, self.fc.weight)`` in a plain container)
contributes nothing. The compiled engine (``fxdp.compile_for_dp``) checks both;
:func:`fxdp.check_per_sample_gradients_are_correct` catches them at run time.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils import _pytree as pytree

from fxdp.diagnostics import (
    Finding,
    Kind,
    LayerBatchError,
    PassReport,
    SampleMixingError,
    SampleMixingModuleError,
    SelfCheckError,
    Severity,
    UnsupportedInputError,
    UnsupportedOutputError,
    UnverifiedModelError,
)
from fxdp.engines import selfcheck
from fxdp.engines.base import (
    GradSampleModuleBase,
    has_trainable_params,
    mark_engine_hook,
    remove_dead_engine_hooks,
    remove_handles,
    trainable_own_params,
)
from fxdp.grad_sample.recurrent import recurrent_rule_applies
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.runtime.recurrent import recurrent_forward
from fxdp.runtime.structure import StructureWatch
from fxdp.sinks.contract import SINK_ATTR, GradientSink, GradSampleSink


def first_tensor_output(module_name: str, module: nn.Module, output: Any):
    """The output whose gradient the rules receive, and the other tensors the loss must not use."""
    if isinstance(output, torch.Tensor):
        return output, []
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise UnsupportedInputError(
            f"fxdp: module '{module_name}' ({type(module).__name__}) has trainable parameters but returned "
            f"{type(output).__name__}, which holds no tensor; the hooks engine needs a tensor output."
        )
    return leaves[0], leaves[1:]


class GradSampleModule(GradSampleModuleBase):
    """Wraps ``model`` so that ``loss.backward()`` also sets ``p.grad_sample`` (hooks engine).

    ``p.grad_sample[i]`` is the gradient sample ``i`` alone would give; uses of a parameter add up per
    sample over the forward calls and backward passes of one batch (tied weights, a module called twice,
    two views, two losses) until :meth:`zero_grad` (see :mod:`fxdp.sinks.contract`). Every call of the
    model, through this wrapper or not, is a forward call of its own.

    ``strict=True`` raises instead of using the generic rule for a module without a registered
    rule. :attr:`generic_fallbacks` lists the modules that use it. Whatever ``strict`` says, a model with a
    module that mixes samples in the mode it is in (BatchNorm in training) is refused when the wrapper is built,
    with :class:`~fxdp.errors.SampleMixingModuleError` (also a ``NotImplementedError``, as in Opacus), as by
    every engine (:func:`fxdp.engines.base.refuse_sample_mixing_modules`).

    The engine checks itself (see :mod:`fxdp.engines.selfcheck`): every hooked layer's inputs and
    output must carry the batch (N rows at the batch dimension; inputs with one row are broadcast, as
    the compiled graph does), and with ``verify`` (the default) the model is tested once, on its first
    batch of two samples or more, for cross-sample dependence and against batches of one; a batch of one
    before that is checked against its own gradient. A model that test could not verify (its output
    without one row per sample, as a batch of graphs whose layers see one row per node gives) is refused
    with :class:`~fxdp.errors.UnverifiedModelError`, strict or not, before any per-sample gradient exists;
    so is a batch whose size the inputs do not tell. :attr:`verification` says what was checked.
    ``verify=False`` switches the test off (:func:`fxdp.check_per_sample_gradients_are_correct`, which
    compares every sample itself, does).

    The hooks live and die with this wrapper: deleting it (or :meth:`remove_hooks`) removes them from
    the model, and a hook whose wrapper is gone does nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = False,
        *,
        sink: Optional[GradientSink] = None,
        verify: bool = True,
    ):
        super().__init__(model, batch_first=batch_first, loss_reduction=loss_reduction, sink=sink)
        self.strict = strict
        self.verify = verify
        self.verification = "not yet run" if verify else "off (verify=False)"
        self._batch_size: Optional[int] = None  # N of the forward in progress (None outside forward)
        self._bags: Optional[tuple] = None  # with a batch of bags: (the flat indices, the offsets) in forward
        self._refusal: Optional[SelfCheckError] = None  # what the self-check found: raised again at every forward
        self._forward_stack: List[tuple] = []  # (batch size, bags) of the forwards this one runs inside
        self._hook_handles: List[Any] = []
        # removes the hooks when this wrapper is garbage collected, without keeping it alive
        self._finalizer = weakref.finalize(self, remove_handles, self._hook_handles)
        self.grad_sample_layers: Dict[str, str] = {}  # module name -> how its per-sample grads are computed
        self.generic_fallbacks: List[str] = []  # the layers without a rule, under the generic rule
        self._add_hooks()

    # A copy (deepcopy, pickle) gets hooks of its own on its own copy of the model (where the copies
    # of this wrapper's hooks are dead).
    def __getstate__(self):
        state = self.__dict__.copy()
        for key in ("_hook_handles", "_finalizer", "_batch_size", "_bags", "_refusal", "_forward_stack"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._batch_size, self._bags, self._refusal, self._forward_stack = None, None, None, []
        if self.verification == "failed":  # the copy is tested again on its first batch
            self.verification = "not yet run"
        self._hook_handles = []
        self._finalizer = weakref.finalize(self, remove_handles, self._hook_handles)
        self.grad_sample_layers, self.generic_fallbacks = {}, []
        remove_dead_engine_hooks(self._module)
        self._add_hooks()

    def __deepcopy__(self, memo):
        import copy

        state = copy.deepcopy(self.__getstate__(), memo)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(state)
        return new

    # -- which modules get hooks ------------------------------------------------------------------

    def _add_hooks(self) -> None:
        seen = set()
        without_rule = []

        def visit(name: str, module: nn.Module) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            label = name or "<model>"
            if recurrent_rule_applies(module) and has_trainable_params(module):
                self._hook_recurrent(label, module)
                self.grad_sample_layers[label] = "recurrent rule"
                return
            if find_grad_sampler(module) is not None and has_trainable_params(module):
                self._hook(label, module)
                self.grad_sample_layers[label] = f"rule for {type(module).__name__}" + (
                    f": {rule_label}" if (rule_label := getattr(find_grad_sampler(module), "label", None)) else "")
                return  # the rule covers the whole subtree
            if trainable_own_params(module):
                self._hook(label, module)
                subtree = any(has_trainable_params(c) for c in module.children())
                self.grad_sample_layers[label] = "generic (its whole subtree)" if subtree else "generic"
                without_rule.append(f"'{label}' ({type(module).__name__})")
                self.generic_fallbacks.append(label)
                return  # the generic rule covers the whole subtree
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)

        visit("", self._module)
        # which layers are hooked depends on the model's layers and on which parameters are trainable now
        self._watch = StructureWatch()
        self._watch.add_subtree(self._module, "", "the wrapped model")
        for param_name, param in self._module.named_parameters():
            if not param.requires_grad:
                self._watch.add_frozen(param, param_name)
        # every call of the model, through this wrapper or not, is a forward call of its own (LayerCapture.call)
        self._hook_handles.append(self._module.register_forward_pre_hook(
            mark_engine_hook(_count_forward_call(weakref.ref(self)), self)))
        self._add_root_hooks()
        if self.strict and without_rule:
            self.remove_hooks()
            raise ValueError(
                "fxdp: strict=True and no per-sample rule is registered for "
                + ", ".join(without_rule)
                + ". Register one with @fxdp.register_grad_sampler(YourModule), or pass strict=False "
                "to use the generic rule."
            )

    def _hook(self, name: str, module: nn.Module) -> None:
        """A forward hook on ``module``, run before any forward hook of the user's: it sees the inputs
        ``forward`` received and the output it returned, which is what the rules (and the generic rule,
        re-running ``forward`` without the module's own hooks) differentiate; the user's hooks on the
        layer change what flows on, so they are accounted for by the output gradient."""
        owner = weakref.ref(self)  # the hooks must not keep the wrapper alive

        def forward_hook(mod, inputs, kwargs, output):
            wrapper = owner()
            if wrapper is None or wrapper._recomputing or not torch.is_grad_enabled():
                return
            wrapper._on_layer_output(name, mod, inputs, kwargs, output)

        self._hook_handles.append(module.register_forward_hook(
            mark_engine_hook(forward_hook, self), with_kwargs=True, prepend=True))

    def _hook_recurrent(self, name: str, module: nn.Module) -> None:
        """A stock LSTM / GRU / RNN: its output is computed again step by step with its own parameters (the
        same values; :mod:`fxdp.runtime.recurrent`) and replaces the stock one, so that backward hands the
        sink one Linear-like capture per projection, and the loss may use every output (the last state too).
        Where the batch is not where the layer keeps it, the layer gets the generic rule as before."""
        owner = weakref.ref(self)  # the hooks must not keep the wrapper alive

        def forward_hook(mod, inputs, kwargs, output):
            wrapper = owner()
            if wrapper is None or wrapper._recomputing or not torch.is_grad_enabled():
                return None
            if not any(p.requires_grad for p in mod.parameters()):
                return None
            call = dict(zip(("input", "hx"), inputs), **kwargs)
            x, n = call.get("input"), wrapper._batch_size
            if isinstance(x, PackedSequence):
                rows = int(x.batch_sizes[0])
            elif isinstance(x, torch.Tensor) and x.dim() == 3:
                rows = x.shape[0 if mod.batch_first else 1]
            else:
                rows = None
            if set(call) - {"input", "hx"} or not rows or (n is not None and rows != n):
                wrapper._on_layer_output(name, mod, inputs, kwargs, output)
                return None
            sink, forward_call = getattr(wrapper, SINK_ATTR), wrapper.forward_calls

            def deliver(capture):
                capture.call = forward_call
                sink.add(capture)

            return recurrent_forward(mod, x, call.get("hx"), deliver=deliver, loss_reduction=wrapper.loss_reduction,
                                     param_grads=not getattr(sink, "skips_param_grads", False))

        self._hook_handles.append(module.register_forward_hook(
            mark_engine_hook(forward_hook, self), with_kwargs=True, prepend=True))

    def _on_layer_output(self, name, mod, inputs, kwargs, output) -> None:
        if not any(p.requires_grad for p in mod.parameters()):
            return  # frozen after wrapping
        out, others = first_tensor_output(name, mod, output)
        if not out.requires_grad:
            return
        check_call = getattr(find_grad_sampler(mod), "check_call", None)
        if check_call is not None:  # what the layer's rule refuses in this call (a MoE block's router logits)
            check_call(name, mod)
        if kwargs and find_grad_sampler(mod) is None:
            tensor_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
            if tensor_kwargs:
                raise UnsupportedInputError(
                    f"fxdp: module '{name}' ({type(mod).__name__}) was called with tensor keyword "
                    f"argument(s) {', '.join(repr(k) for k in tensor_kwargs)}; the hooks engine's "
                    "generic rule only knows where the batch is in positional inputs. Pass them "
                    "positionally, register a rule for the module with fxdp.register_grad_sampler, "
                    "or use grad_sample_mode='fx'."
                )
        activations = [a.detach() if isinstance(a, torch.Tensor) else a for a in inputs]
        if isinstance(mod, nn.EmbeddingBag) and inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() == 1:
            self._check_bag_layer(name, mod, inputs, kwargs, out)
            activations += [v.detach() for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
            kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
            out.register_hook(self._output_hook(mod, activations, kwargs))
            return
        if self._batch_size is not None:
            activations = self._check_layer_batch(name, mod, activations, out)
        out.register_hook(self._output_hook(mod, activations, dict(kwargs)))
        for k, other in enumerate(others, start=1):
            if other.requires_grad:
                other.register_hook(self._unsupported_output_hook(name, mod, k))

    def _check_bag_layer(self, name: str, mod: nn.EmbeddingBag, inputs, kwargs, out: torch.Tensor) -> None:
        """An EmbeddingBag fed flat indices: its rule groups them into samples by the offsets, which must be
        the model's own (the batch of bags the engine counted), and its output must have a row per bag."""
        call = dict(zip(("input", "offsets", "per_sample_weights"), inputs), **kwargs)
        bags = self._bags
        if bags is None and self._batch_size is None:
            return  # outside a forward of this wrapper (the self-check's runs of single samples)
        if bags is None or call["input"] is not bags[0] or call.get("offsets") is not bags[1]:
            raise LayerBatchError(
                [selfcheck.finding(
                    name, type(mod).__name__, Kind.MOVES_BATCH,
                    "the layer takes flat indices grouped by offsets, which are not the model's first two inputs",
                    "pass the flat indices and their offsets as the model's first two positional inputs, and give "
                    "them to the layer as they are (the hooks engine then counts one sample per bag)")],
                f"fxdp (hooks engine): layer '{name}' (EmbeddingBag) takes flat indices, and the hooks engine "
                "cannot tell which entries belong to which sample, so its per-sample gradients would be wrong:")
        if out.dim() == 0 or out.shape[0] != self._batch_size:
            raise LayerBatchError(
                [selfcheck.finding(name, type(mod).__name__, Kind.MOVES_BATCH,
                                   f"the output has shape {tuple(out.shape)}, not one row per bag ({self._batch_size})",
                                   "give the layer the model's flat indices and offsets as they are")],
                f"fxdp (hooks engine): layer '{name}' (EmbeddingBag) does not return one row per sample:")

    def _check_layer_batch(self, name: str, mod: nn.Module, activations: List[Any], out: torch.Tensor):
        """Every tensor input and the output must have N rows at the batch dimension; an input with one
        row is broadcast to N (as the compiled graph does). Anything else is an error naming the layer."""
        n, dim = self._batch_size, self.batch_dim
        if any(isinstance(a, PackedSequence) for a in activations):
            return activations  # an RNN fed a PackedSequence: its rows are time steps, its rule unpacks them

        def refuse(what: str, shape) -> None:
            raise LayerBatchError(
                [selfcheck.finding(
                    name, type(mod).__name__, Kind.MOVES_BATCH,
                    f"{what} has shape {tuple(shape)}, but the batch of {n} samples is assumed in dimension {dim}",
                    "use grad_sample_mode='fx' on a model torch.fx can trace (it follows the batch through "
                    "reshapes and transposes), or keep the batch in dimension "
                    f"{dim} of every layer's input and output" + self._merged_tokens_hint(name, shape, n, dim))],
                f"fxdp (hooks engine): layer '{name}' ({type(mod).__name__}) does not see the batch where "
                "the hooks engine assumes it, so its per-sample gradients would be wrong:")

        checked = []
        for k, a in enumerate(activations):
            if isinstance(a, torch.Tensor):
                if a.dim() <= dim or a.shape[dim] not in (n, 1):
                    refuse(f"input #{k}", a.shape)
                if a.shape[dim] != n:
                    a = a.expand(*a.shape[:dim], n, *a.shape[dim + 1:])
            checked.append(a)
        if out.dim() <= dim or out.shape[dim] != n:
            refuse("the output", out.shape)
        return checked

    def _merged_tokens_hint(self, name: str, shape, n: int, dim: int) -> str:
        """A layer fed the batch's tokens flattened ((N*T, d)) inside a block, as a mixture-of-experts router and
        experts are: the block can be one layer, each sample re-run alone through it."""
        parent = name.rpartition(".")[0]
        if not parent or len(shape) <= dim or shape[dim] <= n or shape[dim] % n:
            return ""
        block = type(self._module.get_submodule(parent)).__name__
        return (f"; if '{parent}' ({block}) is a mixture-of-experts block that routes each token on its own (top-k, "
                f"no capacity limit, no auxiliary loss), declare it with fxdp.register_moe_block({block})")

    def remove_hooks(self) -> None:
        """Detach the engine from the model: later backward passes set no ``grad_sample``."""
        remove_handles(self._hook_handles)

    # -- forward: the batch size the layers are checked against, and the one-time self-check -------

    def forward(self, *args, **kwargs):
        try:
            self._enter_forward(args, kwargs)
            return self._module(*args, **kwargs)
        finally:
            self._leave_forward()

    def _add_root_hooks(self) -> None:
        """What the model's own call needs besides :meth:`forward` (nothing: the wrapper's forward does it)."""

    def _enter_forward(self, args, kwargs, watch: bool = True) -> None:
        """Before the model's forward: hook it again if it changed (``watch``), read the batch size the layers
        are checked against, and test the model (:meth:`_verify_before_forward`). :meth:`_leave_forward` undoes it."""
        self._forward_stack.append((self._batch_size, self._bags))
        why = self._watch.changed() if self._hook_handles and watch else None
        if why is not None:
            self._hook_again(why)
        bags = selfcheck.find_bags(self._module, args) if self.batch_dim == 0 else None
        n = bags.count(args) if bags is not None else selfcheck.batch_size_of(args, kwargs, self.batch_dim)
        if self.verify and self._hook_handles and torch.is_grad_enabled():
            self._verify_before_forward(args, kwargs, n, bags)
        self._batch_size = n
        self._bags = None if bags is None else (args[bags.ids], args[bags.offsets])

    def _leave_forward(self) -> None:
        if self._forward_stack:
            self._batch_size, self._bags = self._forward_stack.pop()

    def _hook_again(self, why: str) -> None:
        """The model changed since its layers were hooked (a layer or parameter replaced, a frozen parameter
        unfrozen): hook them again, and test the model again on this batch. Parameters the model no longer has
        are retired in the sink (a DP optimizer still holding one refuses to step)."""
        before = [p for _, _, p, _ in self._watch.entries if isinstance(p, nn.Parameter)]
        self.remove_hooks()
        self.grad_sample_layers, self.generic_fallbacks = {}, []
        self._add_hooks()
        getattr(self, SINK_ATTR).retire(before, self._module.parameters(), why)
        if self.verify and self.verification != "running":
            self.verification, self._refusal = "not yet run", None
        report = self.__dict__.get("fxdp_report")  # set by compile_for_dp / make_private
        if report is not None:
            self.fxdp_report = dataclasses.replace(report,
                                                   notes=(*report.notes, f"hooked again before a forward: {why}"))
        warnings.warn(f"fxdp (hooks engine): {why}: its layers were hooked again before this forward"
                      + (" and it is tested again on this batch" if self.verify else "")
                      + ". A DP optimizer trains a new parameter only if it holds it, and refuses to step while it "
                      "holds one the model no longer uses", stacklevel=5)

    def _verify_before_forward(self, args, kwargs, n: Optional[int], bags: Optional[selfcheck.Bags]) -> None:
        """Nothing trains on per-sample gradients that were not checked: the model is tested on its first batch
        of two samples or more (:meth:`_self_check`); until then every batch of one is checked against its own
        gradient (:meth:`_check_batch_of_one`); a model the test refused is refused at every later forward, and
        one it could not verify is tested again on the next batch. An empty batch computes nothing."""
        name = type(self._module).__name__
        if self._refusal is not None:
            raise type(self._refusal)(self._refusal.findings, f"fxdp (hooks engine): {name} was refused on an earlier "
                                      "batch, so it is refused again (wrap the model again once it is fixed):")
        if self.verification.startswith("unverified"):
            self.verification = "not yet run"  # the test is taken again on this batch
        if self.verification != "not yet run":
            return  # verified, or the test is running
        if n is None:
            self._refuse_unverified(
                name, selfcheck.Untested(
                    f"no input is a tensor with the batch in dimension {self.batch_dim}, so the hooks engine cannot "
                    "tell how many samples the batch holds, nor check any layer",
                    f"pass the batch as tensors with one row per sample in dimension {self.batch_dim}, "
                    "or make the model traceable by torch.fx (grad_sample_mode='fx')"), "this batch")
        elif n == 1:
            self._check_batch_of_one(args, kwargs, bags)
        elif n >= 2:
            self._self_check(args, kwargs, n, bags)

    def _refuse_unverified(self, name: str, untested: selfcheck.Untested, batch: str) -> None:
        self.verification = f"unverified: {untested.why}"
        raise UnverifiedModelError(
            [selfcheck.finding("<model>", name, Kind.UNVERIFIED, untested.why, untested.fix,
                               selfcheck.forward_location(self._module))],
            f"fxdp (hooks engine): could not verify {name} on {batch} ({untested.why}), so its per-sample gradients "
            "are not known to be right and it is not trained (strict or not):")

    def _refused(self, exc: SelfCheckError) -> SelfCheckError:
        self.verification, self._refusal = "failed", exc
        return exc

    def _self_check(self, args, kwargs, n: int, bags: Optional[selfcheck.Bags] = None) -> None:
        """Test the model once on this batch (see :mod:`fxdp.engines.selfcheck`); raise what it finds, or
        :class:`~fxdp.errors.UnverifiedModelError` when it cannot test it."""
        self.verification = "running"
        model = self._module
        name = type(model).__name__
        try:
            with selfcheck.preserved_state(model) as reset:
                def run(*a, **k):
                    reset()
                    return model(*a, **k)

                with self._recompute():
                    found, untested = selfcheck.cross_sample_dependence(run, args, kwargs, self.batch_dim, bags)
                if found is not None:
                    raise self._refused(SampleMixingError(
                        [selfcheck.finding("<model>", name, Kind.MIXES_SAMPLES, found,
                                           "make each sample's computation read only its own data (no statistics "
                                           "over the batch, no batch norm in training)",
                                           selfcheck.forward_location(model))],
                        f"fxdp (hooks engine): {name} mixes samples, so it cannot be trained with DP-SGD; "
                        f"found on its first batch of {n} samples:"))
                with self._recompute():
                    random = untested is None and selfcheck.is_random(run, args, kwargs)
                if untested is None and not random:  # a random model draws other numbers for a batch of one
                    try:
                        mismatch = self._compare_with_batches_of_one(run, args, kwargs, n, bags)
                    except UnsupportedOutputError as exc:  # raised again by the user's backward
                        mismatch, untested = None, selfcheck.Untested(
                            str(exc).split(", so")[0].replace("fxdp: ", ""),
                            "make the loss depend on each hooked layer's first output only, or use "
                            "grad_sample_mode='fx' or 'functorch'")
                    if mismatch is not None:
                        raise self._refused(self._wrong_gradients(name, mismatch, f"its first batch of {n} samples"))
        except SelfCheckError as exc:  # what the test found (a layer's batch too): refused at every later forward
            if self._refusal is None:
                self._refused(exc)
            raise
        except BaseException:  # the model's own error (or an interrupt): the test is taken again on the next batch
            self.verification = "not yet run"
            raise
        if untested is not None:
            self._refuse_unverified(name, untested, f"its first batch of {n} samples")
        self.verification = (f"verified on a batch of {n}: outputs independent across samples, " + (
            "per-sample gradients not compared (the model is random even with dropout layers off)" if random
            else "per-sample gradients equal to batches of one"))

    def _check_batch_of_one(self, args, kwargs, bags: Optional[selfcheck.Bags] = None) -> None:
        """A batch of one sample before the model was tested (Poisson sampling draws them): no sample to mix
        with, and the per-sample gradient of its only sample is the batch's own gradient, which the engine's
        one row must equal (a parameter used where no hook sees it fails here; a layer that sees more rows than
        samples fails the layer check). The test with two samples or more is still to come."""
        model, name = self._module, type(self._module).__name__
        self.verification = "running"
        try:
            mismatch = self._one_against_its_gradient(model, name, args, kwargs, bags)
        finally:
            if self.verification == "running":  # a batch of one says nothing about samples mixing
                self.verification = "not yet run"
        if mismatch is not None:
            raise self._refused(self._wrong_gradients(name, mismatch, "a batch of one sample"))

    def _one_against_its_gradient(self, model, name, args, kwargs, bags) -> Optional[str]:
        with selfcheck.preserved_state(model) as reset:
            def run(*a, **k):
                reset()
                return model(*a, **k)

            with self._recompute(), torch.no_grad():
                outputs = selfcheck.output_tensors(selfcheck.seeded(lambda: run(*args, **kwargs)), self.batch_dim)
            if not outputs:
                self._refuse_unverified(name, selfcheck.Untested(
                    "the model returned no floating-point tensor",
                    "return the model's per-sample outputs and compute the loss outside the model"), "a batch of one")
            try:
                return self._compare_with_batches_of_one(run, args, kwargs, 1, bags)
            except UnsupportedOutputError:
                return None  # raised again by the user's backward, before any per-sample gradient
            except SelfCheckError as exc:  # a layer that does not see the batch: refused at every later forward
                raise self._refused(exc)

    def _wrong_gradients(self, name: str, mismatch: str, batch: str) -> SelfCheckError:
        return SelfCheckError(
            [selfcheck.finding("<model>", name, Kind.MOVES_BATCH, mismatch, "use grad_sample_mode='fx' on a model "
                               "torch.fx can trace, or 'functorch'", selfcheck.forward_location(self._module))],
            f"fxdp (hooks engine): the per-sample gradients of {name} are wrong on {batch}:")

    def _compare_with_batches_of_one(self, run, args, kwargs, n: int, bags: Optional[selfcheck.Bags] = None,
                                     samples: int = 3):
        """This engine's per-sample gradients on the first few samples against each sample alone."""
        k = min(n, samples)
        dim = self.batch_dim
        sub_args, sub_kwargs = args, kwargs  # the whole batch, so the layers see the batch size they will
        named = [(nm, p) for nm, p in self._module.named_parameters() if p.requires_grad]
        saved = [(p, p.grad, getattr(p, "grad_sample", None)) for _, p in named]
        sink = getattr(self, SINK_ATTR)
        setattr(self, SINK_ATTR, GradSampleSink())
        generator = torch.Generator().manual_seed(0)
        try:
            for _, p in named:
                p.grad, p.grad_sample = None, None
            self._batch_size = n
            self._bags = None if bags is None else (args[bags.ids], args[bags.offsets])
            # the first output only: a loss over a layer's second output is refused by its own hook
            outs = selfcheck.output_tensors(selfcheck.seeded(lambda: run(*sub_args, **sub_kwargs)), dim)[:1]
            self._batch_size, self._bags = None, None
            projections = [torch.randn(t.shape, generator=generator).to(t) for t in outs]
            loss = sum((t * r).sum() for t, r in zip(outs, projections))
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                return None
            if self.loss_reduction == "mean":  # the engine undoes the mean's 1/n
                loss = loss / n
            loss.backward()
            counts = {nm: p.grad_sample.shape[0] for nm, p in named if getattr(p, "grad_sample", None) is not None}
            if any(c != n for c in counts.values()):
                nm, c = next((nm, c) for nm, c in counts.items() if c != n)
                return (f"parameter '{nm}' got {c} per-sample gradient rows for a batch of {n} sample(s): a layer sees "
                        "more (or fewer) rows than the batch has samples")
            rows = {nm: p.grad_sample[:k] for nm, p in named if getattr(p, "grad_sample", None) is not None}

            def loss_alone(i: int) -> torch.Tensor:
                if n == 1:  # the batch is the sample alone: its ordinary gradient is the definition
                    one = selfcheck.output_tensors(selfcheck.seeded(lambda: run(*sub_args, **sub_kwargs)), dim)[:1]
                    return sum((t * r).sum() for t, r in zip(one, projections))
                one_args, one_kwargs = (bags.sample(sub_args, sub_kwargs, i, dim) if bags is not None else
                                        selfcheck.sample_alone(sub_args, sub_kwargs, n, dim, i))
                one = selfcheck.output_tensors(selfcheck.seeded(lambda: run(*one_args, **one_kwargs)), dim)[:1]
                # sample i's rows of the projection where the output holds them; a padded sequence alone is as long
                # as its own (the batch's padding past it has no gradient)
                rows = [r.narrow(selfcheck.output_batch_dim(r, n, dim), i, 1) for r in projections]
                return sum((t * r[tuple(slice(0, s) for s in t.shape)]).sum() for t, r in zip(one, rows))

            with self._recompute():
                alone = selfcheck.batch_of_one_gradients(loss_alone, named, k)
            missing = [nm for nm, _ in named if nm not in rows and alone[nm] is not None]
            if missing:
                return (f"parameter(s) {missing[:5]} get gradients but no per-sample gradients: they are used "
                        "where no hook sees them")
            dtypes = {p.dtype for _, p in named} | {torch.get_autocast_dtype(d) for d in ("cpu", "cuda")
                                                     if torch.is_autocast_enabled(d)}
            return selfcheck.compare_gradients(rows, alone, selfcheck.gradient_rtol(dtypes))
        finally:
            self._batch_size, self._bags = None, None
            setattr(self, SINK_ATTR, sink)
            for p, grad, grad_sample in saved:
                p.grad, p.grad_sample = grad, grad_sample

    # -- backward hooks ---------------------------------------------------------------------------

    @staticmethod
    def _unsupported_output_hook(name: str, module: nn.Module, index: int):
        def hook(grad: torch.Tensor) -> None:
            raise UnsupportedOutputError(
                f"fxdp: the loss depends on output #{index} of module '{name}' ({type(module).__name__}), "
                "but per-sample rules only receive the gradient of its first output, so its "
                "per-sample gradients would be wrong. Use grad_sample_mode='fx' or 'functorch', or "
                "make the loss depend on the first output only."
            )

        return hook


def _count_forward_call(owner):
    def pre_hook(module, inputs):
        wrapper = owner()
        if wrapper is not None:
            wrapper.forward_calls += 1

    return pre_hook


def fallback_self_check(model: nn.Module, example_inputs, batch_dim: int, strict: bool, make=None) -> PassReport:
    """What the hooks fallback's self-check (its test on the first batch) finds on ``example_inputs``,
    run on a copy of the model: an error finding for what it refuses (the engine refuses it on the first batch
    too), a warning when the example inputs could not run the test. Under ``strict`` both are raised. ``make``: the
    engine's class (a hooks engine with blocks, :mod:`fxdp.engines.blocks`), GradSampleModule by default."""
    name, check = type(model).__name__, selfcheck.PASS_NAME

    def unverified(message: str, fix: str) -> PassReport:  # raised under strict, else reported
        finding = Finding(check, "<model>", name, Kind.UNVERIFIED, Severity.ERROR if strict else Severity.WARNING,
                          message, fix)
        if strict:
            raise UnverifiedModelError([finding], "strict=True: the hooks fallback cannot be verified:")
        return PassReport(check, findings=(finding,))

    if example_inputs is None:
        return unverified("the hooks fallback could not be verified: no example inputs to test the model on (the "
                          "engine tests it on its first batch, and refuses it if it cannot verify it)",
                          "give example inputs (fxdp inspect --input SHAPE)")
    args, kwargs = ((), dict(example_inputs)) if isinstance(example_inputs, dict) else (
        ((example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)), {})
    try:  # a module that mixes samples in its mode (BatchNorm in training) is refused here, before any batch
        engine = (make or GradSampleModule)(copy.deepcopy(model), batch_first=batch_dim == 0)
    except SampleMixingModuleError as exc:
        if strict:
            raise
        return PassReport(selfcheck.PASS_NAME, findings=tuple(
            dataclasses.replace(f, pass_name=selfcheck.PASS_NAME) for f in exc.findings))
    try:
        engine(*args, **kwargs)
    except SelfCheckError as exc:
        if strict:
            raise
        return PassReport(selfcheck.PASS_NAME, findings=exc.findings)
    finally:
        engine.remove_hooks()
    if engine.verification == "not yet run":  # a batch of one (checked against its own gradient), or empty
        return unverified("the hooks fallback could not be verified on the example inputs: they hold fewer than two "
                          "samples (the engine tests the model on its first batch of two or more)",
                          "give example inputs with two samples or more")
    return PassReport(check, changes=(Finding(check, "<model>", name, Kind.NOTE, Severity.INFO, engine.verification),))


class GradSampleHooks(GradSampleModule):
    """The hooks engine used without its wrapper: construct it on a model and call the model itself (its
    layers carry the hooks; ``state_dict`` keeps the model's own keys). Keep this object alive while you
    train: the hooks live and die with it. :meth:`cleanup` removes them and every ``p.grad_sample``.
    Hooks on the model itself do what the wrapper's forward does: the layers are checked against the
    batch size of each call, and the model is tested (and refused when it cannot be verified) as by
    :class:`GradSampleModule`."""

    def _add_root_hooks(self) -> None:
        owner = weakref.ref(self)

        def before(module, args, kwargs):
            wrapper = owner()
            if wrapper is None:
                return
            if wrapper._recomputing or wrapper.verification == "running":  # the engine's own runs of the model
                wrapper._forward_stack.append((wrapper._batch_size, wrapper._bags))
                return
            wrapper._enter_forward(args, kwargs, watch=False)  # FSDP2 swaps the parameters it gathers

        def after(module, args, output):
            wrapper = owner()
            if wrapper is not None:
                wrapper._leave_forward()

        self._hook_handles.append(self._module.register_forward_pre_hook(
            mark_engine_hook(before, self), with_kwargs=True))
        self._hook_handles.append(self._module.register_forward_hook(mark_engine_hook(after, self), always_call=True))

    def cleanup(self) -> None:
        self.remove_hooks()
        for p in self._module.parameters():
            if hasattr(p, "grad_sample"):
                del p.grad_sample
