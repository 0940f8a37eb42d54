"""Book-keeping clipping: per-sample gradient norms and clipped sums from each layer's input ``A`` and
output gradient ``G``, without a per-sample gradient per parameter where a cheaper form exists
(Bu et al., "Differentially Private Optimization on Large Model at Small Cost", 2023).

During backward every DP-aware op hands the sink a :class:`~fxdp.grad_sample.sink.LayerCapture`. The sink
keeps ``A`` and ``G`` (not per-sample gradients) and, when the backward pass ends, computes each
parameter's per-sample squared norms. After backward the optimizer asks for the norms and, with one clip
factor ``c_i`` per sample, for each parameter's clipped sum ``sum_i c_i g_i``: that is the layer's ordinary
weight-gradient product with ``G`` scaled by ``c_i`` row by row, so no ``(N, *p.shape)`` tensor is needed.

How each layer's norms are computed is chosen from static shapes (:func:`plan_layer`; the sink keeps the
plan of every layer it saw in :attr:`BookkeepingSink.plans` so a report can say which and why):

=============  ====================================================================================
``outer``      Linear on ``(N, d)``: ``||g_i||^2 = ||a_i||^2 ||g_i||^2`` (weight), ``||g_i||^2`` (bias).
``ghost``      Linear on ``(N, T, d)``, Conv through its unfolded ``(N, L, C*k)`` form:
               ``<A_i A_i^T, G_i G_i^T>``, cost ``~ T^2 (d + p)`` per sample.
``per_sample`` the same layers when materialising the weight's per-sample gradient (``~ T d p``) is
               cheaper; it is formed for the norm only and dropped at once.
``index``      Embedding: rows of equal index summed per sample, ``sum_v ||sum_{t: idx_t = v} g_t||^2``
               (the index-equality form of ``sum_{t,s} [idx_t = idx_s] <g_t, g_s>``), no ``(V, D)`` tensor.
``materialise`` norm layers, the generic rule, anything else: ``capture.grad_samples()`` (their parameters
               are small); norms and clipped sums read from the per-sample tensor.
=============  ====================================================================================

A parameter that receives several captures in one backward pass (tied weights, a layer called twice)
gets the norm of the *sum* of its contributions, ``||sum_k g_i^(k)||``: from cross terms
``sum_{k,l} <A^k_i A^l_i^T, G^k_i G^l_i^T>`` when all its uses are Linear, from the concatenated
indices when all are Embedding, else by materialising that parameter alone. Its clipped sum is the sum of
each use's re-weighted product. Successive backward passes before a step append rows in call order, as
``p.grad_sample`` does.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import nn

from fxdp import meta
from fxdp.grad_sample.conv import _pad_activations, conv_grad_sample
from fxdp.grad_sample.embedding import embedding_grad_sample
from fxdp.grad_sample.linear import linear_grad_sample
from fxdp.grad_sample.registry import find_grad_sampler
from fxdp.grad_sample.sink import GradientSink, LayerCapture, check_grad_sample
from fxdp.layout import parse_layout

METHODS = ("outer", "ghost", "per_sample", "index", "materialise")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


# -- the static choice ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's per-sample norms are computed, and why (costs are multiply-adds per sample)."""

    layer: str  # "Linear", "Conv2d", "Embedding", "LayerNorm", "generic", ...
    method: str  # one of METHODS
    reason: str
    ghost_cost: Optional[int] = None
    per_sample_cost: Optional[int] = None


def _own_rule(module: nn.Module, bases, rule) -> bool:
    """The built-in rule applies: the module is one of ``bases`` and keeps its forward, and nobody
    registered another rule for its type (then the book-keeping formulas may not describe it)."""
    bases = bases if isinstance(bases, tuple) else (bases,)
    return (
        isinstance(module, bases)
        and any(type(module).forward is b.forward for b in bases)
        and find_grad_sampler(module) is rule
    )


