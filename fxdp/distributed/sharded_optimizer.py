"""``FullyShardedDPOptimizer``: the DP-SGD step for a model sharded with FSDP2 (``fully_shard``).

Per logical step, on every rank (see docs/distributed.md, "FSDP2")::

    n_i  = per-sample norms of this rank's samples      complete here: a sample's A and G are on its rank
    c_i  = clip factors                                  no communication (flat or per layer)
    for each trainable parameter p, in order:            (_scaled_sums)
        S_p   = sum_i c_i g_i(p) / B, full shape        from the sink; this rank's samples only ("mean": B the
                                                         GLOBAL expected batch size)
        shard = reduce_scatter_sum(S_p)[this rank's rows]     the global clipped sum, this rank's shard
    for each trainable parameter p, in order:            (DPOptimizer._add_noise of the rows _noise_rows says)
        shard += (N(0, std^2 / B^2) drawn for all of p)[this rank's rows]
    p.grad = shard (as a DTensor shard)                  (_set_grads)
    inner_optimizer.step()                               on the shards: optimizer state is sharded too

These are the parts of DPOptimizer's one template of the private gradient (``_write_private_grads``) this class
overrides; the rest (the clip factors, the checks, the skipped steps' accumulation, the noise itself: formed in
:mod:`fxdp.optim.noise_rows`, this class says only which rows) is the one-process code.

One parameter's full clipped sum exists at a time (plus its noise). Communication: one reduce-scatter of
``p.numel()`` values per trainable parameter (padded to a multiple of the world size on dimension 0, as
FSDP2 pads its shards), i.e. about ``parameters x 4`` bytes in float32 per rank in, ``1/world`` of it out;
nothing else (FSDP's own reduce-scatter of the plain gradients is off, see :mod:`fxdp.distributed.fsdp`).

The noise. Every rank draws the noise of the whole parameter, in the order one process draws it, and keeps
its rows: each element's noise is one draw that exactly one rank keeps. Ranks seeded alike (a
``noise_generator`` with one seed everywhere) then add exactly the noise one process would, so the
update equals single-process DP-SGD bit for bit up to summation order; ranks drawing from different
sources (secure mode, the OS's entropy on each rank) keep rows of independent draws, which is just as
private. Drawing only the rank's rows from a per-rank stream would be cheaper, but ranks seeded alike
(``torch.manual_seed(0)`` everywhere, the common case) would then add *the same* noise to different
rows, correlated noise the accountant does not analyse.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from fxdp.distributed.correlated import gathered_mechanism_state, sharded_mechanism_state
from fxdp.distributed.optimizer import refuse_on_every_rank_if_unfinished
from fxdp.optim import DPOptimizer
from fxdp.sinks.contract import GradientSink, GradSampleSink, PerSampleError, wide_dtype


class ShardedSink(GradientSink):
    """The model's sink read with the optimizer's (sharded) parameters: a layer may deliver under the
    gathered parameter FSDP put in its place during backward (``gathered``: gathered -> sharded), and the
    answers are given under the sharded one."""

    def __init__(self, inner: GradientSink, gathered: Dict[nn.Parameter, nn.Parameter]):
        self.inner = inner
        self._gathered_of = {id(s): g for g, s in gathered.items()}

    @property
    def enabled(self):
        return self.inner.enabled

    @property
    def skips_param_grads(self):
        return self.inner.skips_param_grads

    def add(self, capture) -> None:
        self.inner.add(capture)

    def _keys(self, params: Iterable[nn.Parameter]) -> List[nn.Parameter]:
        out = []
        for p in params:
            out.append(p)
            if id(p) in self._gathered_of:
                out.append(self._gathered_of[id(p)])
        return out

    def _rekey(self, params, answers: Dict[nn.Parameter, Any], what: str) -> Dict[nn.Parameter, Any]:
        out = {}
        for p in params:
            g = self._gathered_of.get(id(p))
            if p in answers and g is not None and g in answers:
                raise PerSampleError(
                    f"fxdp: {what} of a parameter of shape {tuple(p.shape)} arrived under both its FSDP shard and its "
                    "gathered tensor: its uses cannot be combined per sample. Report this with the model's sharding")
            if p in answers:
                out[p] = _plain(answers[p], p, what)
            elif g is not None and g in answers:
                out[p] = _plain(answers[g], p, what)
        return out

    def squared_norms(self, params):
        params = list(params)
        return self._rekey(params, self.inner.squared_norms(self._keys(params)), "per-sample gradients")

    def grouped_squared_norms(self, params, groups, num_groups):
        """(user-level privacy) As the model's sink forms them, under the sharded parameters."""
        params = list(params)
        norms = self.inner.grouped_squared_norms(self._keys(params), groups, num_groups)
        return self._rekey(params, norms, "per-user squared norms")

    def _factors(self, factors):
        out = dict(factors)
        for p, c in factors.items():
            if id(p) in self._gathered_of:
                out[self._gathered_of[id(p)]] = c
        return out

    def clipped_sums(self, params, factors):
        params = list(params)
        return self._rekey(params, self.inner.clipped_sums(self._keys(params), self._factors(factors)), "clipped sums")

    def take_clipped_sums(self, params, factors, alpha=1.0):
        params = list(params)
        sums = self.inner.take_clipped_sums(self._keys(params), self._factors(factors), alpha=alpha)
        return self._rekey(params, sums, "clipped sums")

    def drop_samples(self, params, dropped):
        self.inner.drop_samples(self._keys(list(params)), dropped)

    def clear(self, params):
        self.inner.clear(self._keys(list(params)))

    def retired_reason(self, p):
        return self.inner.retired_reason(p)


