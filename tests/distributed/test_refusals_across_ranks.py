"""A step refused on one rank is refused on every rank, and none of them hangs: two processes on localhost with gloo.

The refusal: the check one process runs after dropping samples whose per-sample gradient is not finite (a clipped
sum still not finite, here because one rank's sink keeps the record it was told to drop). Under DDP the rank that
finds it would raise before the all-reduce its peers wait in; the ranks agree first, through one all-reduce of one
value per step, so every rank raises the same refusal before any gradient is written. Then the next (clean) step
runs on every rank: the ranks' collectives are still paired. FSDP2 the same (its agreement precedes the
reduce-scatters).

One launch of two ranks (this file run as a script: ``python tests/distributed/test_refusals_across_ranks.py RANK
DIR STORE``) runs every scenario and saves what each rank saw. The process group's timeout is short and the
launch's bounded: a rank left waiting fails the test (a hang, or the timeout's error instead of the refusal).
"""

from __future__ import annotations

import datetime
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.ranks import launch_ranks  # noqa: E402

WORLD = 2
LOCAL_BATCH = 4
GLOBAL_BATCH = WORLD * LOCAL_BATCH
FEATURES, CLASSES = 6, 3
CLIP = 0.7
GROUP_TIMEOUT_S = 30  # a rank waiting for a peer that raised gets gloo's timeout error after this
LAUNCH_TIMEOUT_S = 150  # far above a normal run; only a hang reaches it
CASES = [("ddp", "fx", 0), ("ddp", "fx", 1), ("ddp", "hooks", 1), ("fsdp2", "fx", 1)]  # (wrapper, engine, poisoned)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def make_dataset(poisoned_rank=None) -> TensorDataset:
    """Three global batches; with ``poisoned_rank``, the second batch's sample ``poisoned_rank`` (the first sample of
    that rank's share under a DistributedSampler without shuffling) has an infinite input. (The first batch is clean:
    the hooks engine checks itself on it.)"""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * GLOBAL_BATCH, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (3 * GLOBAL_BATCH,), generator=g)
    if poisoned_rank is not None:
        x[GLOBAL_BATCH + poisoned_rank, 0] = float("inf")
    return TensorDataset(x, y)


def full_params(model: nn.Module):
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


# -- the ranks ---------------------------------------------------------------------------------------


def _scenario(rank, wrapper, mode, poisoned, mesh):
    """A clean step, a refused one (the poisoned rank's sink keeps the dropped record), a clean one."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from fxdp.errors import StepRefusedError
    from fxdp.privacy_engine import PrivacyEngine

    model = DDP(make_model()) if wrapper == "ddp" else fully_shard(make_model(), mesh=mesh)
    ds = make_dataset(poisoned)
    loader = DataLoader(ds, batch_size=LOCAL_BATCH, sampler=DistributedSampler(ds, shuffle=False))
    model, opt, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode=mode, example_inputs=torch.zeros(2, FEATURES))
    sink = opt.sink.inner if wrapper == "fsdp2" else opt.sink
    seen = {}
    for step, (x, y) in enumerate(loader):
        if step == 1:
            seen["before"] = full_params(model)
            if rank == poisoned:  # the sink says it dropped the sample's record, and keeps it
                sink.drop_samples = lambda params, dropped: None
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        backward_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the poisoned rank's NonFiniteSampleWarning)
                opt.step()
            seen[step] = "stepped"
        except StepRefusedError as e:
            seen[step] = str(e)
            seen["grads after backward"] = backward_grads  # (the hooks engine's backward writes plain gradients)
            seen["grads after the refusal"] = [p.grad for p in model.parameters()]
            seen["params after the refusal"] = full_params(model)
        if rank == poisoned and step == 1:
            del sink.drop_samples  # (the clean step's sink drops as it should; it has nothing to drop)
    return dict(seen, after=full_params(model))


def _rank_main(rank: int, out_dir: str, store: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {case: _scenario(rank, *case, mesh) for case in CASES}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


# -- the tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_ranks(__file__, tmp_path_factory.mktemp("refusal_ranks"), WORLD, LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_a_step_refused_on_one_rank_is_refused_on_every_rank_before_any_gradient_is_written(ranks, case):
    poisoned = case[2]
    for rank, results in enumerate(ranks):
        seen = results[case]
        where = "this rank" if rank == poisoned else "another rank"
        assert seen[0] == "stepped", (rank, seen[0])
        assert seen[1] == (
            "fxdp: a clipped sum is not finite after the samples with a non-finite per-sample gradient were dropped "
            f"(on {where}, rank {rank} of {WORLD} reporting), so every rank refuses the step. Look for inf/nan in the "
            "inputs and the loss; this is also a bug in the gradient sink: please report it"), (rank, seen[1])
        for after, backward in zip(seen["grads after the refusal"], seen["grads after backward"]):  # none written
            assert (after is None) == (backward is None), rank
            if after is not None:  # (NaN where the infinite input reached: NaN equals NaN here)
                torch.testing.assert_close(after, backward, rtol=0, atol=0, equal_nan=True)
        assert all(torch.equal(seen["before"][k], seen["params after the refusal"][k]) for k in seen["before"]), rank


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_after_a_refusal_on_every_rank_the_next_step_runs_on_every_rank_alike(ranks, case):
    ends = [results[case] for results in ranks]
    assert [seen[2] for seen in ends] == ["stepped"] * WORLD
    for name in ends[0]["after"]:
        assert torch.equal(ends[0]["after"][name], ends[1]["after"][name]), name
        assert not torch.equal(ends[0]["after"][name], ends[0]["before"][name]), name
        assert bool(torch.isfinite(ends[0]["after"][name]).all()), name


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