def _pick(layer: str, ghost: int, per_sample: int, prefer: Optional[str], what: str) -> LayerPlan:
    if prefer in ("ghost", "per_sample"):
        method, reason = prefer, f"{prefer} forced by the sink's method argument"
    elif ghost <= per_sample:
        method, reason = "ghost", f"{what}: ghost norm {ghost:,} <= per-sample gradient {per_sample:,} mult-adds/sample"
    else:
        method, reason = "per_sample", f"{what}: per-sample gradient {per_sample:,} < ghost norm {ghost:,} mult-adds/sample"
    return LayerPlan(layer, method, reason, ghost, per_sample)


def plan_layer(
    module: Optional[nn.Module],
    activation_shapes: Sequence[Sequence[int]],
    backprop_shape: Optional[Sequence[int]],
    prefer: Optional[str] = None,
) -> LayerPlan:
    """The norm method for ``module`` seeing batch-first inputs and output gradient of these shapes.

    Only shapes are read, so the compiler can call it with the shapes its batch_dim pass found.
    ``prefer`` ("ghost" / "per_sample") overrides the cost comparison for Linear and Conv layers.
    """
    if module is None:
        return LayerPlan("generic", "materialise", "functional use of parameters: the generic rule materialises")
    name = type(module).__name__
    if backprop_shape is None or not activation_shapes:
        return LayerPlan(name, "materialise", "no (A, G) pair delivered: the layer's rule materialises")
    a, g = list(activation_shapes[0]), list(backprop_shape)
    if _own_rule(module, nn.Linear, linear_grad_sample):
        if len(a) < 2 or a[:-1] != g[:-1] or a[-1] != module.in_features or g[-1] != module.out_features:
            return LayerPlan(name, "materialise", f"input {tuple(a)} / output gradient {tuple(g)} not (N, *, d) -> (N, *, p)")
        t = math.prod(a[1:-1])
        if t == 1:
            return LayerPlan(name, "outer", "input (N, d): ||a_i|| * ||g_i||")
        d, p = a[-1], g[-1]
        return _pick(name, t * t * (d + p), t * d * p, prefer, f"sequence T={t}, d={d}, p={p}")
    if _own_rule(module, _CONVS, conv_grad_sample):
        nd = len(module.kernel_size)
        if len(a) != nd + 2 or len(g) != nd + 2 or a[0] != g[0]:
            return LayerPlan(name, "materialise", f"input {tuple(a)} is not batched (N, C, *spatial)")
        length, k = math.prod(g[2:]), math.prod(module.kernel_size)
        groups = module.groups
        cin_g, cout_g = module.in_channels // groups, module.out_channels // groups
        ghost = length * cin_g * groups * k + groups * length * length * (cin_g * k + cout_g)  # unfold + grams
        per_sample = length * groups * cin_g * k * cout_g
        return _pick(name, ghost, per_sample, prefer, f"L={length}, C_in*k={cin_g * k}, C_out={cout_g}, groups={groups}")
    if _own_rule(module, nn.Embedding, embedding_grad_sample):
        if module.max_norm is not None:
            return LayerPlan(name, "materialise", "max_norm is set: the per-sample rule decides")
        if module.scale_grad_by_freq:
            return LayerPlan(name, "materialise", "scale_grad_by_freq: per-sample frequencies")
        if a + [module.embedding_dim] != g:
            return LayerPlan(name, "materialise", f"output gradient {tuple(g)} is not indices {tuple(a)} + (D,)")
        return LayerPlan(name, "index", "rows of equal index summed per sample (no dense per-sample gradient)")
    return LayerPlan(name, "materialise", "no book-keeping form: per-sample gradients from its rule (norm layers "
                                          "and the generic rule; their parameters are small)")