def _plain(answer: torch.Tensor, p: nn.Parameter, what: str) -> torch.Tensor:
    """An answer as a plain tensor. A layer that saw no sample (an empty share) may answer with tensors made
    like the sharded parameter (``p.new_zeros``): empty, so they are replaced by plain empty ones; any other
    DTensor answer would be one rank's shard taken for the whole, which is refused."""
    if not hasattr(answer, "to_local"):
        return answer
    if answer.numel() == 0:
        return torch.zeros(answer.shape, dtype=answer.dtype, device=answer.device)
    raise PerSampleError(f"fxdp: the {what} of a parameter of shape {tuple(p.shape)} came back as a DTensor shard, "
                         "not a whole per-sample answer: a per-sample rule read the sharded parameter. Report this "
                         "with the layer's type")


class FullyShardedDPOptimizer(DPOptimizer):
    """A :class:`~fxdp.optim.DPOptimizer` over the DTensor shards of a ``fully_shard`` model: each rank clips
    its own samples, each parameter's clipped sum is reduce-scattered into the ranks' shards and each rank
    adds its rows of the noise (see the module docstring). ``plan`` is the model's
    :class:`~fxdp.distributed.fsdp.ShardingPlan`; ``expected_batch_size`` the *global* one. Other
    arguments are :class:`~fxdp.optim.DPOptimizer`'s. ``PrivacyEngine.make_private`` builds one."""

    _MECHANISM_READY = ("_scaled_sums", "_noise_rows", "_set_grads")  # a noise mechanism's noise kept (sharded)

    def __init__(self, optimizer: Optimizer, *, plan, sink: Optional[GradientSink] = None, **kwargs: Any):
        super().__init__(optimizer, sink=ShardedSink(sink if sink is not None else GradSampleSink(), plan.gathered),
                         **kwargs)
        self.plan = plan
        self.process_group = plan.process_group
        self.world_size = plan.world_size
        self.rank = dist.get_rank(plan.process_group)
        for p in self._trainable_params():
            if not hasattr(p, "to_local") or p.dim() == 0:
                raise ValueError(f"fxdp: parameter '{self._name(p)}' is not a DTensor sharded on dimension 0; "
                                 "pass the parameters of the fully_shard model (after fully_shard) to the optimizer")

    def _scaled_sums(self, params: List[nn.Parameter], factors: Dict[nn.Parameter, torch.Tensor],
                     scale: float) -> List[torch.Tensor]:
        """Each parameter's ``scale * S`` over every rank's samples, this rank's shard of it: formed here one
        parameter at a time (one full-size sum at a time) and reduce-scattered."""
        shards = []
        # Whether a clipped sum of this rank was not finite after samples were dropped (as one process checks,
        # _check_finite_after_dropping); a tensor, read once after the loop, so the check costs no sync per parameter
        unfinished = torch.zeros((), dtype=torch.bool)
        for p in params:
            # no sample on this rank (an empty share): the sum is zero, whatever the sink would make of no rows
            seen = p in factors and factors[p].shape[0] > 0
            full = self.sink.take_clipped_sums([p], {p: factors[p]}, alpha=scale).get(p) if seen else None
            dtype = wide_dtype(p.dtype)  # as one process forms the sum: at least float32
            full = torch.zeros(p.shape, dtype=dtype, device=p.device) if full is None else \
                full.to(dtype).reshape(p.shape)
            earlier = self.step_state.summed.pop(p, None)
            if earlier is not None:
                full.add_(earlier.view_as(full), alpha=scale)
            if self.step_state.dropped_samples:
                unfinished |= ~torch.isfinite(full).all().cpu()
            shards.append(self._reduce_scatter(full, self._chunk(p))[:p.to_local().shape[0]])
            del full
        self.sink.clear(params)
        self._refuse_if_any_rank_unfinished(unfinished, params[0].device if params else torch.device("cpu"))
        return shards

    def _noise_rows(self, params: List[nn.Parameter]) -> List[int]:
        """This rank's shard of each parameter starts at row ``rank * chunk``: the optimizer adds those rows of the
        noise one process draws (:mod:`fxdp.optim.noise_rows`)."""
        return [self.rank * self._chunk(p) for p in params]

    def _set_grads(self, params: List[nn.Parameter], shards: List[torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor

        for p, shard in zip(params, shards):
            p.grad = DTensor.from_local(shard.to(p.dtype).contiguous(), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())

    def _chunk(self, p: nn.Parameter) -> int:
        """The rows of dimension 0 each rank's shard of ``p`` holds (the last ranks' may hold fewer)."""
        return -(-p.shape[0] // self.world_size)

    def _refuse_if_any_rank_unfinished(self, unfinished: torch.Tensor, device: torch.device) -> None:
        """The check one process runs after dropping samples (:meth:`_check_finite_after_dropping`), made on the
        rank that dropped them, before its sums are reduce-scattered, and agreed on by every rank (one all-reduce
        of one value per step, :func:`~fxdp.distributed.optimizer.refuse_on_every_rank_if_unfinished`)."""
        refuse_on_every_rank_if_unfinished(unfinished, device, self.process_group, self.rank, self.world_size)

    def _reduce_scatter(self, full: torch.Tensor, chunk: int) -> torch.Tensor:
        """The sum over ranks of ``full``, this rank's ``chunk`` rows of dimension 0 (padded with zeros to
        ``chunk x world`` rows, as FSDP2 pads its shards)."""
        padded = full.new_zeros((chunk * self.world_size, *full.shape[1:]))
        padded[:full.shape[0]] = full
        out = full.new_empty((chunk, *full.shape[1:]))
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (newer name)
        reduce_scatter(out, padded, op=dist.ReduceOp.SUM, group=self.process_group)
        return out

    def state_dict(self) -> Dict[str, Any]:
        """As :meth:`DPOptimizer.state_dict`, with the wrapped optimizer's state as whole tensors under the
        parameters' names (``torch.distributed.checkpoint``'s full optimizer state dict): a collective, every rank
        calls it. Refused in the middle of a logical batch, whose clipped sums are spread over the ranks."""
        if self.step_state.summed:
            raise RuntimeError(
                "fxdp: cannot save a sharded DP optimizer in the middle of a logical batch (after "
                "signal_skip_step): its clipped sums so far are spread over the ranks. Save after optimizer.step() "
                "of the last physical batch")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self.plan.root.reshard()  # (gathered after a forward under no_grad)
        state = super().state_dict()
        state["fxdp"]["noise_mechanism"] = gathered_mechanism_state(self, state["fxdp"]["noise_mechanism"])
        state["optimizer"] = get_optimizer_state_dict(
            self.plan.root, self.original_optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As :meth:`DPOptimizer.load_state_dict`, from a :meth:`state_dict` of whole tensors: each rank keeps
        its shards of the wrapped optimizer's state."""
        if set(state_dict) != {"optimizer", "fxdp"}:
            raise ValueError("fxdp: a sharded DP optimizer loads what FullyShardedDPOptimizer.state_dict saved "
                             "(PrivacyEngine.save_checkpoint with the sharded model)")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.plan.root, self.original_optimizer, state_dict["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        own = dict(state_dict["fxdp"])
        own["noise_mechanism"] = sharded_mechanism_state(self, own.get("noise_mechanism"))
        super().load_state_dict({"optimizer": self.original_optimizer.state_dict(), "fxdp": own})

    def __repr__(self) -> str:
        return f"FullySharded{super().__repr__()[:-1]},\n  rank={self.rank}, world_size={self.world_size})"


__all__ = ["FullyShardedDPOptimizer", "ShardedSink"]
