"""User-level DP-SGD across processes (fxdp.distributed.user_level, fxdp.data.user_ranks): two processes on
localhost with gloo, DDP and FSDP2, against one process on the same global batch of users, in float64.

One launch of two ranks (this file run as a script: ``python tests/distributed/test_user_level.py RANK DIR STORE``)
runs every scenario below and saves what each rank ends with, the batches it trained on and the clip factors its
optimizer gave their records; the tests compare them with single-process runs done here and with each user's
clipped average computed one record at a time.
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
FEATURES, CLASSES, VOCAB, TOKENS = 6, 3, 13, 4
COUNTS = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 10]  # records of each user: 48 records, 12 users
K = 4  # max_records_per_user: users with more records bring 4 chosen at random
LOCAL_BATCH = 12  # 48 records / (2 ranks x 12) = 2 steps an epoch: users sampled at q = 1/2
EPOCHS = 2
SIGMA, CLIP = 1.3, 0.7
NOISE_SEED, LOADER_SEED = 1234, 99
LAUNCH_TIMEOUT_S = 300  # far above a normal run; only a hang reaches it


# -- what both sides run -----------------------------------------------------------------------------


def user_ids():
    """Each record's user, the users' records scattered over the dataset."""
    ids = torch.cat([torch.full((c,), u) for u, c in enumerate(COUNTS)])
    return ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(3))].tolist()


def user_of_record():
    """Each record's user as the loader numbers them (in order of first appearance)."""
    ids = user_ids()
    first = {u: j for j, u in enumerate(dict.fromkeys(ids))}
    return [first[u] for u in ids]


class Tokens(nn.Module):
    """An embedding table (its per-user norms from the looked-up rows) and a Linear on (N, T, d)."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(self.embed(x))).mean(1))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = Tokens() if kind == "tokens" else nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))
    return model.double()


def units_of(model: nn.Module):
    return [model.proj] if isinstance(model, Tokens) else [model[0], model[2]]


def make_dataset(kind: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = sum(COUNTS)
    x = torch.randint(0, VOCAB, (n, TOKENS), generator=g) if kind == "tokens" else \
        torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g))


def private(engine, model, loader, *, reduction="mean", clipping="flat", sigma=0.0, mode="fx", ids=None):
    gen = torch.Generator().manual_seed(NOISE_SEED) if sigma else None
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    bound = CLIP if clipping == "flat" else [CLIP / 2] * sum(1 for _ in model.parameters())
    return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
                               max_grad_norm=bound, clipping=clipping, loss_reduction=reduction, noise_generator=gen,
                               grad_sample_mode=mode, privacy_unit="user", user_ids=ids or user_ids(),
                               max_records_per_user=K)


def full_params(model: nn.Module):
    while isinstance(getattr(model, "module", None), nn.Module):  # (what make_private returns, the hooks' wrapper)
        model = model.module
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def records_of(x: torch.Tensor, kind: str) -> list:
    """The dataset indices of a batch's rows (every record of the dataset is distinct)."""
    data = make_dataset(kind).tensors[0]
    return [int((data == row).reshape(len(data), -1).all(1).nonzero()) for row in x]


def train(model, optimizer, loader, *, kind, reduction="mean", spy=False):
    """EPOCHS passes over the loader; with ``spy``, per step: the records, the users told, the clip factors and the
    parameters before the step."""
    seen = []
    if spy:
        factors_of = optimizer._factors

        def factors(params):
            out = factors_of(params)  # one factor per record, for each parameter in the model's order
            seen[-1]["factors"] = [out[p].detach().clone() if p in out else torch.zeros(0) for p in params]
            seen[-1]["users"] = optimizer._user_counts.clone()
            return out

        optimizer._factors = factors
    for _ in range(EPOCHS):
        for x, y in loader:
            if spy:
                seen.append(dict(records=records_of(x, kind), params=full_params(model)))
            optimizer.zero_grad()
            out = model(x)
            # (an empty share: no per-sample gradient, the rank still steps and communicates)
            (F.cross_entropy(out, y, reduction=reduction) if len(y) else out.sum()).backward()
            optimizer.step()
    return seen


