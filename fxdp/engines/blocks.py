"""The hooks engine with *blocks*: submodules no front end captures (data-dependent control flow, ``.item()``, a
Python loop over the samples, windows of all samples stacked as rows) each run as ONE op, the generic rule over
every trainable parameter in the block, each sample re-run alone (``vmap`` of a ``vjp``, a loop where ``vmap``
cannot follow the control flow). The rest of the model keeps the hooks engine's per-layer rules.

Which untraceable submodules are blocks: those given as ``blocks``, and any of the ``candidates`` whose layers the
per-layer rules cannot serve, found when the engine tests the model (its first batch of two samples or more, or a
batch of one before that): a :class:`~fxdp.errors.LayerBatchError` naming a layer inside a candidate makes that
candidate a block, and the test is taken again. A candidate whose layers see the batch keeps the per-layer rules
(a mixture-of-experts block keeps its rule), and what it computes is checked at every forward as a block's is.

What the per-layer rules cannot see inside a block (its layers may see rows that are not samples) does not
matter to the block's rule, which only needs the block's input and output to carry the batch; that is checked
at every forward (:meth:`~fxdp.engines.hooks.GradSampleModule._check_layer_batch`). What the generic rule
assumes, that the block computes each sample's output from that sample alone, can stop holding on any batch
(a branch taken on the batch's sum, a loop count read from the batch's largest value): so at every forward, the
block is run again on each sample alone (no gradient) and its output compared with that sample's rows of the
batch's (blocks and candidates both; on the first batch before the model-wide test, so that the part is named); a
difference is a :class:`~fxdp.errors.SampleMixingError` naming the part and its ``forward``, raised before any
per-sample gradient of that batch exists (and again at every later forward). The cost: one extra forward of each
untraceable submodule per sample.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxdp.diagnostics import Kind, LayerBatchError, SampleMixingError, SelfCheckError
from fxdp.diagnostics.errors import PerSampleError
from fxdp.engines import selfcheck
from fxdp.engines.base import mark_engine_hook, without_own_hooks
from fxdp.engines.hooks import GradSampleModule


class BlockGradSampleModule(GradSampleModule):
    """:class:`~fxdp.engines.hooks.GradSampleModule` where the modules named in ``blocks`` (paths in the model)
    are layers under the generic rule, each checked against its samples alone at every forward (see the module
    docstring). :attr:`blocks` lists them; :attr:`grad_sample_layers` says ``"block: ..."`` for each."""

    def __init__(self, model: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                 strict: bool = False, *, blocks: Sequence[str] = (), candidates: Sequence[str] = (), **kwargs):
        object.__setattr__(self, "blocks", tuple(blocks))  # read by _add_hooks, which nn.Module.__init__ precedes
        object.__setattr__(self, "candidates", tuple(c for c in candidates if c not in blocks))
        object.__setattr__(self, "_checking_blocks", False)
        super().__init__(model, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict, **kwargs)

    def __setstate__(self, state):
        state.setdefault("_checking_blocks", False)
        super().__setstate__(state)

    def _add_hooks(self) -> None:
        super()._add_hooks()
        for path in self.blocks:
            block = self._module.get_submodule(path)
            inner = {id(m) for m in block.modules()}
            # the per-layer hooks inside the block go: the block's rule covers its whole subtree
            for handle in list(self._hook_handles):
                hooks = handle.hooks_dict_ref()
                owner = next((m for m in block.modules() if m._forward_hooks is hooks), None)
                if owner is not None and id(owner) in inner:
                    handle.remove()
                    self._hook_handles.remove(handle)
            prefix = path + "."
            self.grad_sample_layers = {k: v for k, v in self.grad_sample_layers.items()
                                       if k != path and not k.startswith(prefix)}
            self.generic_fallbacks = [k for k in self.generic_fallbacks if k != path and not k.startswith(prefix)]
            if any(p.requires_grad for p in block.parameters()):
                self._hook_block(path, block)
                self.grad_sample_layers[path] = "block: generic (its whole subtree), checked against each sample alone"
        parts = (*self.blocks, *self.candidates)
        for path in self.candidates:  # per-layer rules inside, but what it computes is checked as a block's is
            if not any(path.startswith(outer + ".") for outer in parts):  # one inside another: the outer's check
                self._hook_block(path, self._module.get_submodule(path), check_only=True)  # covers it

    def _hook_block(self, name: str, block: nn.Module, check_only: bool = False) -> None:
        owner = weakref.ref(self)

        def forward_hook(mod, inputs, kwargs, output):
            wrapper = owner()
            if wrapper is None or wrapper._recomputing:
                return
            if wrapper._checking_blocks:
                return  # _check_blocks_alone's own hook checks it
            if not torch.is_grad_enabled():
                return
            if not check_only:
                wrapper._on_layer_output(name, mod, inputs, kwargs, output)  # the batch checks, the generic rule
            wrapper._check_block(name, mod, inputs, kwargs, output)

        self._hook_handles.append(block.register_forward_hook(
            mark_engine_hook(forward_hook, self), with_kwargs=True, prepend=True))

    def _check_block(self, name: str, block: nn.Module, inputs, kwargs, output) -> None:
        """Each sample alone through the block gives the block's output rows for that sample (every tensor output
        with the batch's rows), or the block mixes samples (see the module docstring)."""
        n = self._batch_size
        if n is None or n < 2 or not any(p.requires_grad for p in block.parameters()):
            return  # a batch of one is its own sample alone
        is_block = name in self.blocks
        dropouts = [f"'{name}.{k}'" if k else f"'{name}'" for k, m in block.named_modules()
                    if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
        if dropouts and not is_block:
            return  # random: no comparison can be made; its layers' rules handle dropout (the first batch is tested)
        if dropouts:
            raise self._random_error(name, block, f"its dropout layer(s) {', '.join(dropouts)} draw")
        dim = self.batch_dim
        outs = _batched_leaves(output, n, dim)
        rtol = 1e-9 if outs and outs[0][1].dtype == torch.float64 else selfcheck.gradient_rtol(
            [t.dtype for _, t in outs]) * 1e-1
        with torch.no_grad(), self._recompute(), without_own_hooks(block):
            for i in range(n):
                args, kw = selfcheck.sample_alone(tuple(inputs), dict(kwargs), n, dim, i)
                alone = _tensors(block(*args, **kw))
                for k, out in outs:
                    found = _difference(alone[k] if k < len(alone) else None, out.detach().narrow(dim, i, 1), rtol)
                    if found is None:
                        continue
                    if _is_random(block, args, kw):  # functional dropout: no comparison can be made
                        if not is_block:
                            return
                        raise self._random_error(name, block, "it draws random numbers (functional dropout?), which")
                    raise self._refused(self._mixing_error(name, block, i, n, found))

    @staticmethod
    def _random_error(name: str, block: nn.Module, what: str) -> PerSampleError:
        return PerSampleError(
            f"fxdp (hooks engine): block '{name}' ({type(block).__name__}), which no front end captures, runs as "
            f"one op with each sample re-run alone, but {what} new numbers when a sample is re-run, so its "
            "per-sample gradients would not be this step's; set their p to 0 (or put them in eval mode), or make "
            "the block traceable by torch.fx")

    def _mixing_error(self, name: str, block: nn.Module, i: int, n: int, found: str) -> SampleMixingError:
        kind = type(block).__name__
        return SampleMixingError(
            [selfcheck.finding(
                name, kind, Kind.MIXES_SAMPLES,
                f"sample {i} alone through the part gives {found} than its rows of the batch's output ({n} "
                "samples): what the part computes for a sample depends on the other samples (control flow on a "
                "value of the whole batch: its sum, its largest value, its longest sequence)",
                "read each sample's own values for the part's control flow (loop over the samples, or compute the "
                "condition per row and select with torch.where), or make the part traceable by torch.fx",
                selfcheck.forward_location(block))],
            f"fxdp (hooks engine): untraceable part '{name}' ({kind}), which no front end captures, mixes samples: on "
            f"a batch of {n} samples its output differs from each sample's alone, so per-sample gradients would be "
            "wrong; it is refused (on this batch and every later one):")

    def _self_check(self, args, kwargs, n: int, bags=None) -> None:
        """The blocks are checked first, so that a block that mixes samples is named (the model-wide test would
        only name the model); a candidate whose layers do not see the batch becomes a block (module docstring)."""
        while True:
            try:
                self._check_blocks_alone(args, kwargs, n, (*self.blocks, *self.candidates))
            except SelfCheckError as exc:
                if self._refusal is None:
                    self._refused(exc)
                raise
            try:
                return super()._self_check(args, kwargs, n, bags)
            except LayerBatchError as exc:
                if not self._make_block(exc):
                    raise

    def _check_batch_of_one(self, args, kwargs, bags=None) -> None:
        while True:
            try:
                return super()._check_batch_of_one(args, kwargs, bags)
            except LayerBatchError as exc:
                if not self._make_block(exc):
                    raise

    def _make_block(self, exc: LayerBatchError) -> bool:
        """The candidate holding the layer ``exc`` names becomes a block (hooked again); False when none does."""
        layers = [f.node for f in exc.findings]
        found = next((c for c in self.candidates if any(node.startswith(c + ".") for node in layers)), None)
        if found is None:
            return False
        object.__setattr__(self, "blocks", (*self.blocks, found))
        object.__setattr__(self, "candidates", tuple(c for c in self.candidates if c != found))
        self.remove_hooks()
        self.grad_sample_layers, self.generic_fallbacks = {}, []
        self._add_hooks()
        self._refusal, self.verification = None, "running"
        report = self.__dict__.get("fxdp_report")  # set by compile_for_dp / make_private
        if report is not None:
            self.fxdp_report = dataclasses.replace(report, notes=(*report.notes, (
                f"block chosen on the first batch: '{found}' runs as one op (layer {layers[0]!r} does not see the "
                "batch where the per-layer rules need it)")))
        return True

    def _check_blocks_alone(self, args, kwargs, n: int, paths: Sequence[str]) -> None:
        """A forward without gradient in which each module of ``paths`` is run again on each sample alone."""
        if not paths:
            return
        handles = [self._module.get_submodule(path).register_forward_hook(
            functools.partial(self._check_hook, path), with_kwargs=True) for path in paths]
        previous = self._batch_size
        self._batch_size, self._checking_blocks = n, True
        try:
            with selfcheck.preserved_state(self._module), torch.no_grad():
                self._module(*args, **kwargs)
        finally:
            self._batch_size, self._checking_blocks = previous, False
            for handle in handles:
                handle.remove()

    def _check_hook(self, path, mod, inputs, kwargs, output):
        if self._checking_blocks and not self._recomputing:
            self._check_block(path, mod, inputs, kwargs, output)


def _tensors(value) -> list:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_random(block: nn.Module, args, kwargs) -> bool:
    """Two runs of the block on the same sample under two seeds differ."""
    first = _tensors(selfcheck.seeded(lambda: block(*args, **kwargs), 1))
    second = _tensors(selfcheck.seeded(lambda: block(*args, **kwargs), 2))
    return any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(first, second))


def _batched_leaves(output, n: int, dim: int):
    """(position among the output's tensors, tensor) of each floating-point output with the batch's ``n`` rows."""
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return [(k, t) for k, t in enumerate(leaves) if t.is_floating_point() and t.dim() > dim and t.shape[dim] == n]


def _difference(alone: Optional[torch.Tensor], rows: torch.Tensor, rtol: float) -> Optional[str]:
    if alone is None or alone.shape != rows.shape:
        return f"an output of shape {None if alone is None else tuple(alone.shape)}, other"
    if not torch.allclose(alone.to(rows.dtype), rows, rtol=rtol, atol=rtol * max(1.0, float(rows.abs().max()))):
        err = float((alone.to(rows.dtype) - rows).abs().max())
        return f"outputs up to {err:.3g} other"
    return None
