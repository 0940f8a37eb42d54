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

from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxdp.engines.base import GradSampleModuleBase, has_trainable_params, trainable_own_params
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.grad_sample.sink import GradientSink


def first_tensor_output(module_name: str, module: nn.Module, output: Any):
    """The output whose gradient the rules receive, and the other tensors the loss must not use."""
    if isinstance(output, torch.Tensor):
        return output, []
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise TypeError(
            f"fxdp: module '{module_name}' ({type(module).__name__}) has trainable parameters but returned "
            f"{type(output).__name__}, which holds no tensor; the hooks engine needs a tensor output."
        )
    return leaves[0], leaves[1:]


class GradSampleModule(GradSampleModuleBase):
    """Wraps ``model`` so that ``loss.backward()`` also sets ``p.grad_sample`` (hooks engine).

    ``p.grad_sample[i]`` is the gradient sample ``i`` alone would give; uses of a parameter within
    one backward pass add up (tied weights, a module called twice); successive backward passes append
    along dim 0 until :meth:`zero_grad` (see :mod:`fxdp.grad_sample.accumulate`).

    ``strict=True`` raises instead of using the generic rule for a module without a registered
    rule. :attr:`generic_fallbacks` lists the modules that use it.
    """

    def __init__(
        self,
        model: nn.Module,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = False,
        *,
        sink: Optional[GradientSink] = None,
    ):
        super().__init__(model, batch_first=batch_first, loss_reduction=loss_reduction, sink=sink)
        self.strict = strict
        self._hook_handles: List[Any] = []
        self.grad_sample_layers: Dict[str, str] = {}  # module name -> how its per-sample grads are computed
        self.generic_fallbacks: List[str] = []  # the layers without a rule, under the generic rule
        self._add_hooks()

    # -- which modules get hooks ------------------------------------------------------------------

    def _add_hooks(self) -> None:
        seen = set()
        without_rule = []

        def visit(name: str, module: nn.Module) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            label = name or "<model>"
            if find_grad_sampler(module) is not None and has_trainable_params(module):
                self._hook(label, module)
                self.grad_sample_layers[label] = f"rule for {type(module).__name__}"
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
        if self.strict and without_rule:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles.clear()
            raise ValueError(
                "fxdp: strict=True and no per-sample rule is registered for "
                + ", ".join(without_rule)
                + ". Register one with @fxdp.register_grad_sampler(YourModule), or pass strict=False "
                "to use the generic rule."
            )

    def _hook(self, name: str, module: nn.Module) -> None:
        """Forward hook on ``module``: keeps its inputs and hooks its output for the backward step."""

        def forward_hook(mod, inputs, kwargs, output):
            if self._recomputing or not torch.is_grad_enabled():
                return
            if not any(p.requires_grad for p in mod.parameters()):
                return  # frozen after wrapping
            out, others = first_tensor_output(name, mod, output)
            if not out.requires_grad:
                return
            if kwargs and find_grad_sampler(mod) is None:
                tensor_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
                if tensor_kwargs:
                    raise TypeError(
                        f"fxdp: module '{name}' ({type(mod).__name__}) was called with tensor keyword "
                        f"argument(s) {', '.join(repr(k) for k in tensor_kwargs)}; the hooks engine's "
                        "generic rule only knows where the batch is in positional inputs. Pass them "
                        "positionally, register a rule for the module with fxdp.register_grad_sampler, "
                        "or use grad_sample_mode='fx'."
                    )
            activations = [a.detach() if isinstance(a, torch.Tensor) else a for a in inputs]
            out.register_hook(self._output_hook(mod, activations, dict(kwargs)))
            for k, other in enumerate(others, start=1):
                if other.requires_grad:
                    other.register_hook(self._unsupported_output_hook(name, mod, k))

        self._hook_handles.append(module.register_forward_hook(forward_hook, with_kwargs=True))

    def remove_hooks(self) -> None:
        """Detach the engine from the model: later backward passes set no ``grad_sample``."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    # -- backward hooks ---------------------------------------------------------------------------

    @staticmethod
    def _unsupported_output_hook(name: str, module: nn.Module, index: int):
        def hook(grad: torch.Tensor) -> None:
            raise RuntimeError(
                f"fxdp: the loss depends on output #{index} of module '{name}' ({type(module).__name__}), "
                "but per-sample rules only receive the gradient of its first output, so its "
                "per-sample gradients would be wrong. Use grad_sample_mode='fx' or 'functorch', or "
                "make the loss depend on the first output only."
            )

        return hook
