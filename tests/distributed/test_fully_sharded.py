"""Private training of a model sharded with FSDP2 (``fully_shard``): two processes on localhost with gloo
against one process on the same global batch.

One launch of two ranks (this file run as a script: ``python tests/distributed/test_fully_sharded.py RANK DIR
STORE``) runs every scenario below and saves the gathered parameters (``full_tensor()``) each rank ends with;
the tests compare them with single-process runs done here (the compiled graph, book-kept).
"""

from __future__ import annotations

import datetime
import math
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
STEPS = 3
FEATURES, CLASSES = 6, 5  # 5 rows: the last layer's shards are uneven (3 and 2 rows)
VOCAB, DIM, TOKENS = 11, 8, 5
SIGMA, CLIP = 1.3, 0.7
NOISE_SEED = 1234
WIDE = 100  # the noise scenario's Linear(WIDE, WIDE): 10,100 coordinates
LAUNCH_TIMEOUT_S = 240  # far above a normal run; only a hang reaches it


# -- what both sides run -----------------------------------------------------------------------------


class TiedTransformer(nn.Module):
    """An embedding, one transformer block, and an output layer tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.block(self.embed(x))[:, -1])


class Block(nn.Module):
    """A unit of the user's own class: torch.fx traces into it (through its ``__call__``), FSDP's hooks on it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(FEATURES, 8), nn.Linear(8, CLASSES)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "transformer":
        return TiedTransformer()
    if kind == "residual":
        return Residual()
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, CLASSES))
    if kind == "frozen":
        model[2].requires_grad_(False)
    return model


def units_of(model: nn.Module):
    """The blocks each rank shards separately before the root."""
    if isinstance(model, Residual):
        return list(model.blocks)
    return [model.block] if isinstance(model, TiedTransformer) else [model[0], model[2], model[4]]


def make_dataset(kind: str, n: int = STEPS * GLOBAL_BATCH) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if kind == "transformer":
        return TensorDataset(torch.randint(0, VOCAB, (n, TOKENS), generator=g),
                             torch.randint(0, VOCAB, (n,), generator=g))
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def bounds(kind: str, clipping: str):
    if clipping == "flat":
        return CLIP
    return [CLIP / 2] * sum(1 for p in make_model(kind).parameters() if p.requires_grad)


def private(engine, model, loader, *, kind, clipping="flat", reduction="mean", sigma=0.0, generator=None,
            poisson=False, lr=0.5, momentum=0.9, flat_bound=False):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=momentum)
    return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
                               max_grad_norm=CLIP if flat_bound else bounds(kind, clipping),
                               clipping=clipping, poisson_sampling=poisson, loss_reduction=reduction,
                               noise_generator=generator)


def train_steps(model, optimizer, batches, reduction="mean", zero_loss=False, grads_before_step=None):
    for x, y in batches:
        optimizer.zero_grad()
        out = model(x)
        if zero_loss:
            loss = (out * 0).sum()  # per-sample gradients of zero: the update is the noise alone
        elif len(y):
            loss = F.cross_entropy(out, y, reduction=reduction)
        else:  # an empty share: the rank still runs forward and backward (FSDP gathers) and steps
            loss = out.sum()
        loss.backward()
        if grads_before_step is not None:
            grads_before_step.append([p.grad is None for p in model.parameters()])
        optimizer.step()


def full_params(model: nn.Module):
    model = getattr(model, "module", model)  # (what make_private returns: the model is its .module)
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def empty_share_batches(kind: str, rank: int):
    """Rank 1 gets no sample in the second step; rank 0 gets its usual share."""
    x, y = make_dataset(kind).tensors
    out = []
    for step in range(STEPS):
        rows = torch.arange(step * GLOBAL_BATCH + rank, (step + 1) * GLOBAL_BATCH, WORLD)
        if rank == 1 and step == 1:
            rows = rows[:0]
        out.append((x[rows], y[rows]))
    return out