def plan_graph(gm: torch.fx.GraphModule, prefer: Optional[str] = None) -> List[Tuple[str, LayerPlan]]:
    """``(layer name, plan)`` for every layer call the per_sample pass made a DP-aware op, from the shapes
    the batch_dim pass recorded (compiled with example_inputs; ``[]`` without them). A layer called twice
    is listed twice."""
    source = getattr(gm, "fxdp_batch", None)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    if source is None or source.input_index >= len(placeholders):
        return []
    batch = placeholders[source.input_index].meta.get(meta.FAKE_VALUE)
    if not isinstance(batch, torch.Tensor):
        return []
    n = batch.shape[source.dim]
    plans = []
    for node in gm.graph.nodes:
        if meta.PER_SAMPLE_RULE not in node.meta or len(node.args) < 3 or node.args[0].op != "get_attr":
            continue  # functional uses of parameters: the generic rule, which always materialises
        module = gm.get_submodule(node.args[0].target)
        site = getattr(gm, node.args[1].target)
        fakes = [a.meta.get(meta.FAKE_VALUE) if isinstance(a, torch.fx.Node) else None for a in node.args[3:]]
        out = node.meta.get(meta.FAKE_VALUE)
        try:
            ins = [site.in_layout(i).to_batch_first(torch.empty(t.shape, device="meta"), n).shape
                   for i, t in enumerate(t for t in fakes if isinstance(t, torch.Tensor))]
            g = parse_layout(site.out_layouts[0]).to_batch_first(torch.empty(out.shape, device="meta"), n).shape
        except Exception:  # shapes not recorded: the sink decides on the first batch (BookkeepingSink.plans)
            continue
        plans.append((node.args[0].target, plan_layer(module, ins, g, prefer)))
    return plans


def describe_plans(plans: Iterable[Tuple[str, LayerPlan]]) -> List[str]:
    """One line per layer for a report: ``"book-keeping: 'fc1' (Linear): outer (input (N, d): ...)"``."""
    return [f"book-keeping: '{name}' ({plan.layer}): {plan.method} ({plan.reason})" for name, plan in plans]


# -- one use of one parameter in one backward pass ------------------------------------------------------


