"""fxdp.integrations.accelerate.make_private: DP-SGD through Hugging Face Accelerate, in one process and in two
(gloo, on the CPU), against the plain loop and against an independent computation (each sample alone in float64,
clipped by hand, summed over the global batch, divided by the expected global batch; noise 0). What
``accelerator.prepare`` would break (its loader, the gradient accumulation it skips steps for) is refused.

The two processes are this file run as a script (``python tests/integrations/test_accelerate.py RANK DIR STORE``),
launched as tests/distributed/test_two_ranks.py launches its ranks."""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate")

import fxdp  # noqa: E402
from fxdp.diagnostics import PrivacySettingError  # noqa: E402
from fxdp.integrations.accelerate import check_accelerator, make_private  # noqa: E402
from fxdp.sinks.contract import StepRefusedError  # noqa: E402
from tests.support.ranks import launch_ranks  # noqa: E402

N, BATCH, LR, CLIP, EPOCHS, WORLD = 24, 4, 0.5, 0.3, 2, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g))


def train(model, optimizer, loader, backward=lambda loss: loss.backward(), device="cpu"):
    """The plain loop; returns the batches it trained on."""
    batches = []
    for _ in range(EPOCHS):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            batches.append((x.clone(), y.clone()))
            optimizer.zero_grad()
            backward(F.cross_entropy(model(x), y))
            optimizer.step()
    return batches


def clipped_steps(batches, expected_batch: int) -> nn.Module:
    """The model after -LR * Σ_i clip(g_i) / expected batch for each batch, each g_i from sample i alone."""
    net = make_model()
    params = list(net.parameters())
    for x, y in batches:
        total = [torch.zeros_like(p) for p in params]
        for i in range(x.shape[0]):
            grads = torch.autograd.grad(F.cross_entropy(net(x[i:i + 1]), y[i:i + 1]), params)
            norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
            total = [t + g * min(1.0, CLIP / (norm.item() + 1e-6)) for t, g in zip(total, grads)]
        with torch.no_grad():
            for p, t in zip(params, total):
                p -= LR * t / expected_batch
    return net


def run_with_accelerate(accelerator, noise_multiplier, seed=11):
    model = make_model()
    engine = fxdp.PrivacyEngine()
    private, optimizer, loader = make_private(
        accelerator, engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(dataset(), batch_size=BATCH), noise_multiplier=noise_multiplier, max_grad_norm=CLIP,
        noise_generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)  # the Poisson sampler's generator
    batches = train(private, optimizer, loader, accelerator.backward, accelerator.device)
    return model, optimizer, engine, batches