CASES = [("mlp", "mean", "flat"), ("mlp", "sum", "flat"), ("mlp", "mean", "per_layer"),
         ("transformer", "mean", "flat"), ("transformer", "sum", "per_layer"), ("frozen", "mean", "flat"),
         ("residual", "mean", "flat")]


# -- the ranks ---------------------------------------------------------------------------------------


def _rank_main(rank: int, out_dir: str, store: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data.distributed import DistributedSampler

    import fxdp
    from fxdp.privacy_engine import PrivacyEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=90))
    mesh = init_device_mesh("cpu", (WORLD,))

    def sharded(model):
        for unit in units_of(model):
            fully_shard(unit, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def loader_of(ds):
        return DataLoader(ds, batch_size=LOCAL_BATCH, sampler=DistributedSampler(ds, shuffle=False))

    results = {}
    for kind, reduction, clipping in CASES:
        grads_seen = []
        model, opt, loader = private(PrivacyEngine(), sharded(make_model(kind)), loader_of(make_dataset(kind)),
                                     kind=kind, clipping=clipping, reduction=reduction)
        train_steps(model, opt, loader, reduction, grads_before_step=grads_seen)
        results[kind, reduction, clipping] = full_params(model)
        results[kind, reduction, clipping, "fsdp grads"] = grads_seen
        results[kind, reduction, clipping, "types"] = (type(model).__name__, type(opt).__name__)
        if kind == "transformer" and clipping == "flat":
            results["report"] = str(fxdp.report(model))

    # each share cut into two physical batches (a skip step between them): the same logical steps
    model, opt, loader = private(PrivacyEngine(), sharded(make_model("mlp")), loader_of(make_dataset("mlp")),
                                 kind="mlp")
    for x, y in loader:
        opt.zero_grad()
        for half, last in ((slice(0, 1), False), (slice(1, None), True)):
            F.cross_entropy(model(x[half]), y[half]).backward()
            if not last:
                opt.signal_skip_step()
            opt.step()
    results["physical"] = full_params(model)

    for kind in ("mlp", "transformer"):  # the noise of one process, drawn by every rank, each keeping its rows
        gen = torch.Generator().manual_seed(NOISE_SEED)
        model, opt, loader = private(PrivacyEngine(), sharded(make_model(kind)), loader_of(make_dataset(kind)),
                                     kind=kind, sigma=SIGMA, generator=gen)
        train_steps(model, opt, loader)
        results[kind, "noisy"] = full_params(model)

    torch.manual_seed(100 + rank)  # (the starting weights: rank 0's are broadcast)
    wide = nn.Linear(WIDE, WIDE)
    with torch.no_grad():
        for p in wide.parameters():
            dist.broadcast(p, src=0)
    start = full_params(wide)
    g = torch.Generator().manual_seed(2)
    wide_ds = TensorDataset(torch.randn(GLOBAL_BATCH, WIDE, generator=g), torch.zeros(GLOBAL_BATCH, dtype=torch.int64))
    fully_shard(wide, mesh=mesh)
    # secure mode: each rank draws from the OS, keeps its rows: every element's noise still drawn once
    model, opt, loader = private(PrivacyEngine(secure_mode=True), wide, loader_of(wide_ds), kind="mlp", sigma=SIGMA,
                                 lr=1.0,
                                 momentum=0.0, flat_bound=True)
    train_steps(model, opt, [next(iter(loader))], zero_loss=True)
    results["noise update"] = {k: full_params(model)[k] - v for k, v in start.items()}

    model, opt, _ = private(PrivacyEngine(), sharded(make_model("mlp")), loader_of(make_dataset("mlp")), kind="mlp")
    train_steps(model, opt, empty_share_batches("mlp", rank))
    results["empty"] = full_params(model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the Poisson figure's warning does not apply: Poisson sampling)
        engine = PrivacyEngine()
        ds = make_dataset("mlp", 40)
        model, opt, loader = private(engine, sharded(make_model("residual")),
                                     DataLoader(ds, batch_size=5, sampler=DistributedSampler(ds)), kind="residual",
                                     sigma=1.0, poisson=True)
        seen = []
        for x, y in loader:
            seen.append(x)
            train_steps(model, opt, [(x, y)])
        results["poisson"] = dict(epsilon=engine.get_epsilon(1e-5), history=list(engine.accountant.history),
                                  seen=seen, sample_rate=loader.sample_rate,
                                  expected_batch_size=opt.expected_batch_size, params=full_params(model))
        with torch.no_grad():  # an evaluation: FSDP leaves the root's own parameters (stem, head) gathered
            model(ds.tensors[0][:3])
        checkpoint = f"{out_dir}/checkpoint.pt"
        engine.save_checkpoint(path=checkpoint, module=model, optimizer=opt)  # every rank: shards gathered
        dist.barrier()
        again = PrivacyEngine()
        model2, opt2, _ = private(again, sharded(make_model("residual")),
                                  DataLoader(ds, batch_size=5, sampler=DistributedSampler(ds)), kind="residual",
                                  sigma=1.0, poisson=True)
        again.load_checkpoint(path=checkpoint, module=model2, optimizer=opt2)
        results["reloaded"] = dict(epsilon=again.get_epsilon(1e-5), params=full_params(model2), steps=opt2.steps)
        # one more step without noise on both: the momentum buffers came back too
        x, y = empty_share_batches("mlp", rank)[0]
        for m, o in ((model, opt), (model2, opt2)):
            o.noise_multiplier = 0.0
            o.observe_batch(empty=False)  # (as the Poisson loader does: the same batch for both here)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        results["after reload"] = (full_params(model), full_params(model2))
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


# -- the launch ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_ranks(__file__, tmp_path_factory.mktemp("fsdp_ranks"), WORLD, LAUNCH_TIMEOUT_S)


def single_process(kind, reduction="mean", clipping="flat", *, batches=None, sigma=0.0):
    """The same training in this process, on the global batches (the compiled graph, book-kept)."""
    from fxdp.privacy_engine import PrivacyEngine

    loader = DataLoader(make_dataset(kind), batch_size=GLOBAL_BATCH)
    gen = torch.Generator().manual_seed(NOISE_SEED) if sigma else None
    model, opt, loader = private(PrivacyEngine(), make_model(kind), loader, kind=kind, clipping=clipping,
                                 reduction=reduction, sigma=sigma, generator=gen)
    train_steps(model, opt, batches if batches is not None else loader, reduction)
    return full_params(model)


def assert_params_close(a, b, atol=1e-5, rtol=1e-4):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,reduction,clipping", CASES)
def test_two_sharded_ranks_equal_one_process_on_the_global_batch(ranks, kind, reduction, clipping):
    expected = single_process(kind, reduction, clipping)
    start = full_params(make_model(kind))
    # the model moved (equality of two runs that did nothing would pass too), by more than half a step: a sum
    # averaged over the 2 ranks (FSDP's default) or counted twice would not match
    assert max((expected[k] - start[k]).abs().max() for k in start) > 1e-2
    for r in range(WORLD):
        assert_params_close(ranks[r][kind, reduction, clipping], expected)
    assert ranks[0][kind, reduction, clipping, "types"] == ("DPFullyShardedModule", "FullyShardedDPOptimizer")
    if kind == "frozen":
        for r in range(WORLD):
            assert torch.equal(ranks[r][kind, reduction, clipping]["2.weight"], start["2.weight"])


def test_shares_cut_into_physical_batches_make_the_same_steps(ranks):
    for r in range(WORLD):
        assert_params_close(ranks[r]["physical"], ranks[r]["mlp", "mean", "flat"])


def test_fsdps_own_reduce_scatter_of_unclipped_gradients_is_off(ranks):
    """After backward (before the DP step) no sharded parameter has a gradient: FSDP reduced none, so
    nothing averaged and unclipped reaches the update, and its communication is saved."""
    for r in range(WORLD):
        for kind, reduction, clipping in CASES:
            seen = ranks[r][kind, reduction, clipping, "fsdp grads"]
            assert len(seen) == STEPS and all(all(step) for step in seen), (kind, seen)


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_noise_drawn_by_every_rank_and_sliced_equals_one_process(ranks, kind):
    """With one seed everywhere each rank keeps its rows of the noise one process draws: the gathered
    parameters equal one process's with the same generator (noise added on both ranks to every row would not)."""
    expected = single_process(kind, sigma=SIGMA)
    for r in range(WORLD):
        assert_params_close(ranks[r][kind, "noisy"], expected)


def test_noise_std_is_sigma_c_over_the_global_batch(ranks):
    """The update of a step whose clipped gradients are zero is the noise alone, divided by the global
    expected batch size B = 8: std sigma*C/B (each rank drawing from its own source, keeping its rows),
    not sqrt(2) times that (noise added twice) nor twice that (divided by the local batch size); noise drawn in
    secure mode, from each rank's OS source. With
    n = 10,100 coordinates the relative standard error of the sample std is 0.7%; the tolerance is 4%."""
    update = torch.cat([u.flatten() for u in ranks[0]["noise update"].values()]).double()
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["noise update"].values(), ranks[1]["noise update"].values()))
    n = update.numel()
    expected = SIGMA * CLIP / GLOBAL_BATCH
    assert n == WIDE * WIDE + WIDE
    assert abs(update.std().item() / expected - 1) < 0.04
    assert abs(update.mean().item()) < 5 * expected / math.sqrt(n)