class _Use:
    """What one capture contributed to one parameter: enough for its norm, its clipped sum and, if asked,
    its per-sample gradient."""

    batch_size: int

    def squared_norms(self) -> torch.Tensor:  # (N,), this use alone
        return self.grad_samples().flatten(1).pow(2).sum(1)

    def clipped_sum(self, c: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def grad_samples(self) -> torch.Tensor:  # (N, *p.shape)
        raise NotImplementedError


class _Materialised(_Use):
    def __init__(self, grad_samples: torch.Tensor):
        self.gs = grad_samples
        self.batch_size = grad_samples.shape[0]

    def grad_samples(self):
        return self.gs

    def clipped_sum(self, c):
        return torch.tensordot(c.to(self.gs.dtype), self.gs, dims=1)


class _LinearWeight(_Use):
    """Weight of a Linear layer: per-sample gradient ``G_i^T A_i`` with A (N, T, d), G (N, T, p)."""

    def __init__(self, a: torch.Tensor, g: torch.Tensor, method: str):
        n = g.shape[0]
        self.a = a.reshape(n, -1, a.shape[-1]).to(g.dtype)
        self.g = g.reshape(n, -1, g.shape[-1])
        self.method = method
        self.batch_size = n

    def squared_norms(self):
        if self.method == "outer":
            return self.a.pow(2).sum((1, 2)) * self.g.pow(2).sum((1, 2))
        if self.method == "ghost":
            return _gram_dot(self.a, self.a, self.g, self.g)
        return self.grad_samples().pow(2).sum((1, 2))

    def grad_samples(self):
        return torch.bmm(self.g.transpose(1, 2), self.a)

    def clipped_sum(self, c):
        g = self.g * c.to(self.g.dtype).view(-1, 1, 1)
        return g.flatten(0, 1).t().mm(self.a.flatten(0, 1))


def _gram_dot(a_k, a_l, g_k, g_l) -> torch.Tensor:
    """``<A^k_i A^l_i^T, G^k_i G^l_i^T>`` for every sample i: the inner product of the two uses' per-sample
    gradients ``G^k_i^T A^k_i`` and ``G^l_i^T A^l_i`` without forming either."""
    return (torch.bmm(a_k, a_l.transpose(1, 2)) * torch.bmm(g_k, g_l.transpose(1, 2))).sum((1, 2))


class _Summed(_Use):
    """A bias: its per-sample gradient is G summed over every non-batch, non-channel position."""

    def __init__(self, per_sample: torch.Tensor):
        self.gs = per_sample  # (N, p), already materialised: as small as the bias
        self.batch_size = per_sample.shape[0]

    def grad_samples(self):
        return self.gs

    def clipped_sum(self, c):
        return c.to(self.gs.dtype) @ self.gs


class _ConvWeight(_Use):
    """Weight of a Conv layer, from its input A (N, C_in, *S) and output gradient G (N, C_out, *L)."""

    def __init__(self, module: nn.Module, a: torch.Tensor, g: torch.Tensor, method: str):
        self.module, self.a, self.g, self.method = module, a.to(g.dtype), g, method
        self.batch_size = g.shape[0]

    def grad_samples(self):
        return conv_grad_sample(self.module, [self.a], self.g)[self.module.weight]

    def squared_norms(self):
        if self.method != "ghost":
            return super().squared_norms()
        n, groups = self.batch_size, self.module.groups
        u = _patches(self.module, self.a)  # (N * groups, L, k * C_in / groups)
        g = self.g.reshape(n * groups, -1, u.shape[1]).transpose(1, 2)  # (N * groups, L, C_out / groups)
        return _gram_dot(u, u, g, g).view(n, groups).sum(1)

    def clipped_sum(self, c):
        m = self.module
        x, padding = _pad_activations(m, self.a)
        g = self.g * c.to(self.g.dtype).view(-1, *[1] * (self.g.dim() - 1))
        _, weight_grad, _ = torch.ops.aten.convolution_backward(
            g, x, m.weight.detach(), None, list(m.stride), list(padding), list(m.dilation),
            False, [0] * len(padding), m.groups, [False, True, False],
        )
        return weight_grad


def _patches(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The convolution's input patches per sample and group, ``(N * groups, L, prod(k) * C_in / groups)``,
    for any number of spatial dims, stride, padding and dilation. Channels are innermost (one copy of a
    channels-last view: faster than unfolding channels-first); the columns are then not in the weight's
    order, which the Gram matrix ``U U^T`` does not see."""
    x, padding = _pad_activations(module, x)
    if any(padding):
        x = torch.nn.functional.pad(x, [p for p in reversed(padding) for _ in (0, 1)])
    x = x.movedim(1, -1).contiguous()  # (N, *S, C)
    n, spatial, c, groups = x.shape[0], x.shape[1:-1], x.shape[-1], module.groups
    out = [(size - d * (k - 1) - 1) // s + 1
           for size, k, s, d in zip(spatial, module.kernel_size, module.stride, module.dilation)]
    steps = [x.stride(1 + j) for j in range(len(spatial))]
    windows = x.as_strided(
        (n, *out, *module.kernel_size, groups, c // groups),
        (x.stride(0), *[st * s for st, s in zip(steps, module.stride)],
         *[st * d for st, d in zip(steps, module.dilation)], c // groups, 1),
    )
    return windows.movedim(1 + 2 * len(spatial), 1).reshape(n * groups, math.prod(out), -1)


class _EmbeddingWeight(_Use):
    """Weight of an Embedding: sample i's gradient has row v = sum of g_t where idx_t = v (padding_idx
    rows excluded)."""

    def __init__(self, module: nn.Embedding, idx: torch.Tensor, g: torch.Tensor):
        n = g.shape[0]
        self.num_rows, self.padding_idx = module.num_embeddings, module.padding_idx
        self.idx = idx.reshape(n, -1)
        self.g = g.reshape(n, -1, g.shape[-1])
        self.batch_size = n

    def _kept(self):
        """(sample id, index, g) of every looked-up position that is not padding."""
        n, t = self.idx.shape
        samples = torch.arange(n, device=self.idx.device).repeat_interleave(t)
        idx, g = self.idx.reshape(-1), self.g.reshape(n * t, -1)
        if self.padding_idx is not None:
            keep = idx != self.padding_idx
            samples, idx, g = samples[keep], idx[keep], g[keep]
        return samples, idx, g

    def squared_norms(self):
        return _grouped_squared_norms([self], self.batch_size)

    def grad_samples(self):
        samples, idx, g = self._kept()
        out = g.new_zeros(self.batch_size * self.num_rows, g.shape[-1])
        out.index_add_(0, samples * self.num_rows + idx, g)
        return out.view(self.batch_size, self.num_rows, -1)

    def clipped_sum(self, c):
        samples, idx, g = self._kept()
        out = g.new_zeros(self.num_rows, g.shape[-1])
        return out.index_add_(0, idx, g * c.to(g.dtype)[samples].unsqueeze(1))


def _grouped_squared_norms(uses: Sequence[_EmbeddingWeight], n: int) -> torch.Tensor:
    """``sum_v ||sum_{t: idx_t = v} g_t||^2`` per sample, over the positions of all ``uses`` together:
    positions with the same (sample, index) are summed, then squared."""
    parts = [u._kept() for u in uses]
    samples = torch.cat([s for s, _, _ in parts])
    keys = samples * uses[0].num_rows + torch.cat([i for _, i, _ in parts])
    g = torch.cat([gg for _, _, gg in parts])
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = g.new_zeros(unique.shape[0], g.shape[-1]).index_add_(0, inverse, g)
    return g.new_zeros(n).index_add_(0, unique // uses[0].num_rows, rows.pow(2).sum(1))


# -- a parameter's uses in one backward pass ------------------------------------------------------------


def _tied_squared_norms(uses: List[_Use], prefer: Optional[str]) -> torch.Tensor:
    """Norms of the per-sample *sum* of several uses of one parameter."""
    if all(isinstance(u, _LinearWeight) for u in uses):
        t = [u.a.shape[1] for u in uses]
        d, p = uses[0].a.shape[-1], uses[0].g.shape[-1]
        ghost, per_sample = sum(t) ** 2 * (d + p), (sum(t) + 1) * d * p
        if prefer == "ghost" or (prefer != "per_sample" and ghost <= per_sample):
            return sum(_gram_dot(k.a, l.a, k.g, l.g) for k in uses for l in uses)
    if all(isinstance(u, _EmbeddingWeight) for u in uses):
        return _grouped_squared_norms(uses, uses[0].batch_size)
    total = uses[0].grad_samples()
    for u in uses[1:]:
        total = total + u.grad_samples()
    return total.flatten(1).pow(2).sum(1)


@dataclass
class _Segment:
    """One backward pass's record of one parameter: its per-sample squared norms and the uses that
    produce its clipped sum."""

    norms: torch.Tensor
    uses: List[_Use]


def _same_batch(param: nn.Parameter, uses: List[_Use]) -> int:
    sizes = {u.batch_size for u in uses}
    if len(sizes) != 1:
        raise RuntimeError(
            f"fxdp: parameter of shape {tuple(param.shape)} was used with batches of {sorted(sizes)} samples in "
            "one backward pass; per-sample norms need one batch per backward. Call backward once per batch"
        )
    return sizes.pop()


# -- the sink ---------------------------------------------------------------------------------------------


class BookkeepingSink(GradientSink):
    """Per-sample norms and clipped sums from (A, G), with per-sample gradients only where they are small.

    ``method``: ``None`` picks per layer from shapes (:func:`plan_layer`); ``"ghost"`` or ``"per_sample"``
    forces that method for every Linear layer on sequences and every Conv layer (tests, benchmarks).
    """

    def __init__(self, method: Optional[str] = None):
        if method not in (None, "ghost", "per_sample"):
            raise ValueError(f"method must be None, 'ghost' or 'per_sample', got {method!r}")
        self.method = method
        self.plans: Dict[nn.Module, LayerPlan] = {}  # the last plan of every layer seen, for reports
        self.tied: Dict[nn.Parameter, int] = {}  # parameters with several uses in one backward -> how many
        self._lock = threading.Lock()
        self._pending: Dict[int, Dict[nn.Parameter, List[_Use]]] = {}  # graph task -> uses in that pass
        self._segments: Dict[nn.Parameter, List[_Segment]] = {}  # published backward passes, in call order

    # Layers it can book-keep run without their weight gradient in backward (only input gradients
    # flow, see :func:`call_without_param_grads`): the optimizer writes ``p.grad`` from the clipped sums.
    skips_param_grads = True

    # A copied or pickled model (copy.deepcopy, torch.save) gets a fresh sink: what is recorded belongs
    # to backward passes of the original, and a lock cannot be copied.
    def __getstate__(self):
        return {"method": self.method}

    def __setstate__(self, state):
        self.__init__(state["method"])

    # -- write side ------------------------------------------------------------------------------------

    def add(self, capture: LayerCapture) -> None:
        uses = self._uses(capture)
        task = torch._C._current_graph_task_id()
        with self._lock:
            pending = self._pending.get(task)
            if pending is None:
                pending = self._pending[task] = {}
                # runs once, when the autograd engine finishes this backward pass
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._publish(task))
            for p, use in uses.items():
                pending.setdefault(p, []).append(use)

    def _uses(self, capture: LayerCapture) -> Dict[nn.Parameter, _Use]:
        module, g = capture.module, capture.backprops
        acts = [a for a in capture.activations if isinstance(a, torch.Tensor)]
        plan = plan_layer(module, [a.shape for a in acts], None if g is None else g.shape, self.method)
        if module is not None:
            self.plans[module] = plan
        params = [p for p in capture.params if p.requires_grad]
        bias = getattr(module, "bias", None)
        if plan.method == "materialise" or any(p is not module.weight and p is not bias for p in params):
            out = {}
            for p, gs in capture.grad_samples().items():
                if p.requires_grad:
                    check_grad_sample(p, gs, capture.batch_size)
                    out[p] = _Materialised(gs.detach())
            return out
        a, g = acts[0].detach(), g.detach()
        if a.shape[0] != capture.batch_size or g.shape[0] != capture.batch_size:
            raise RuntimeError(
                f"fxdp: {plan.layer} delivered input {tuple(a.shape)} and output gradient {tuple(g.shape)} for a "
                f"batch of {capture.batch_size}; where the batch sits was recorded wrongly"
            )
        out: Dict[nn.Parameter, _Use] = {}
        for p in params:
            if p is bias and isinstance(module, nn.Linear):  # summed over the middle positions
                out[p] = _Summed(g.reshape(g.shape[0], -1, g.shape[-1]).sum(1))
            elif p is bias:  # a Conv: summed over the spatial positions
                out[p] = _Summed(g.flatten(2).sum(2))
            elif isinstance(module, nn.Linear):
                out[p] = _LinearWeight(a, g, plan.method)
            elif isinstance(module, _CONVS):
                out[p] = _ConvWeight(module, a, g, plan.method)
            else:
                out[p] = _EmbeddingWeight(module, a, g)
        return out

    def _publish(self, task: int) -> None:
        with self._lock:
            pending = self._pending.pop(task, {})
        segments = {}
        with torch.no_grad():
            for p, uses in pending.items():
                _same_batch(p, uses)
                if len(uses) == 1:
                    norms = uses[0].squared_norms()
                else:
                    self.tied[p] = len(uses)
                    norms = _tied_squared_norms(uses, self.method)
                segments[p] = _Segment(norms, uses)
        with self._lock:
            for p, segment in segments.items():
                self._segments.setdefault(p, []).append(segment)

    # -- read side -------------------------------------------------------------------------------------

    def squared_norms(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        return {p: torch.cat([s.norms for s in self._segments[p]]) for p in params if self._segments.get(p)}

    def clipped_sums(self, params, factors):
        out = {}
        with torch.no_grad():
            for p in params:
                segments = self._segments.get(p)
                if p not in factors or not segments:
                    continue
                sizes = [s.norms.shape[0] for s in segments]
                c = factors[p]
                if c.shape != (sum(sizes),):
                    raise ValueError(
                        f"fxdp: clip factors of shape {tuple(c.shape)} for a parameter of shape {tuple(p.shape)} "
                        f"with {sum(sizes)} per-sample rows; pass one factor per sample"
                    )
                total = None
                for segment, c_seg in zip(segments, c.split(sizes)):
                    for use in segment.uses:
                        part = use.clipped_sum(c_seg)
                        total = part if total is None else total + part
                out[p] = total.reshape(p.shape)
        return out

    def clear(self, params: Iterable[nn.Parameter]) -> None:
        with self._lock:
            for p in params:
                self._segments.pop(p, None)

    def grad_samples(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        """Materialise ``(N, *p.shape)`` per-sample gradients (debugging, checks; never on the fast path)."""
        out = {}
        with torch.no_grad():
            for p in params:
                segments = self._segments.get(p)
                if segments:
                    out[p] = torch.cat([sum(u.grad_samples() for u in s.uses) for s in segments]).reshape(-1, *p.shape)
        return out


# -- layers called without their parameter gradients ------------------------------------------------------


class _LinearInputGradOnly(torch.autograd.Function):
    """``F.linear`` whose backward computes the input gradient only: the weight gradient, the product
    the sink forms later with re-weighted rows, is not computed twice."""

    @staticmethod
    def forward(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return (grad.matmul(weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None), None, None


class _ConvInputGradOnly(torch.autograd.Function):
    """A convolution (input already padded as the layer pads it) whose backward computes the input
    gradient only."""

    @staticmethod
    def forward(x, weight, bias, stride, padding, dilation, groups):
        return torch.convolution(x, weight, bias, stride, padding, dilation, False, [0] * len(padding), groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs
        ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        x, weight = ctx.saved_tensors
        grad_x, _, _ = torch.ops.aten.convolution_backward(
            grad, x, weight, None, ctx.stride, ctx.padding, ctx.dilation, False, [0] * len(ctx.padding),
            ctx.groups, [True, False, False],
        )
        return (grad_x,) + (None,) * 6


class _EmbeddingNoGrad(torch.autograd.Function):
    """A lookup whose backward computes nothing (indices have no gradient; the weight's is the sink's)."""

    @staticmethod
    def forward(indices, weight, padding_idx):
        return torch.nn.functional.embedding(indices, weight, padding_idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return None, None, None


def call_without_param_grads(module: nn.Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` with the same output, whose backward gives input gradients but no
    parameter gradients — for a layer the sink book-keeps (its clipped sum replaces the weight
    gradient). Returns ``None`` where that does not apply: the caller then calls the layer as usual."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
        return None
    x = args[0]
    if _own_rule(module, nn.Linear, linear_grad_sample):
        return _LinearInputGradOnly.apply(x, module.weight, module.bias)
    if _own_rule(module, _CONVS, conv_grad_sample) and x.dim() == len(module.kernel_size) + 2:
        x, padding = _pad_activations(module, x)
        return _ConvInputGradOnly.apply(x, module.weight, module.bias, list(module.stride), list(padding),
                                        list(module.dilation), module.groups)
    if (_own_rule(module, nn.Embedding, embedding_grad_sample) and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse):
        return _EmbeddingNoGrad.apply(x, module.weight, module.padding_idx)
    return None


__all__ = ["BookkeepingSink", "LayerPlan", "plan_layer", "plan_graph", "describe_plans", "METHODS",
           "call_without_param_grads"]