# (scenario, kind, reduction, clipping, sigma, engine): "ddp" with the fx and hooks engines, "fsdp" with FSDP2's
SCENARIOS = [("ddp", "mlp", "mean", "flat", 0.0, "fx"), ("ddp", "mlp", "sum", "flat", 0.0, "hooks"),
             ("ddp", "mlp", "mean", "flat", SIGMA, "fx"), ("ddp", "tokens", "sum", "per_layer", 0.0, "fx"),
             ("fsdp", "mlp", "mean", "flat", 0.0, "fx"), ("fsdp", "mlp", "mean", "flat", SIGMA, "fx"),
             ("fsdp", "tokens", "sum", "per_layer", 0.0, "fx")]


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

    def wrapped(how, model):
        if how == "ddp":
            return DDP(model)
        for unit in units_of(model):
            fully_shard(unit, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def loader_of(kind):
        ds = make_dataset(kind)
        return DataLoader(ds, batch_size=LOCAL_BATCH, sampler=DistributedSampler(ds),
                          generator=torch.Generator().manual_seed(LOADER_SEED))

    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for scenario in SCENARIOS:
            how, kind, reduction, clipping, sigma, mode = scenario
            engine = PrivacyEngine()
            model, opt, loader = private(engine, wrapped(how, make_model(kind)), loader_of(kind), reduction=reduction,
                                         clipping=clipping, sigma=sigma, mode=mode)
            seen = train(model, opt, loader, kind=kind, reduction=reduction, spy=sigma == 0)
            results[scenario] = dict(
                params=full_params(model), seen=seen, types=(type(model).__name__, type(opt).__name__),
                seed=loader.batch_sampler.generator.initial_seed(), rank_of_user=loader.rank_of_user,
                sample_rate=loader.sample_rate, expected=opt.expected_batch_size, steps=opt.steps,
                epsilon=engine.get_epsilon(1e-5), unit=engine.privacy_unit)

        # ranks that group the records into other users: refused on every rank, before any step
        ids = user_ids()
        if rank == 1:
            ids[0] = (ids[0] + 1) % len(COUNTS)  # record 0 belongs to another user here
        try:
            private(PrivacyEngine(), wrapped("ddp", make_model("mlp")), loader_of("mlp"), ids=ids)
            results["other users"] = None
        except ValueError as e:
            results["other users"] = str(e)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


# -- the launch ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_ranks(__file__, tmp_path_factory.mktemp("user_ranks"), WORLD, LAUNCH_TIMEOUT_S)


def single_process(kind, reduction, clipping, sigma, mode, seed):
    """The same training in this process, its users drawn from the ranks' shared seed: (params, batches)."""
    from fxdp.privacy_engine import PrivacyEngine

    loader = DataLoader(make_dataset(kind), batch_size=WORLD * LOCAL_BATCH,
                        generator=torch.Generator().manual_seed(seed))
    model, opt, loader = private(PrivacyEngine(), make_model(kind), loader, reduction=reduction, clipping=clipping,
                                 sigma=sigma, mode=mode)
    seen = train(model, opt, loader, kind=kind, reduction=reduction, spy=True)
    return full_params(model), seen


def per_record_gradients(kind, params, records, reduction):
    """Each record's gradient computed alone (a batch of one), in float64, flattened over all parameters."""
    model = make_model(kind)
    model.load_state_dict(params)
    x, y = make_dataset(kind).tensors
    rows = []
    for i in records:
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction=reduction).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows), [p.numel() for p in model.parameters()]


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: "-".join(map(str, s)))
def test_two_ranks_equal_one_process_on_the_same_users(ranks, scenario):
    how, kind, reduction, clipping, sigma, mode = scenario
    r0, r1 = ranks[0][scenario], ranks[1][scenario]
    assert r0["types"] == (("DPDistributedDataParallel", "DistributedUserLevelDPOptimizer") if how == "ddp" else
                           ("DPFullyShardedModule", "FullyShardedUserLevelDPOptimizer"))
    assert r0["seed"] == r1["seed"]
    expected, alone = single_process(kind, reduction, clipping, sigma, mode, r0["seed"])
    start = full_params(make_model(kind))
    assert max((expected[k] - start[k]).abs().max() for k in start) > 1e-2  # it trained
    for r in (r0, r1):
        assert r["sample_rate"] == 0.5 and r["steps"] == len(alone) == EPOCHS * 2
        assert r["expected"] == round(0.5 * len(COUNTS)) == 6  # the GLOBAL expected number of users
        assert r["unit"] == "user" and r["epsilon"] == r0["epsilon"]
        for name in expected:
            torch.testing.assert_close(r["params"][name], expected[name], atol=1e-12, rtol=1e-10,
                                       msg=lambda m: f"{name}: {m}")
    if sigma == 0:  # the global batch is the one process's, user for user
        owners = r0["rank_of_user"]
        ids = user_of_record()
        for step, one in enumerate(alone):
            shares = [ranks[r][scenario]["seen"][step] for r in range(WORLD)]
            assert sorted(shares[0]["records"] + shares[1]["records"]) == sorted(one["records"])
            for r, share in enumerate(shares):
                assert all(int(owners[ids[i]]) == r for i in share["records"])  # each user on its rank only
                assert int(share["users"].sum()) == len(share["records"])
            assert sorted(shares[0]["users"].tolist() + shares[1]["users"].tolist()) == sorted(one["users"].tolist())


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s[4] == 0], ids=lambda s: "-".join(map(str, s)))
def test_each_users_part_is_their_clipped_average_computed_alone(ranks, scenario):
    """On each rank, a user's records' factors times their gradients (each computed alone, float64) add up to the
    user's averaged gradient clipped to C, of norm <= C; flat clipping over all parameters, per-layer clipping
    C/2 for each."""
    how, kind, reduction, clipping, sigma, mode = scenario
    checked = clipped = 0
    for r in range(WORLD):
        for step in ranks[r][scenario]["seen"]:
            if not step["records"]:
                continue
            grads, sizes = per_record_gradients(kind, step["params"], step["records"], reduction)
            # the parts clipped as one: all parameters (flat), or each parameter (per layer)
            bounds = [CLIP] if clipping == "flat" else [CLIP / 2] * len(sizes)
            parts = [slice(0, sum(sizes))] if clipping == "flat" else \
                [slice(sum(sizes[:j]), sum(sizes[:j + 1])) for j in range(len(sizes))]
            start = 0
            for count in step["users"].tolist():
                mine = slice(start, start + count)
                for j, (part, bound) in enumerate(zip(parts, bounds)):
                    average = grads[mine, part].mean(0)
                    expected = average * min(1.0, bound / (average.norm().item() + 1e-6))
                    got = (step["factors"][j][mine, None].double() * grads[mine, part]).sum(0)
                    assert got.norm() <= bound * (1 + 1e-9)
                    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-9)
                    clipped += average.norm().item() > bound * 1.01
                start += count
                checked += 1
    assert checked >= 8  # (users were sampled: the check ran)
    assert clipped  # some user's average exceeded its bound: the clipping itself was checked