def test_an_empty_share_neither_hangs_nor_crashes(ranks):
    r0, r1 = empty_share_batches("mlp", 0), empty_share_batches("mlp", 1)
    batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(r0, r1)]
    expected = single_process("mlp", batches=batches)
    for r in range(WORLD):
        assert_params_close(ranks[r]["empty"], expected)


def test_poisson_sampling_of_shares_and_the_same_epsilon_on_every_rank(ranks):
    p0, p1 = ranks[0]["poisson"], ranks[1]["poisson"]
    assert p0["sample_rate"] == p1["sample_rate"] == 0.25  # 40 samples, 2 ranks x batches of 5: 4 steps
    assert p0["expected_batch_size"] == p1["expected_batch_size"] == 10
    assert p0["history"] == p1["history"] == [(1.0, 0.25, 4)]
    assert p0["epsilon"] == p1["epsilon"]
    for x0, x1 in zip(p0["seen"], p1["seen"]):  # each sample of a step went to one rank
        rows = torch.cat([x0, x1])
        assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    for name in p0["params"]:
        assert torch.equal(p0["params"][name], p1["params"][name])


def test_a_sharded_checkpoint_keeps_epsilon_weights_and_optimizer_state(ranks):
    saved = ranks[0]["poisson"]
    for r in range(WORLD):
        assert ranks[r]["reloaded"]["epsilon"] == saved["epsilon"]
        assert ranks[r]["reloaded"]["steps"] == 4
        for name in saved["params"]:
            assert torch.equal(ranks[r]["reloaded"]["params"][name], saved["params"][name])
        original, reloaded = ranks[r]["after reload"]
        assert_params_close(original, reloaded, atol=1e-7, rtol=1e-6)
        assert any(not torch.equal(original[k], saved["params"][k]) for k in original)  # the step moved them


