"""Private training across processes (fxdp.distributed): two processes on localhost with gloo against
one process on the same global batch.

One launch of two ranks (this file run as a script: ``python tests/distributed/test_two_ranks.py RANK DIR
STORE``) runs every scenario below for the compiled graph and the hooks engine and saves what each
rank ends with; the tests compare that with single-process runs done here. The ranks rendezvous
through a file store (no port to pick) and talk over the loopback interface; every wait is bounded.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.support.ranks import launch_ranks

WORLD = 2
MODES = ("fx", "hooks")
SEED = 0
LOCAL_BATCH = 4
GLOBAL_BATCH = WORLD * LOCAL_BATCH
STEPS = 3
FEATURES, CLASSES = 6, 3
NOISE_SEED = 1234
SIGMA, CLIP = 1.3, 0.7
WIDE = 100  # the noise scenario's Linear(WIDE, WIDE): 10,100 coordinates
LAUNCH_TIMEOUT_S = 150  # far above a normal run (about 10 s); only a hang reaches it


# -- what both sides run -----------------------------------------------------------------------------


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def make_dataset(n: int = STEPS * GLOBAL_BATCH) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def train_steps(model, optimizer, batches, loss_reduction="mean", zero_loss=False):
    for x, y in batches:
        optimizer.zero_grad()
        out = model(x)
        if zero_loss:
            loss = (out * 0).sum()  # per-sample gradients of zero: the update is the noise alone
        elif len(y):
            loss = F.cross_entropy(out, y, reduction=loss_reduction)
        else:  # an empty batch: no per-sample gradient, the step still runs (and communicates)
            loss = out.sum()
        loss.backward()
        optimizer.step()


def private(engine, model, loader, *, mode, sigma=0.0, loss_reduction="mean", poisson=False, generator=None,
            lr=0.5, momentum=0.9, example=torch.zeros(2, FEATURES)):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
                               max_grad_norm=CLIP, grad_sample_mode=mode, poisson_sampling=poisson,
                               loss_reduction=loss_reduction, example_inputs=example, noise_generator=generator)


def params_of(model: nn.Module):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def empty_step_batches(rank: int):
    """Rank 1 gets no sample in the second step; rank 0 gets its usual share."""
    ds = make_dataset()
    x, y = ds.tensors
    out = []
    for step in range(STEPS):
        rows = torch.arange(step * GLOBAL_BATCH + rank, (step + 1) * GLOBAL_BATCH, WORLD)
        if rank == 1 and step == 1:
            rows = rows[:0]
        out.append((x[rows], y[rows]))
    return out


# -- the ranks ---------------------------------------------------------------------------------------


def _rank_main(rank: int, out_dir: str, store: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    import fxdp
    from fxdp.data import BatchMemoryManager
    from fxdp.sinks.contract import sink_of
    from fxdp.privacy_engine import PrivacyEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    ds = make_dataset()

    def sharded_loader(dataset=ds):
        return DataLoader(dataset, batch_size=LOCAL_BATCH, sampler=DistributedSampler(dataset, shuffle=False))

    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        private(PrivacyEngine(), make_model(), sharded_loader(), mode="fx")
    results["no_ddp_warnings"] = [str(w.message) for w in caught]
    for mode in MODES:
        for reduction in ("mean", "sum"):
            model, opt, loader = private(PrivacyEngine(), DDP(make_model()), sharded_loader(), mode=mode,
                                         loss_reduction=reduction)
            train_steps(model, opt, loader, reduction)
            results[mode, reduction] = params_of(model.module)
            results[mode, reduction, "types"] = (type(model).__name__, type(opt).__name__)
            results[mode, reduction, "surface"] = dict(
                report=str(fxdp.report(model)) == str(fxdp.report(model.module)),
                sink=sink_of(model) is sink_of(model.module) and opt.sink is sink_of(model.module),
                state_dict_keys=sorted(model.state_dict()) == sorted("module." + k for k in model.module.state_dict()),
            )

        gen = torch.Generator().manual_seed(NOISE_SEED)  # the same seed everywhere: only rank 0 draws
        model, opt, loader = private(PrivacyEngine(), DDP(make_model()), sharded_loader(), mode=mode, sigma=SIGMA,
                                     generator=gen)
        train_steps(model, opt, loader)
        results[mode, "noisy"] = params_of(model.module)

        torch.manual_seed(100 + rank)  # each rank's own global generator: the noise must still be drawn once
        wide = nn.Linear(WIDE, WIDE)
        start = params_of(wide)
        model, opt, loader = private(PrivacyEngine(), DDP(wide), sharded_loader(_wide_dataset()), mode=mode,
                                     sigma=SIGMA, lr=1.0, momentum=0.0, example=torch.zeros(2, WIDE))
        train_steps(model, opt, [next(iter(loader))], zero_loss=True)
        results[mode, "noise_update"] = {k: v - params_of(wide)[k] for k, v in _broadcast_start(start).items()}
        results[mode, "noise_update_params_equal"] = params_of(wide)

        model, opt, _ = private(PrivacyEngine(), DDP(make_model()), sharded_loader(), mode=mode)
        train_steps(model, opt, empty_step_batches(rank))
        results[mode, "empty"] = params_of(model.module)

        engine = PrivacyEngine()
        full = DataLoader(make_dataset(40), batch_size=5, sampler=DistributedSampler(make_dataset(40)))
        model, opt, loader = private(engine, DDP(make_model()), full, mode=mode, sigma=1.0, poisson=True)
        seen = []
        for x, y in loader:
            seen.append(x)
            train_steps(model, opt, [(x, y)])
        results[mode, "poisson"] = dict(
            epsilon=engine.get_epsilon(1e-5), history=list(engine.accountant.history), seen=seen,
            sample_rate=loader.sample_rate, expected_batch_size=opt.expected_batch_size, params=params_of(model.module),
        )
        # physical batches of at most 2: the ranks cut their shares into different numbers of them
        secure = PrivacyEngine(secure_mode=True)  # rank 0's noise from the OS: no seed shared
        cut_model, cut_opt, cut_loader = private(secure, DDP(make_model()), full, mode=mode, sigma=1.0, poisson=True)
        physical = 0
        with BatchMemoryManager(data_loader=cut_loader, max_physical_batch_size=2, optimizer=cut_opt) as batches:
            for x, y in batches:
                physical += 1
                train_steps(cut_model, cut_opt, [(x, y)])
        results[mode, "physical"] = dict(count=physical, steps=cut_opt.steps, params=params_of(cut_model.module),
                                         epsilon=secure.get_epsilon(1e-5))

        checkpoint = os.path.join(out_dir, f"checkpoint_{mode}.pt")
        if rank == 0:
            engine.save_checkpoint(path=checkpoint, module=model, optimizer=opt)
        dist.barrier()
        # every rank loads rank 0's file into a fresh engine and model
        engine = PrivacyEngine()
        model, opt, _ = private(engine, DDP(make_model()), full, mode=mode, sigma=1.0, poisson=True)
        engine.load_checkpoint(path=checkpoint, module=model, optimizer=opt)
        results[mode, "reloaded"] = dict(epsilon=engine.get_epsilon(1e-5), params=params_of(model.module))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _wide_dataset():
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(GLOBAL_BATCH, WIDE, generator=g), torch.zeros(GLOBAL_BATCH, dtype=torch.int64))


def _broadcast_start(start):
    """The weights every rank started from: DDP broadcast rank 0's (each rank drew its own)."""
    import torch.distributed as dist

    for t in start.values():
        dist.broadcast(t, src=0)
    return start


