"""Correlated noise (banded MF, BLT) across processes: two ranks on localhost with gloo, under DDP and under FSDP2,
against one process with the same seeds, in float64.

One launch of two ranks (this file run as a script: ``python tests/distributed/test_correlated_noise.py RANK DIR
STORE``) runs every scenario and saves what each rank ends with; the tests compare it with one-process runs done
here. The loader's seed is the same everywhere: rank 0 draws the shared sampling seed from it, so the one-process
reference gets a loader seeded with that draw, and its batches are the union of the ranks' shares.
"""

from __future__ import annotations

import datetime
import functools
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
LOCAL_BATCH, GLOBAL_BATCH = 4, 8
SAMPLES = 48  # 6 batches a pass
FEATURES, CLASSES = 6, 5  # 5 rows: the last layer's shards are uneven under FSDP2 (3 and 2 rows)
SIGMA, CLIP, LR = 1.3, 0.7, 0.2
LOADER_SEED, NOISE_SEED = 11, 1234
BANDS = 3
BLT = dict(theta=[0.9, 0.4], omega=[0.3, 0.2])  # within the bounds of fxdp's BLT sensitivity
PASSES = 2
LAUNCH_TIMEOUT_S = 300  # far above a normal run; only a hang reaches it


# -- what both sides run -----------------------------------------------------------------------------


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES)).double()


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64),
                         torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def mechanism(kind: str):
    from fxdp.optim.correlated import BandedMatrixFactorization, BufferedLinearToeplitz

    if kind == "banded":
        return BandedMatrixFactorization(BANDS)
    return BufferedLinearToeplitz(BLT["theta"], BLT["omega"], steps=PASSES * SAMPLES // GLOBAL_BATCH,
                                  min_separation=SAMPLES // GLOBAL_BATCH)


def private(engine, model, loader, kind, noise_seed=NOISE_SEED):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA,
                               max_grad_norm=CLIP, noise_mechanism=mechanism(kind),
                               noise_generator=torch.Generator().manual_seed(noise_seed))


def train_pass(model, optimizer, loader, seen=None):
    for x, y in loader:
        if seen is not None:
            seen.append(rows_of(x))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward() if len(y) else model(x).sum().backward()
        optimizer.step()


def rows_of(x: torch.Tensor):
    """The dataset indices of a batch's rows (each row of the dataset is unique)."""
    data = make_dataset().tensors[0]
    return sorted((x[:, None, :] == data[None]).all(-1).nonzero()[:, 1].tolist())


def full_params(model: nn.Module):
    model = getattr(model, "module", model)
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def shared_sampling_seed() -> int:
    """The seed the ranks sample from: rank 0's draw from the loader's generator (fxdp.data.loader)."""
    return int(torch.randint(0, 2 ** 62, (1,), generator=torch.Generator().manual_seed(LOADER_SEED)).item())


# -- the ranks ---------------------------------------------------------------------------------------


def _rank_main(rank: int, out_dir: str, store: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from fxdp.privacy_engine import PrivacyEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=90))
    mesh = init_device_mesh("cpu", (WORLD,))
    ds = make_dataset()

    def loader():
        return DataLoader(ds, batch_size=LOCAL_BATCH, sampler=DistributedSampler(ds, shuffle=False),
                          generator=torch.Generator().manual_seed(LOADER_SEED))

    def wrapped(parallel):
        model = make_model()
        if parallel == "ddp":
            return DDP(model)
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        return fully_shard(model, mesh=mesh)

    results = {}
    warnings.simplefilter("ignore")
    for parallel in ("ddp", "fsdp"):
        for kind in ("banded", "blt"):
            engine = PrivacyEngine()
            model, opt, dp_loader = private(engine, wrapped(parallel), loader(), kind)
            seen = []
            train_pass(model, opt, dp_loader, seen)
            memory = opt.noise_mechanism.memory_bytes()
            path = f"{out_dir}/{parallel}.pt"
            if kind == "banded":  # a checkpoint after the first pass, with the loader's sampling generator
                sampling = dp_loader.batch_sampler.generator.get_state()
                if parallel == "fsdp" or rank == 0:  # (FSDP2: a collective, rank 0 writes; DDP: rank 0 saves)
                    engine.save_checkpoint(path=path, module=model, optimizer=opt)
                dist.barrier()
            train_pass(model, opt, dp_loader, seen)
            results[parallel, kind] = dict(params=full_params(model), seen=seen, memory=memory,
                                           epsilon=engine.get_epsilon(1e-5), steps=opt.noise_mechanism.steps,
                                           types=(type(model).__name__, type(opt).__name__))
        # resumed from the checkpoint in a fresh engine, model and optimizer (the loader's sampling generator carried
        # over, so the second pass draws the same batches): the same parameters
        engine = PrivacyEngine()
        model, opt, dp_loader = private(engine, wrapped(parallel), loader(), "banded", noise_seed=99)
        engine.load_checkpoint(path=path, module=model, optimizer=opt)
        dp_loader.batch_sampler.generator.set_state(sampling)
        train_pass(model, opt, dp_loader)
        results[parallel, "resumed"] = dict(params=full_params(model), epsilon=engine.get_epsilon(1e-5))
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