def test_a_sharded_checkpoint_loads_in_one_process(ranks, tmp_path_factory):
    from fxdp.privacy_engine import PrivacyEngine

    saved = ranks[0]["poisson"]
    engine = PrivacyEngine()
    model, _, _ = private(engine, make_model("residual"), DataLoader(make_dataset("mlp", 40), batch_size=10),
                          kind="residual",
                          sigma=1.0, poisson=True)
    path = next(Path(tmp_path_factory.getbasetemp()).glob("fsdp_ranks*/checkpoint.pt"))
    engine.load_checkpoint(path=path, module=model)
    assert engine.get_epsilon(1e-5) == saved["epsilon"]
    for name, p in full_params(model).items():
        assert torch.equal(p, saved["params"][name])


def test_the_report_says_how_the_model_is_sharded_and_which_layers_are_book_kept(ranks):
    text = ranks[0]["report"]
    assert "sharded with FSDP2 (fully_shard): 2 ranks on a 1-D cpu mesh" in text
    assert "2 units: <model>, block" in text
    assert "fallback reason: FSDP2 runs the model (it gathers each unit's parameters" in text
    assert "wrap_model=False" not in text
    assert "head: rule for Linear, book-kept" in text
    assert "embed: rule for Embedding, book-kept" in text


# -- in this process: a mesh of one ---------------------------------------------------------------------


