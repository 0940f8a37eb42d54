"""``DistributedDPOptimizer``: the DP-SGD step when several processes train one model together.

Each process (rank) clips the per-sample gradients of its own share of the logical batch and adds
them up, exactly as :class:`~fxdp.optim.DPOptimizer` does alone. At the end of a logical batch::

    rank 0:       S_0 + N(0, sigma^2 C^2)      the noise, drawn once for the whole logical batch
    rank r > 0:   S_r                           no noise
    all-reduce (sum), then on every rank:
        p.grad = (sum_r S_r + noise) / expected_batch_size      ("mean": the GLOBAL expected size)
        inner_optimizer.step()

Every rank receives the same summed tensor, so every rank's update, and hence its parameters, are
identical (they start identical: DistributedDataParallel broadcasts rank 0's weights when it is
built). The noise std in the averaged gradient is ``sigma * C / B`` for the global batch ``B``, as
one process on the whole batch would give: one draw, not one per rank (that would be ``sqrt(world)``
times too much) and not a share of a shared draw on each rank (which needs every rank to hold the
same seed, impossible in secure mode).

Communication: one all-reduce of ``sum(p.numel())`` values per logical step (in buckets of at most
``bucket_bytes``), i.e. parameters x 4 bytes in float32; nothing during backward, nothing for the
physical batches of a logical one (``signal_skip_step``), so ranks may cut their shares into
different numbers of physical batches. Every rank must call ``step()`` without a skip signal the same
number of times: a rank with an empty share still steps (its clipped sum is zero).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from fxdp.errors import StepRefusedError
from fxdp.optim import DPOptimizer

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's default bucket size


class DistributedDPOptimizer(DPOptimizer):
    """A :class:`~fxdp.optim.DPOptimizer` whose clipped sums are summed over the ranks of
    ``process_group`` (the default group when ``None``) once per logical step, with the noise added
    by rank 0 only. ``expected_batch_size`` is the expected size of the *global* logical batch (all
    ranks' shares together). Other arguments are :class:`~fxdp.optim.DPOptimizer`'s.

    ``PrivacyEngine.make_private`` builds one for a model wrapped in
    ``torch.nn.parallel.DistributedDataParallel``.
    """

    _MECHANISM_READY = ("_adds_noise", "_reduce")  # a noise mechanism's noise kept: rank 0 holds it and adds it

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        process_group: Optional[Any] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **kwargs: Any,
    ):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "fxdp: DistributedDPOptimizer needs an initialised torch.distributed process group; call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment for it)"
            )
        super().__init__(optimizer, **kwargs)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.bucket_bytes = int(bucket_bytes)

    def _adds_noise(self) -> bool:
        return self.rank == 0

    def _check_before_reduce(self, noised_sums: List[torch.Tensor]) -> None:
        """The check one process runs after dropping samples (:meth:`_check_finite_after_dropping`), made on each
        rank before the all-reduce and agreed on by every rank (one all-reduce of one value per step): a refused
        step is refused on every rank, before any gradient is written, and no rank waits in an all-reduce that
        another, having raised, will not reach."""
        device = noised_sums[0].device if noised_sums else torch.device("cpu")
        refuse_on_every_rank_if_unfinished(self._unfinished_after_dropping(noised_sums), device, self.process_group,
                                           self.rank, self.world_size)

    def _reduce(self, noised_sums: List[torch.Tensor]) -> List[torch.Tensor]:
        """Sum every rank's (noised, on rank 0) clipped sums: one all-reduce per bucket of flattened
        tensors of one device and dtype."""
        reduced = list(noised_sums)
        for indices in _buckets(noised_sums, self.bucket_bytes):
            flat = torch.cat([noised_sums[i].reshape(-1) for i in indices])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            for i, chunk in zip(indices, flat.split([noised_sums[i].numel() for i in indices])):
                reduced[i] = chunk.view_as(noised_sums[i])
        return reduced

    # -- checkpoints: one file, written by rank 0, read by any number of ranks ----------------------

    def state_dict(self) -> Dict[str, Any]:
        """As :meth:`DPOptimizer.state_dict`; refused in the middle of a logical batch, whose clipped
        sums are spread over the ranks (save after a step without a skip signal)."""
        if self.step_state.summed:
            raise RuntimeError(
                "fxdp: cannot save a distributed DP optimizer in the middle of a logical batch (after "
                "signal_skip_step): its clipped sums so far are spread over the ranks and rank 0's file "
                "would hold only its own. Save after optimizer.step() of the last physical batch"
            )
        return super().state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As :meth:`DPOptimizer.load_state_dict`. A checkpoint taken by one process in the middle of a
        logical batch holds that batch's clipped sum so far: rank 0 keeps it and the other ranks
        start from zero, so the all-reduce adds it once."""
        if self.rank != 0 and set(state_dict) == {"optimizer", "fxdp"}:
            own = dict(state_dict["fxdp"])
            own["accumulated"] = [None] * len(own["accumulated"])
            state_dict = {"optimizer": state_dict["optimizer"], "fxdp": own}
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"Distributed{super().__repr__()[:-1]},\n  rank={self.rank}, world_size={self.world_size})"


def refuse_on_every_rank_if_unfinished(unfinished: Union[bool, torch.Tensor], device: torch.device, process_group: Any,
                                       rank: int, world_size: int) -> None:
    """Every rank of ``process_group`` calls it once per step with whether its clipped sums are not finite after it
    dropped samples (``unfinished``); one all-reduce (MAX) of one value on ``device`` (the collectives' device:
    NCCL's is a GPU), then every rank raises the same refusal if any rank's sums were not finite."""
    flag = torch.as_tensor(unfinished).to(device=device, dtype=torch.int32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
    if bool(flag.item()):
        raise StepRefusedError(
            f"fxdp: a clipped sum is not finite after the samples with a non-finite per-sample gradient were "
            f"dropped (on {'this rank' if bool(unfinished) else 'another rank'}, rank {rank} of {world_size} "
            "reporting), so every rank refuses the step. Look for inf/nan in the inputs and the loss; this is also a "
            "bug in the gradient sink: please report it")


def _buckets(tensors: List[torch.Tensor], bucket_bytes: int) -> Iterator[List[int]]:
    """Indices of ``tensors`` in consecutive groups of one device and dtype, each of at most
    ``bucket_bytes`` (a single larger tensor is a bucket of its own)."""
    bucket: List[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or (t.device, t.dtype) != (tensors[bucket[0]].device,
                                                                               tensors[bucket[0]].dtype)):
            yield bucket
            bucket, size = [], 0
        bucket.append(i)
        size += nbytes
    if bucket:
        yield bucket
