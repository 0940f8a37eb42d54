"""The book-keeping sink: keeps each layer's uses during backward, computes norms when a backward pass
ends, and answers the optimizer's squared_norms / clipped_sums / clear.

How a layer's uses are formed is its type's registration's business (:mod:`~fxdp.sinks.bookkeeping.registry`);
this module only dispatches: a layer without a registration, or whose plan is ``materialise``, has its
per-sample gradients formed by its rule.

One row per sample (see :mod:`fxdp.sinks.contract`): a parameter's uses in every forward call and every
backward pass of one step are one record (:class:`~fxdp.sinks.bookkeeping.uses.Segment`), whose norms are
those of the per-sample sum of its uses (the tied path when there are several)."""

from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from fxdp.diagnostics.errors import PerSampleError
from fxdp.registry import lookup_stamp
from fxdp.sinks.bookkeeping.lanes import clipped_sums_in_lanes
from fxdp.sinks.bookkeeping.plans import plan_with
from fxdp.sinks.bookkeeping.registry import Captured, LayerPlan, find_bookkeeping
from fxdp.sinks.bookkeeping.shared import (clipped_sums_of_shared_g, ghost_groups, shared_ghost_norms,
                                           shared_input_ghost_norms)
from fxdp.sinks.bookkeeping.tied import tied_squared_norms
from fxdp.sinks.bookkeeping.users import GROUPED_ONLY, Budget, Grouping, grouped_norms_and_sums
from fxdp.sinks.bookkeeping.uses import Materialised, Segment, Use, memory_key, same_batch
from fxdp.sinks.contract import (GradientSink, LayerCapture, StepCalls, batch_size_problem, check_grad_sample,
                                 pending_of_this_backward, wide)