# -- the launch ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("correlated_ranks")
    return out, launch_ranks(__file__, out, WORLD, LAUNCH_TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def one_process(kind: str, passes: int = PASSES, noise_seed: int = NOISE_SEED):
    """The same training in this process: a loader of the global batch size sampling from the ranks' shared seed
    (run once per arguments; the tests only read what it returns)."""
    from fxdp.privacy_engine import PrivacyEngine

    engine = PrivacyEngine()
    loader = DataLoader(make_dataset(), batch_size=GLOBAL_BATCH, generator=torch.Generator().manual_seed(
        shared_sampling_seed()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, dp_loader = private(engine, make_model(), loader, kind, noise_seed=noise_seed)
    seen = []
    for _ in range(passes):
        train_pass(model, opt, dp_loader, seen)
    return dict(params=full_params(model), seen=seen, epsilon=engine.get_epsilon(1e-5), optimizer=opt)


def assert_params_close(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-12, rtol=1e-10, msg=lambda m: f"{name}: {m}")


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_two_ranks_train_as_one_process_with_the_same_seeds(ranks, parallel, kind):
    """The ranks' shares of each step make up the batch one process draws (each sample on one rank), and the
    parameters after two passes (12 steps, momentum) equal one process's: the same correlated noise, added once."""
    _, results = ranks
    expected = one_process(kind)
    start = full_params(make_model())
    assert max((expected["params"][k] - start[k]).abs().max() for k in start) > 1e-2  # the model moved
    for r in range(WORLD):
        got = results[r][parallel, kind]
        assert got["types"][1] == ("DistributedDPOptimizer" if parallel == "ddp" else "FullyShardedDPOptimizer")
        assert_params_close(got["params"], expected["params"])
        assert got["steps"] == 2 * SAMPLES // GLOBAL_BATCH and got["epsilon"] == expected["epsilon"]
    for step, batch in enumerate(expected["seen"]):
        share0, share1 = results[0][parallel, kind]["seen"][step], results[1][parallel, kind]["seen"][step]
        assert all(i % 2 == 0 for i in share0) and all(i % 2 == 1 for i in share1)
        assert sorted(share0 + share1) == batch
    assert sum(map(len, expected["seen"])) > 0


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_match_needs_the_same_noise(ranks, parallel):
    """One process whose noise generator is seeded otherwise ends far from the ranks: the equality above holds
    because the ranks add one process's noise, not because the noise is too small to see."""
    _, results = ranks
    other = one_process("banded", noise_seed=99)["params"]
    params = results[0][parallel, "banded"]["params"]
    assert max((params[k] - other[k]).abs().max() for k in params) > 1e-2


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_ddp_keeps_the_state_on_rank_0_and_fsdp_each_ranks_rows(ranks, kind):
    """DDP: rank 0 adds the noise and holds the mechanism's state, the other rank holds none. FSDP2: each rank holds
    its shard's rows only (Linear(6, 8) and Linear(8, 5) split 4+4 and 3+2 rows): the state of one process, split."""
    _, results = ranks
    alone = one_process(kind, passes=1)["optimizer"].noise_mechanism.memory_bytes()
    copies = BANDS - 1 if kind == "banded" else len(BLT["theta"])
    params = sum(p.numel() for p in make_model().parameters())
    assert alone == copies * params * 8  # float64
    assert results[0]["ddp", kind]["memory"] == alone and results[1]["ddp", kind]["memory"] == 0
    rows0 = 4 * 6 + 4 + 3 * 8 + 3  # rank 0's shards
    assert results[0]["fsdp", kind]["memory"] == copies * rows0 * 8
    assert results[0]["fsdp", kind]["memory"] + results[1]["fsdp", kind]["memory"] == alone


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_checkpoint_resumes_bit_for_bit(ranks, parallel):
    """Stopped after a pass and resumed from the checkpoint (a fresh engine, model and optimizer whose noise
    generator is seeded otherwise): the parameters after the second pass equal the straight run's exactly."""
    _, results = ranks
    for r in range(WORLD):
        straight, resumed = results[r][parallel, "banded"], results[r][parallel, "resumed"]
        assert all(torch.equal(straight["params"][k], resumed["params"][k]) for k in straight["params"])
        assert resumed["epsilon"] == straight["epsilon"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_checkpoint_holds_one_processs_noise_state_and_loads_in_one_process(ranks, parallel):
    """The file (rank 0's under DDP; FSDP2's gathered from the shards) holds the noise state one process holds after
    the same pass, bit for bit, and resumes in one process to the same parameters as the ranks."""
    from fxdp.privacy_engine import PrivacyEngine

    out, results = ranks
    saved = torch.load(out / f"{parallel}.pt", weights_only=True)["optimizer_state_dict"]
    alone = one_process("banded", passes=1)["optimizer"].state_dict()["fxdp"]["noise_mechanism"]
    history = saved["fxdp"]["noise_mechanism"]["state"]["history"]
    assert len(history) == BANDS - 1
    for mine, theirs in zip(history, alone["state"]["history"]):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    engine = PrivacyEngine()
    loader = DataLoader(make_dataset(), batch_size=GLOBAL_BATCH, generator=torch.Generator().manual_seed(
        shared_sampling_seed()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, dp_loader = private(engine, make_model(), loader, "banded", noise_seed=99)
    train_pass(model, opt, dp_loader)  # (the first pass's batches drawn, so the second pass's come next)
    engine.load_checkpoint(path=out / f"{parallel}.pt", module=model, optimizer=opt)
    train_pass(model, opt, dp_loader)
    assert_params_close(full_params(model), results[0][parallel, "banded"]["params"])


# -- in this process: a mesh of one ----------------------------------------------------------------------


def test_a_mesh_of_one_trains_as_one_process(mesh_of_one):
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data.distributed import DistributedSampler

    from fxdp.privacy_engine import PrivacyEngine

    ds = make_dataset()
    ends = []
    for sharded in (True, False):
        model = make_model()
        if sharded:
            fully_shard(model, mesh=mesh_of_one)
        sampler = DistributedSampler(ds, shuffle=False) if sharded else None
        # (one rank: its sampling seed is its draw from the loader's generator, as the one process is given)
        seed = LOADER_SEED if sharded else shared_sampling_seed()
        loader = DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=sampler, generator=torch.Generator().manual_seed(seed))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, dp_loader = private(PrivacyEngine(), model, loader, "blt")
        train_pass(model, opt, dp_loader)
        ends.append(full_params(model))
    assert_params_close(ends[0], ends[1])


def test_a_state_saved_by_a_rank_that_adds_no_noise_is_refused():
    """Under DDP only rank 0 holds the noise state; another rank's (whose steps advanced without it) must not resume
    a run: its noise would not continue the correlation."""
    other, fresh = mechanism("banded"), mechanism("banded")
    other.follow_cycle(lambda: other.steps % BANDS, BANDS)
    for _ in range(2):
        other.advance_()
    assert other.steps == 2 and other.memory_bytes() == 0
    with pytest.raises(ValueError, match="saved by a process that does not add the noise .* Save the checkpoint on "
                                         "rank 0"):
        fresh.load_state_dict(other.state_dict())


def test_an_optimizer_overriding_the_noise_path_of_ddp_is_refused(mesh_of_one):
    from fxdp.distributed import DistributedDPOptimizer
    from fxdp.sinks.contract import PrivacySettingError

    class OwnReduce(DistributedDPOptimizer):
        def _reduce(self, noised_sums):
            return noised_sums

    model = make_model()
    with pytest.raises(PrivacySettingError, match=r"OwnReduce forms or adds its noise its own way \(_reduce\)"):
        OwnReduce(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                  expected_batch_size=4, noise_mechanism=mechanism("banded"))


def test_a_mechanism_without_support_across_processes_is_refused(mesh_of_one):
    from fxdp.distributed import DistributedDPOptimizer
    from fxdp.optim.correlated import BandedMatrixFactorization
    from fxdp.sinks.contract import PrivacySettingError

    class OneProcessOnly(BandedMatrixFactorization):
        name = "one_process_only"
        across_processes = False

    model = make_model()
    with pytest.raises(PrivacySettingError, match="'one_process_only' noise mechanism does not support training "
                                                  "across processes \\(DistributedDPOptimizer\\)"):
        DistributedDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                               expected_batch_size=4, noise_mechanism=OneProcessOnly(2))


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