def test_opacus_ghost_fsdp_is_the_default_on_a_fully_shard_model_and_other_engines_are_refused(mesh_of_one):
    from torch.distributed.fsdp import fully_shard

    from torch.utils.data.distributed import DistributedSampler

    from fxdp.privacy_engine import PrivacyEngine

    ds = make_dataset("mlp")
    loader = DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=DistributedSampler(ds, shuffle=False))
    ends = []
    for mode in ("ghost_fsdp", "fx"):
        model = fully_shard(make_model("mlp"), mesh=mesh_of_one)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        model, opt, dp_loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=CLIP,
            poisson_sampling=False, grad_sample_mode=mode)
        train_steps(model, opt, dp_loader)
        ends.append(full_params(model))
    assert_params_close(ends[0], single_process("mlp"))
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    for mode, match in (("ew", "'ew' is not available for a fully_shard model.*'fx'"),
                        ("functorch", "'functorch' is not available for a fully_shard model")):
        model = fully_shard(make_model("mlp"), mesh=mesh_of_one)
        with pytest.raises(ValueError, match=match):
            PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                         data_loader=loader, noise_multiplier=0.0, max_grad_norm=CLIP,
                                         poisson_sampling=False, grad_sample_mode=mode)


def _sharded_with_an_infinite_input(mesh, poisoned_sink=False):
    """A fully_shard MLP made private, after a backward pass over a batch whose sample 2 has an infinite input (its
    per-sample gradient is not finite); ``poisoned_sink``: the sink says it dropped that sample's record and did
    not."""
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data.distributed import DistributedSampler

    from fxdp.privacy_engine import PrivacyEngine

    model = fully_shard(make_model("mlp"), mesh=mesh) if mesh is not None else make_model("mlp")
    x, y = (t[:GLOBAL_BATCH].clone() for t in make_dataset("mlp").tensors)
    x[2, 0] = float("inf")
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=DistributedSampler(ds, shuffle=False) if mesh else None)
    model, opt, _ = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                                 data_loader=loader, noise_multiplier=0.0, max_grad_norm=CLIP,
                                                 poisson_sampling=False)
    if poisoned_sink:
        opt.sink.inner.drop_samples = lambda params, dropped: None
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return model, opt


def test_a_sharded_step_drops_a_non_finite_sample_as_one_process_does(mesh_of_one):
    from fxdp.errors import NonFiniteSampleWarning

    ends = []
    for mesh in (mesh_of_one, None):
        model, opt = _sharded_with_an_infinite_input(mesh)
        with pytest.warns(NonFiniteSampleWarning, match=r"1 of 8 samples \(first: sample 2\)"):
            opt.step()
        ends.append(full_params(model))
    assert_params_close(ends[0], ends[1])
    assert all(bool(torch.isfinite(v).all()) for v in ends[0].values())


def test_a_sharded_step_runs_the_check_after_dropping_samples_as_one_process_does(mesh_of_one):
    """FSDP2's step checks, as one process does, that the clipped sums are finite after non-finite samples were
    dropped (a sink that kept a dropped record), and refuses the step before any gradient is written."""
    from fxdp.errors import NonFiniteSampleWarning

    model, opt = _sharded_with_an_infinite_input(mesh_of_one, poisoned_sink=True)
    before = full_params(model)
    with pytest.warns(NonFiniteSampleWarning, match="1 of 8 samples"), \
            pytest.raises(RuntimeError, match=r"a clipped sum is not finite after .* dropped \(on this rank, rank 0 "
                                              r"of 1 reporting\), so every rank refuses the step"):
        opt.step()
    assert all(p.grad is None for p in model.parameters())
    after = full_params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