# -- the launch ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    return launch_ranks(__file__, out, WORLD, LAUNCH_TIMEOUT_S), out


def single_process(mode, scenario, loss_reduction="mean"):
    """The same training in this process, on the global batches."""
    from fxdp.privacy_engine import PrivacyEngine

    loader = DataLoader(make_dataset(), batch_size=GLOBAL_BATCH)
    gen = torch.Generator().manual_seed(NOISE_SEED) if scenario == "noisy" else None
    model, opt, loader = private(PrivacyEngine(), make_model(), loader, mode=mode, loss_reduction=loss_reduction,
                                 sigma=SIGMA if scenario == "noisy" else 0.0, generator=gen)
    if scenario == "empty":
        r0 = empty_step_batches(0)
        r1 = empty_step_batches(1)
        loader = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(r0, r1)]
    train_steps(model, opt, loader, loss_reduction)
    return params_of(model)


def assert_params_close(a, b, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def assert_params_identical(a, b):
    for name in a:
        assert torch.equal(a[name], b[name]), f"ranks differ in {name}"


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_make_private_replaces_ddp_and_its_optimizer(ranks, mode):
    results, _ = ranks
    assert results[0][mode, "mean", "types"] == ("DPDistributedDataParallel", "DistributedDPOptimizer")
    # DDP's surface: fxdp.report, the sink the optimizer reads, state_dict keys under "module."
    assert results[0][mode, "mean", "surface"] == dict(report=True, sink=True, state_dict_keys=True)


def test_a_model_without_ddp_under_several_processes_is_warned_about(ranks):
    results, _ = ranks
    for r in range(WORLD):
        assert any("not wrapped in DistributedDataParallel" in m and "2 processes" in m
                   for m in results[r]["no_ddp_warnings"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_two_ranks_equal_one_process_on_the_global_batch(ranks, mode, loss_reduction):
    results, _ = ranks
    expected = single_process(mode, "clean", loss_reduction)
    # the model moved (a test of equality between two runs that did nothing would pass too)
    assert max((e - p).abs().max() for e, p in zip(expected.values(), make_model().parameters())) > 1e-2
    for r in range(WORLD):
        assert_params_close(results[r][mode, loss_reduction], expected)
    assert_params_identical(results[0][mode, loss_reduction], results[1][mode, loss_reduction])


@pytest.mark.parametrize("mode", MODES)
def test_noise_is_drawn_once_for_the_global_batch(ranks, mode):
    """Rank 0 draws the noise from the generator; a single process with the same generator and the
    same global batches ends with the same parameters (noise drawn on every rank would not)."""
    results, _ = ranks
    assert_params_identical(results[0][mode, "noisy"], results[1][mode, "noisy"])
    assert_params_close(results[0][mode, "noisy"], single_process(mode, "noisy"), atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_noise_std_is_sigma_c_over_the_global_batch(ranks, mode):
    """The update of a step whose clipped gradients are zero is the noise alone, divided by the
    global expected batch size B = 8: std sigma*C/B, not sqrt(2) times that (noise on both ranks)
    nor twice that (divided by the local batch size). With n = 10,100 coordinates the sample std of
    normals has relative standard error 1/sqrt(2n) = 0.7%; the 4% tolerance is more than 5 of them
    and far from a factor sqrt(2) (41%)."""
    results, _ = ranks
    assert_params_identical(results[0][mode, "noise_update_params_equal"], results[1][mode, "noise_update_params_equal"])
    update = torch.cat([u.flatten() for u in results[0][mode, "noise_update"].values()]).double()
    n = update.numel()
    expected = SIGMA * CLIP / GLOBAL_BATCH
    assert n == WIDE * WIDE + WIDE
    assert abs(update.std().item() / expected - 1) < 0.04
    assert abs(update.mean().item()) < 5 * expected / math.sqrt(n)


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_local_batch_neither_hangs_nor_crashes(ranks, mode):
    results, _ = ranks
    expected = single_process(mode, "empty")
    for r in range(WORLD):
        assert_params_close(results[r][mode, "empty"], expected)


@pytest.mark.parametrize("mode", MODES)
def test_poisson_sampling_across_ranks_uses_the_global_rate(ranks, mode):
    results, _ = ranks
    p0, p1 = results[0][mode, "poisson"], results[1][mode, "poisson"]
    # 40 samples, 2 ranks x batches of 5 -> 4 steps per epoch: q = 1/4 of the global dataset
    assert p0["sample_rate"] == p1["sample_rate"] == 0.25
    assert p0["expected_batch_size"] == p1["expected_batch_size"] == 10
    assert p0["history"] == p1["history"] == [(1.0, 0.25, 4)]
    assert p0["epsilon"] == p1["epsilon"]
    from fxdp.accounting import PLDAccountant

    alone = PLDAccountant()  # the engine's default
    for _ in range(4):
        alone.step(noise_multiplier=1.0, sample_rate=0.25)
    assert p0["epsilon"] == pytest.approx(alone.get_epsilon(1e-5), rel=1e-12)
    # each sample of a step went to at most one rank
    for x0, x1 in zip(p0["seen"], p1["seen"]):
        rows = torch.cat([x0, x1])
        assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    assert_params_identical(p0["params"], p1["params"])


@pytest.mark.parametrize("mode", MODES)
def test_physical_batches_and_secure_noise_across_ranks(ranks, mode):
    """Shares cut into physical batches of 2 (their number differs between ranks, nothing is
    communicated for them), noise from the OS on rank 0: the ranks still step together."""
    r0, r1 = results = [ranks[0][r][mode, "physical"] for r in range(WORLD)]
    assert r0["steps"] == r1["steps"] == 4  # one logical step per Poisson batch
    assert all(r["count"] >= 4 for r in results)
    assert r0["epsilon"] == r1["epsilon"] == ranks[0][0][mode, "poisson"]["epsilon"]
    assert_params_identical(r0["params"], r1["params"])


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_of_rank_0_loads_on_both_ranks(ranks, mode):
    results, _ = ranks
    saved = results[0][mode, "poisson"]
    for r in range(WORLD):
        assert results[r][mode, "reloaded"]["epsilon"] == saved["epsilon"]
        assert_params_identical(results[r][mode, "reloaded"]["params"], saved["params"])


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_of_two_ranks_loads_in_one_process(ranks, mode):
    from fxdp.privacy_engine import PrivacyEngine

    results, out = ranks
    saved = results[0][mode, "poisson"]
    engine = PrivacyEngine()
    loader = DataLoader(make_dataset(40), batch_size=10)
    model, opt, _ = private(engine, make_model(), loader, mode=mode, sigma=1.0, poisson=True)
    engine.load_checkpoint(path=out / f"checkpoint_{mode}.pt", module=model, optimizer=opt)
    assert engine.get_epsilon(1e-5) == saved["epsilon"]
    assert engine.accountant.history == saved["history"]
    assert_params_identical(params_of(model), saved["params"])
    assert type(opt).__name__ == "DPOptimizer" and opt.steps == 4


# -- in this process: a process group of one (world_of_one, tests/distributed/conftest.py) ---------------


def test_without_a_distributed_sampler_each_rank_would_read_the_same_samples(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fxdp.privacy_engine import PrivacyEngine

    with pytest.raises(ValueError, match="DistributedSampler"):
        private(PrivacyEngine(), DDP(make_model()), DataLoader(make_dataset(), batch_size=4), mode="fx")


def test_a_distributed_checkpoint_is_refused_in_the_middle_of_a_logical_batch(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from fxdp.privacy_engine import PrivacyEngine

    ds = make_dataset()
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False))
    model, opt, loader = private(PrivacyEngine(), DDP(make_model()), loader, mode="fx")
    x, y = next(iter(loader))
    opt.signal_skip_step()
    train_steps(model, opt, [(x, y)])
    with pytest.raises(RuntimeError, match="middle of a logical batch"):
        opt.state_dict()
    train_steps(model, opt, [(x, y)])  # the logical step ends: saving works again
    assert opt.state_dict()["fxdp"]["steps"] == 1


def test_a_rank_other_than_0_drops_a_single_process_checkpoints_partial_sum(world_of_one):
    """A checkpoint taken by one process mid-batch holds that batch's clipped sum so far: only rank
    0 keeps it, so the all-reduce adds it once."""
    from fxdp.distributed import DistributedDPOptimizer
    from fxdp.optim import DPOptimizer

    model = make_model()
    alone = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4)
    for p in model.parameters():
        p.grad_sample = torch.ones(2, *p.shape)
    alone.signal_skip_step()
    alone.step()
    saved = alone.state_dict()
    assert all(s is not None for s in saved["fxdp"]["accumulated"])
    for rank in (0, 1):
        opt = DistributedDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                                     max_grad_norm=1.0, expected_batch_size=4)
        opt.rank = rank  # as rank 1 of two would be (the group here has one)
        opt.load_state_dict(saved)
        assert len(opt.step_state.summed) == (len(saved["fxdp"]["accumulated"]) if rank == 0 else 0)
    assert all(s is not None for s in saved["fxdp"]["accumulated"])  # the caller's dict is left as it was


def test_clipped_sums_travel_in_buckets_of_one_dtype_and_bounded_size():
    from fxdp.distributed.optimizer import _buckets

    tensors = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64),
               torch.zeros(5, dtype=torch.float64), torch.zeros(2)]
    assert list(_buckets(tensors, bucket_bytes=100)) == [[0, 1], [2], [3, 4], [5]]
    assert list(_buckets(tensors, bucket_bytes=10**6)) == [[0, 1, 2], [3, 4], [5]]