class BookkeepingSink(GradientSink):
    """Per-sample norms and clipped sums from (A, G), with per-sample gradients only where they are small.

    ``method``: ``None`` picks per layer from shapes (:func:`~fxdp.sinks.bookkeeping.plans.plan_layer`);
    ``"ghost"`` or ``"per_sample"`` forces that method for every Linear layer on sequences and every Conv layer
    (tests, benchmarks).
    """

    def __init__(self, method: Optional[str] = None):
        if method not in (None, "ghost", "per_sample"):
            raise ValueError(f"method must be None, 'ghost' or 'per_sample', got {method!r}")
        self.method = method
        self.plans: Dict[nn.Module, LayerPlan] = {}  # the last plan of every layer seen, for reports
        self.tied: Dict[nn.Parameter, int] = {}  # parameters with several uses in one backward -> how many
        # weights whose ghost norms came from one G Gram shared with other weights (a recurrent layer's two
        # projections) -> how many shared it, in the last backward pass that delivered them
        self.shared: Dict[nn.Parameter, int] = {}
        # weights whose ghost norms came from one A Gram shared with other weights (projections of one input:
        # an attention layer's query, key and value) -> how many shared it, in the last backward pass
        self.shared_inputs: Dict[nn.Parameter, int] = {}
        self._last_bias_sum = None  # (G, its per-sample sum): a recurrent layer's two biases share it
        self._lock = threading.Lock()
        self._pending: Dict[int, Dict[nn.Parameter, List[Use]]] = {}  # graph task -> uses in that pass
        self._pending_calls: Dict[int, Dict[int, int]] = {}  # graph task -> forward call -> its batch size
        self._segments: Dict[nn.Parameter, Segment] = {}  # each parameter's record of this step
        self._lanes: Dict[int, dict] = {}  # graph task -> lanes of that pass (small uses formed together, lanes.py)
        self._step = StepCalls()
        self._registrations: Dict[nn.Module, tuple] = {}  # layer -> (lookup stamp, its registration): _registration
        self._plans_kept: Dict[nn.Module, tuple] = {}  # layer -> its last plan and what it was made from: _plan
        self._grouped_only = False  # set_grouped_norms_only: no per-sample norms formed

    def set_grouped_norms_only(self, on: bool = True) -> bool:
        """Backward passes from now on form no per-sample norms (records published so are refused to
        :meth:`squared_norms`), and :meth:`grouped_squared_norms` keeps each group's summed gradient where it forms
        it, in place of the uses (:mod:`~fxdp.sinks.bookkeeping.users`)."""
        self._grouped_only = bool(on)
        return True

    @property
    def per_sample_norms(self) -> bool:
        """Whether per-sample norms are formed (registrations skip the work done for them ahead, e.g. G's Gram
        as G is delivered, where they are not)."""
        return not self._grouped_only

    # Layers it can book-keep run without their weight gradient in backward (only input gradients
    # flow, see fxdp/runtime/bookkeeping_calls.py): the optimizer writes ``p.grad`` from the clipped sums.
    @property
    def skips_param_grads(self) -> bool:
        return self.enabled  # switched off (disable_hooks): the layers compute their ordinary gradient

    def functional_forward(self, module, x):
        registration = self._registration(module)
        return None if registration is None else registration.functional_forward(module, x)

    def _registration(self, module: Optional[nn.Module]):
        """``find_bookkeeping(module)``, remembered per layer while :func:`~fxdp.registry.lookup_stamp` holds: a
        layer is looked up twice per call (its forward, its capture), and the lookup costs more than a small
        layer's arithmetic."""
        if module is None:
            return None
        if torch.compiler.is_dynamo_compiling():  # under torch.compile nothing kept, nothing read: the dict would be
            return find_bookkeeping(module)       # a guard, failing (a recompile) once it fills
        stamp = lookup_stamp(module)
        found = self._registrations.get(module)
        if found is not None and stamp is not None and found[0] == stamp:
            return found[1]
        registration = find_bookkeeping(module)
        if stamp is not None:
            self._registrations[module] = (stamp, registration)
        return registration

    # A copied or pickled model (copy.deepcopy, torch.save) gets a fresh sink: what is recorded belongs
    # to backward passes of the original, and a lock cannot be copied.
    def __getstate__(self):
        return {"method": self.method}

    def __setstate__(self, state):
        self.__init__(state["method"])

    # -- write side ------------------------------------------------------------------------------------

    def add(self, capture: LayerCapture) -> None:
        if not self.enabled:
            return
        uses = self._uses(capture)
        with self._lock:
            pending = pending_of_this_backward(self)
            for p, use in uses.items():
                pending.setdefault(p, []).append(use)
            calls = self._pending_calls.setdefault(torch._C._current_graph_task_id(), {})
            calls[capture.call] = capture.batch_size

    def _uses(self, capture: LayerCapture) -> Dict[nn.Parameter, Use]:
        # G as delivered and the factor that makes it the summed loss's (folded into norms and clip factors
        # by the uses, not multiplied into a copy of G); capture.backprops would form the product
        module, unscaled, scale = capture.module, capture.backprops_unscaled, capture.backprops_scale
        acts = [a for a in capture.activations if isinstance(a, torch.Tensor)]
        registration = self._registration(module)
        params = tuple(p for p in capture.params if p.requires_grad)
        plan, uncovered = self._plan(registration, module, acts, unscaled, params)
        # a materialising registration may still form the per-sample gradients of small layers together (lanes.py)
        together = plan.method == "materialise" and registration is not None and registration.forms_small_together
        if (plan.method == "materialise" and not together) or uncovered:
            return _materialised(capture, module)
        # norms and clipped sums in at least float32 (see wide); A and G of hand-written rules come widened already
        a, g_raw = wide(acts[0].detach()), wide(unscaled.detach())
        if a.shape[0] != capture.batch_size or g_raw.shape[0] != capture.batch_size:
            raise PerSampleError(
                f"fxdp: {plan.layer} delivered input {tuple(a.shape)} and output gradient {tuple(g_raw.shape)} for "
                f"a batch of {capture.batch_size}; where the batch sits was recorded wrongly"
            )
        out = registration.uses(Captured(module, params, a, g_raw, scale, plan.method), self)
        if out is None:  # the registration has no form for this call after all
            return _materialised(capture, module)
        for p, use in out.items() if plan.method == "per_sample" else ():
            if p.numel() <= a[0].numel() + g_raw[0].numel():
                # its per-sample gradient is formed for the norm anyway and is smaller than A and G: keep it
                # now (A and G are freed as backward goes on) and clip by a weighted sum, not a product
                out[p] = Materialised(use.grad_samples())
        return out

    def _plan(self, registration, module, acts, unscaled, params) -> tuple:
        """``(the layer's plan, whether a trainable parameter is one its registration does not cover)``, remembered per
        layer for the next call with the same registration, shapes, method and parameters, as the registration's
        ``params`` covers them now (compared by id: the objects are kept with the answer, so no id is reused)."""
        shapes = (tuple(a.shape for a in acts), None if unscaled is None else unscaled.shape, self.method)
        covered = () if registration is None or module is None else tuple(registration.params(module))
        key = (id(registration), shapes, tuple(map(id, params)), tuple(map(id, covered)))
        kept = None if module is None or torch.compiler.is_dynamo_compiling() else self._plans_kept.get(module)
        if kept is not None and kept[0] == key:
            plan, uncovered = kept[1], kept[2]
        else:
            plan = plan_with(registration, module, list(shapes[0]), shapes[1], self.method)
            uncovered = registration is not None and _uncovered(registration, module, params)
            if module is not None and not torch.compiler.is_dynamo_compiling():
                self._plans_kept[module] = (key, plan, uncovered, (registration, params, covered))  # (ids pinned)
        if module is not None:
            self.plans[module] = plan
        return plan, uncovered

    def lane(self, key: tuple, make):
        """The lane of the running backward pass for uses alike by ``key`` (:mod:`~fxdp.sinks.bookkeeping.lanes`),
        made by ``make()`` where there is none open."""
        with self._lock:
            lanes = self._lanes.setdefault(torch._C._current_graph_task_id(), {})
            lane = lanes.get(key)
            if lane is None or lane.closed:
                lane = lanes[key] = make()
            return lane

    def bias_sum(self, g: torch.Tensor) -> torch.Tensor:
        """A Linear bias's per-sample gradient, G summed over the middle positions; the same tensor for a G
        delivered again (an LSTM's or RNN's two biases both get the sum of its one tensor of gate gradients).
        The cache holds G itself, so its memory cannot be reused by another tensor while the key is kept."""
        if g.dim() == 2:  # (N, p): G itself, nothing to sum or to remember
            return g
        last = self._last_bias_sum
        if last is not None and memory_key(last[0]) == memory_key(g):
            return last[1]
        summed = g if g.dim() == 2 else g.flatten(1, -2).sum(1)  # (flatten: no -1 to infer in an empty batch)
        self._last_bias_sum = (g, summed)
        return summed

    def _shared_norms(self, pending: Dict[nn.Parameter, List[Use]]) -> Dict[nn.Parameter, torch.Tensor]:
        """Ghost norms of the Linear weights used once whose G is one tensor (a recurrent layer's two
        projections), or else whose A is, with that tensor's Gram matrix formed once per group; weights used
        several times take the tied path."""
        out = {}
        for params in ghost_groups(pending, lambda use: memory_key(use.g)):
            out.update(zip(params, shared_ghost_norms([pending[p][0] for p in params])))
            self.shared.update((p, len(params)) for p in params)
        # the others whose A is one tensor (the query, key and value projections of an attention layer, a
        # gated MLP's gate and up projections): the Gram blocks of A formed once per group
        for params in ghost_groups(pending, lambda use: memory_key(use.a), taken=out):
            out.update(zip(params, shared_input_ghost_norms([pending[p][0] for p in params])))
            self.shared_inputs.update((p, len(params)) for p in params)
        return out

    def _publish(self, task: int) -> None:
        with self._lock:
            pending = self._pending.pop(task, {})
            calls = self._pending_calls.pop(task, {})
            self._lanes.pop(task, None)  # its members hold them: no more joins
        self._last_bias_sum = None
        within = batch_size_problem(calls.values())
        if within is not None:  # one pass over batches of several sizes: no row is one sample's
            raise PerSampleError(within)
        if not any(p in self._segments for p in self._step.params.values()):
            self._step.reset()  # nothing of the step is held any more: this pass starts a new one
        refusal = self._step.problem(calls)
        if refusal is not None:  # another batch: kept out of the step's records, and the step refused
            self._step.add(calls, (), refusal)
            return
        # a parameter with a record of this step's earlier passes: its uses join them (one row per sample)
        earlier = {p: self._segments[p] for p in pending if id(p) in self._step.params and p in self._segments}
        segments = {}
        grouped = self._grouped_only  # (no per-sample norm: the segments hold their uses alone)
        with torch.no_grad():
            shared = {} if grouped else self._shared_norms(
                {p: uses for p, uses in pending.items() if p not in earlier} if earlier else pending)
            for p, uses in pending.items():
                same_batch(p, uses)
                if len(uses) > 1:
                    self.tied[p] = len(uses)
                if earlier and p in earlier:  # (the same path as tied uses: the norm of the per-sample sum)
                    uses = earlier[p].uses + uses
                    same_batch(p, uses)
                if grouped:
                    norms = None
                elif shared and p in shared:
                    norms = shared[p]
                elif len(uses) == 1:
                    norms = uses[0].squared_norms()
                else:
                    norms = tied_squared_norms(uses, self.method)
                segments[p] = Segment(norms, uses)
        with self._lock:
            self._step.add(calls, segments)
            self._segments.update(segments)

    # -- read side -------------------------------------------------------------------------------------

    def squared_norms(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        self._step.check_readable()
        # a ghost norm <A Aᵀ, G Gᵀ> of a gradient near 0 can round below 0 (its square root would be NaN)
        # (one foreach call for every parameter: the same values as each norm's clamp(min=0), NaN kept)
        held = [p for p in params if p in self._segments]
        if any(self._segments[p].norms is None for p in held):
            raise PerSampleError(GROUPED_ONLY.format(what="norms"))
        return dict(zip(held, torch._foreach_clamp_min([self._segments[p].norms for p in held], 0.0))) if held else {}

    def sample_rows(self, params):
        self._step.check_readable()
        return {p: self._segments[p].rows for p in params if p in self._segments}

    def grouped_squared_norms(self, params, groups, num_groups):
        """Exact per-group norms: Gram products over each group's block where the record allows, else its
        per-sample gradients summed per group (:mod:`~fxdp.sinks.bookkeeping.users`). Records published without
        per-sample norms (:meth:`set_grouped_norms_only`) keep the group sums formed for the norms, in place of
        their uses."""
        self._step.check_readable()
        out = {}
        grouping = Grouping(groups, num_groups)
        credit = 0  # elements the uses replaced so far held beyond the group sums kept for them
        with torch.no_grad():
            for p in params:
                segment = self._segments.get(p)
                if segment is None:
                    continue
                if segment.norms is not None:  # (per-sample norms formed: the uses stay, per-sample reads too)
                    out[p] = grouped_norms_and_sums(segment, grouping)[0]
                    continue
                budget = Budget(segment, credit)
                norms, kept = grouped_norms_and_sums(segment, grouping, budget=budget)
                if kept is not None:
                    credit += budget.held - kept.sums.numel()
                    with self._lock:
                        segment.uses = [kept]
                out[p] = norms
        # clamped at 0 as squared_norms clamps them (one foreach call for every parameter: the same values)
        return dict(zip(out, torch._foreach_clamp_min(list(out.values()), 0.0))) if out else out

    def clipped_sums(self, params, factors):
        params = list(params)
        with torch.no_grad():
            uses = self._uses_with_factors(params, factors)
            shared = clipped_sums_of_shared_g(uses)
            clipped_sums_in_lanes(uses, skip=shared)
            sums = {p: _clipped_sum(uses[p], shared) for p in params if uses.get(p)}
        return {p: s.reshape(p.shape) for p, s in sums.items()}

    def take_clipped_sums(self, params, factors, alpha=1.0):
        """The clipped sums, last parameter first (about the order backward delivered them in), each
        parameter's records dropped as soon as its sum is formed: a layer's A and G are freed once its
        weight and bias are summed, so they are never all alive together with all the sums."""
        params = list(params)
        if alpha != 1.0:  # flat clipping gives every parameter the same factors: scaled once
            scaled = {}
            factors = {p: scaled[id(c)] if id(c) in scaled else scaled.setdefault(id(c), c * alpha)
                       for p, c in factors.items()}
        out = [None] * len(params)
        segments = self._segments
        with torch.no_grad():
            uses = self._uses_with_factors(params, factors)
            shared = clipped_sums_of_shared_g(uses)
            clipped_sums_in_lanes(uses, skip=shared)
            for k in range(len(params) - 1, -1, -1):
                p = params[k]
                taken = uses.pop(p, None)
                if taken:
                    total = _clipped_sum(taken, shared)
                    out[k] = total if total.shape == p.shape else total.reshape(p.shape)  # (a lane's row: its shape)
                segments.pop(p, None)  # its last records: its A and G go with them (one pop: atomic, no lock)
        self.clear(())  # (every parameter's records are dropped already)
        return {p: s for p, s in zip(params, out) if s is not None}

    def _uses_with_factors(self, params, factors) -> Dict[nn.Parameter, List[tuple]]:
        """``{p: [(use, its samples' clip factors), ...]}`` over every use of ``p`` recorded since the last
        clear, for the parameters with records and factors."""
        self._step.check_readable()
        out = {}
        segments = self._segments
        for p in params:
            segment = segments.get(p)
            c = None if segment is None else factors.get(p)
            if c is None:
                continue
            if c.shape != (segment.rows,):
                raise ValueError(
                    f"fxdp: clip factors of shape {tuple(c.shape)} for a parameter of shape {tuple(p.shape)} "
                    f"with {segment.rows} per-sample rows; pass one factor per sample"
                )
            out[p] = [(use, c) for use in segment.uses]
        return out

    def drop_samples(self, params, dropped):
        with self._lock:
            for p in params:
                segment = self._segments.get(p)
                for use in segment.uses if segment is not None else ():
                    use.drop_samples(dropped)

    def clear(self, params: Iterable[nn.Parameter]) -> None:
        self._last_bias_sum = None
        with self._lock:
            self._step.reset()
            for p in params:
                self._segments.pop(p, None)

    def grad_samples(self, params: Iterable[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
        """Materialise ``(N, *p.shape)`` per-sample gradients (debugging, checks; never on the fast path)."""
        out = {}
        with torch.no_grad():
            for p in params:
                segment = self._segments.get(p)
                if segment is not None:
                    out[p] = sum(u.grad_samples() for u in segment.uses).reshape(-1, *p.shape)
        return out


def _clipped_sum(uses: List[tuple], shared: Dict[int, torch.Tensor]) -> torch.Tensor:
    """A parameter's clipped sum over its ``(use, factors)`` (those of a shared group taken from ``shared``)."""
    total = None
    for use, c in uses:
        part = shared.pop(id(use), None)
        part = use.clipped_sum(c) if part is None else part
        total = part if total is None else total + part
    return total


def _uncovered(registration, module: nn.Module, params) -> bool:
    """A trainable parameter the registration's uses do not cover (then the capture is materialised whole)."""
    covered = {id(q) for q in registration.params(module)}
    return any(id(p) not in covered for p in params)


def _materialised(capture: LayerCapture, module: Optional[nn.Module]) -> Dict[nn.Parameter, Use]:
    """The capture's per-sample gradients, from the layer's rule (or the generic rule), as uses."""
    out = {}
    for p, gs in capture.grad_samples().items():
        if p.requires_grad:
            check_grad_sample(p, gs, capture.batch_size, module)
            out[p] = Materialised(wide(gs.detach()))
    return out