def test_one_process_equals_the_plain_loop_and_the_clipped_sum():
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer, engine, batches = run_with_accelerate(accelerator, noise_multiplier=0.0)
    assert isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer)
    assert len(batches) == EPOCHS * N // BATCH == len(engine.accountant) and len({len(x) for x, _ in batches}) > 1
    for p, q in zip(model.parameters(), clipped_steps(batches, BATCH).parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10)
    # with noise: the plain loop, same seeds, lands on the same parameters
    noisy, _, noisy_engine, _ = run_with_accelerate(accelerator, noise_multiplier=1.3)
    plain = make_model()
    private, opt, loader = fxdp.PrivacyEngine().make_private(
        module=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=LR),
        data_loader=DataLoader(dataset(), batch_size=BATCH), noise_multiplier=1.3, max_grad_norm=CLIP,
        noise_generator=torch.Generator().manual_seed(11))
    torch.manual_seed(11)
    train(private, opt, loader)
    for p, q in zip(noisy.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    assert noisy_engine.accountant.history == [(1.3, BATCH / N, EPOCHS * N // BATCH)]


def test_a_target_epsilon_is_met_over_the_epochs():
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    engine = fxdp.PrivacyEngine(accountant="rdp")
    private, optimizer, loader = make_private(
        accelerator, engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(dataset(), batch_size=BATCH), target_epsilon=2.0, target_delta=1e-3, epochs=EPOCHS,
        max_grad_norm=CLIP)
    train(private, optimizer, loader, accelerator.backward)
    assert len(engine.accountant) == EPOCHS * N // BATCH and 0.99 * 2.0 <= engine.get_epsilon(1e-3) <= 2.0


def test_save_state_and_load_state_carry_the_accountant_the_model_and_the_optimizer(tmp_path):
    first = accelerate.Accelerator(cpu=True)
    trained, trained_optimizer, engine, _ = run_with_accelerate(first, noise_multiplier=1.3)
    first.save_state(str(tmp_path / "state"))
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    again = fxdp.PrivacyEngine()
    _, optimizer, _ = make_private(
        accelerator, again, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(dataset(), batch_size=BATCH), noise_multiplier=1.3, max_grad_norm=CLIP)
    assert len(again.accountant) == 0
    accelerator.load_state(str(tmp_path / "state"))
    assert again.accountant.history == engine.accountant.history == [(1.3, BATCH / N, EPOCHS * N // BATCH)]
    assert optimizer.optimizer.steps == trained_optimizer.optimizer.steps == EPOCHS * N // BATCH
    for p, q in zip(model.parameters(), trained.parameters()):
        assert torch.equal(p, q)


def test_fxdps_loader_through_accelerator_prepare_is_refused_at_the_first_step():
    """accelerator.prepare rebuilds the Poisson loader as a DataLoaderShard, which no longer tells the optimizer its
    batches: the DP optimizer refuses the step, before anything moves."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    engine = fxdp.PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(dataset(), batch_size=BATCH), noise_multiplier=1.0, max_grad_norm=CLIP)
    private, optimizer, loader = accelerator.prepare(private, optimizer, loader)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StepRefusedError, match="optimizer.step.. without a batch from the data loader make_private"):
        train(private, optimizer, loader, accelerator.backward)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and len(engine.accountant) == 0
    with pytest.raises(PrivacySettingError, match="do not pass it through accelerator.prepare first"):
        make_private(accelerator, fxdp.PrivacyEngine(), module=make_model(), optimizer=optimizer,
                     data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)


def test_gradient_accumulation_is_refused_before_anything_moves():
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = 2
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacySettingError, match="gradient_accumulation_steps=2: Accelerate would skip"):
        make_private(accelerator, fxdp.PrivacyEngine(), module=model,
                     optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                     data_loader=DataLoader(dataset(), batch_size=BATCH), noise_multiplier=1.0, max_grad_norm=1.0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    accelerator.gradient_accumulation_steps = 1


def test_mixed_precision_and_sharding_are_refused():
    """check_accelerator reads the accelerator's public settings (a stand-in here: Accelerate keeps one global
    state per process, which a test cannot switch to bf16 without resetting it)."""
    class Settings:
        gradient_accumulation_steps, mixed_precision = 1, "bf16"
        distributed_type = accelerate.DistributedType.FSDP

    with pytest.raises(PrivacySettingError) as info:
        check_accelerator(Settings())
    assert "mixed_precision='bf16': not verified" in str(info.value)
    assert "distributed_type=DistributedType.FSDP: fxdp trains in one process or with DDP" in str(info.value)


def test_two_processes_with_gloo_equal_one_process_on_the_global_batch(tmp_path):
    ranks = launch_ranks(__file__, tmp_path, WORLD, timeout_s=240)
    assert [r["distributed_type"] for r in ranks] == ["MULTI_CPU"] * WORLD
    assert [r["types"] for r in ranks] == [("DPDistributedDataParallel", "AcceleratedOptimizer")] * WORLD
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name  # the ranks agree
    steps = len(ranks[0]["batches"])
    assert steps == EPOCHS * N // (WORLD * BATCH) == len(ranks[1]["batches"]) == ranks[0]["accountant_steps"]
    global_batches = [(torch.cat([x0, x1]), torch.cat([y0, y1]))
                      for (x0, y0), (x1, y1) in zip(ranks[0]["batches"], ranks[1]["batches"])]
    assert sum(len(x) for x, _ in global_batches) > 0
    expected = dict(clipped_steps(global_batches, WORLD * BATCH).named_parameters())
    moved = False
    for name, p in ranks[0]["params"].items():
        torch.testing.assert_close(p, expected[name].detach(), atol=1e-12, rtol=1e-10, msg=name)
        moved |= not torch.equal(p, dict(make_model().named_parameters())[name])
    assert moved


def _rank_main(rank: int, out_dir: str, store: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    # Accelerate reads the launch from these (as torchrun sets them); the process group is already up
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    engine = fxdp.PrivacyEngine()
    private, optimizer, loader = make_private(
        accelerator, engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(dataset(), batch_size=BATCH), noise_multiplier=0.0, max_grad_norm=CLIP)
    batches = train(private, optimizer, loader, accelerator.backward, accelerator.device)
    torch.save(dict(distributed_type=str(accelerator.distributed_type).split(".")[-1],
                    types=(type(private).__name__, type(optimizer).__name__), batches=batches,
                    params={k: v.detach().clone() for k, v in model.named_parameters()},
                    accountant_steps=len(engine.accountant)), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