def test_make_private_refuses_data_parallel_and_a_model_made_private_twice(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from fxdp.privacy_engine import PrivacyEngine

    ds = make_dataset()
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds))
    with pytest.raises(NotImplementedError, match="DataParallel"):
        private(PrivacyEngine(), nn.DataParallel(make_model()), loader, mode="fx")
    model, _, _ = private(PrivacyEngine(), DDP(make_model()), loader, mode="fx")
    with pytest.raises(TypeError, match="already made private"):
        private(PrivacyEngine(), model, loader, mode="fx")


def test_make_private_refuses_fsdp1_and_says_to_use_fully_shard(world_of_one):
    from torch.distributed.fsdp import FullyShardedDataParallel

    from fxdp.privacy_engine import PrivacyEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (FSDP1 switches to NO_SHARD in a world of one)
        model = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"))
    with pytest.raises(NotImplementedError, match=r"FullyShardedDataParallel \(FSDP1.*not supported.*FlatParameter"
                                                  r".*fully_shard\(block, mesh=mesh\)"):
        private(PrivacyEngine(), model, DataLoader(make_dataset(), batch_size=4), mode="fx")


@pytest.mark.parametrize("mode", MODES)
def test_opacus_style_dpddp_around_the_plain_model_trains_as_ddp_does(world_of_one, mode):
    """Opacus's DifferentiallyPrivateDistributedDataParallel(model) before make_private: the same steps as
    DistributedDataParallel(model); around what make_private returned, it is refused (made private twice)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from fxdp.distributed import DPDistributedDataParallel, DistributedDPOptimizer
    from fxdp.privacy_engine import PrivacyEngine

    ds = make_dataset()
    ends = []
    for wrap in (DPDistributedDataParallel, DDP):
        plain = make_model()
        loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False))
        model, opt, loader = private(PrivacyEngine(), wrap(plain), loader, mode=mode)
        assert type(model) is DPDistributedDataParallel and model.is_private
        assert isinstance(opt, DistributedDPOptimizer)
        train_steps(model, opt, list(loader)[:2])
        ends.append([p.detach().clone() for p in plain.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*ends))
    assert not all(torch.equal(a, b) for a, b in zip(ends[0], make_model().parameters()))  # it trained
    with pytest.raises((TypeError, ValueError), match="already made private|already private"):
        private(PrivacyEngine(), model, loader, mode=mode)  # (AlreadyPrivateError while its engine lives)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