def test_users_are_split_between_the_ranks_by_their_records(ranks):
    """The assignment every rank computed: the same on both, 6 users each, and the records per step balanced."""
    owners = [ranks[r][SCENARIOS[0]]["rank_of_user"] for r in range(WORLD)]
    assert torch.equal(owners[0], owners[1])
    loads = torch.bincount(torch.tensor(user_of_record())).clamp(max=K)
    assert sorted(loads.tolist()) == sorted(min(c, K) for c in COUNTS)
    per_rank = [int(loads[owners[0] == r].sum()) for r in range(WORLD)]
    assert [int((owners[0] == r).sum()) for r in range(WORLD)] == [6, 6]
    assert abs(per_rank[0] - per_rank[1]) <= K


def test_ranks_that_hold_other_users_are_refused(ranks):
    for r in range(WORLD):
        message = ranks[r]["other users"]
        assert message is not None and "needs every rank to hold the same users, but rank(s) [1] grouped their " \
                                       "records differently from rank 0" in message
        assert f"this is rank {r}" in message


# -- in this process: a mesh of one ---------------------------------------------------------------------


def test_fsdp2_on_a_mesh_of_one_equals_one_process(mesh_of_one):
    from torch.distributed.fsdp import fully_shard

    from fxdp.privacy_engine import PrivacyEngine

    ends, batches = [], []
    for sharded in (True, False):
        model = make_model("mlp")
        if sharded:
            for unit in units_of(model):
                fully_shard(unit, mesh=mesh_of_one)
            fully_shard(model, mesh=mesh_of_one)
        loader = DataLoader(make_dataset("mlp"), batch_size=24, generator=torch.Generator().manual_seed(5))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = private(PrivacyEngine(), model, loader, sigma=SIGMA)
        if sharded:
            assert type(opt).__name__ == "FullyShardedUserLevelDPOptimizer" and loader.rank_of_user is None
        loader.batch_sampler.generator = torch.Generator().manual_seed(6)  # (sharded: a seed rank 0 broadcast)
        batches.append(train(model, opt, loader, kind="mlp", spy=True))
        ends.append(full_params(model))
    assert [b["records"] for b in batches[0]] == [b["records"] for b in batches[1]]
    for name in ends[0]:
        torch.testing.assert_close(ends[0][name], ends[1][name], atol=1e-12, rtol=1e-10)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
