"""Mixture-of-experts models (top-k routing): a tiny Hugging Face Mixtral built from a config (nothing is
downloaded) and a hand-written top-k MoE block, in the graph engine and the hooks engine.

A sparse MoE block flattens the batch's tokens and picks rows by data, so no batch rule or hook follows
the batch inside it; fxdp trains it as one layer, each sample re-run alone through it
(fxdp/grad_sample/moe.py). Every test compares per-sample gradients with the model run on each sample
alone, in float64. Mixtral's router takes its softmax in float32 (``router_logits.float()``), so its
gradients agree to float32 precision; the hand-written block agrees to float64 precision.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fxdp
from fxdp.grad_sample.moe import moe_block_grad_sampler
from fxdp.grad_sample.registry import find_grad_sampler
from tests.support.per_sample_reference import batch_loss, expected_grad_samples

transformers = pytest.importorskip("transformers")

VOCAB, T, N = 50, 6, 3


def mixtral(experts_implementation: str = "eager", dtype=torch.float64, **config):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=16, use_cache=False, **config)
    model = transformers.MixtralForCausalLM._from_config(cfg, attn_implementation="eager",
                                                         experts_implementation=experts_implementation)
    return model.to(dtype).train()


class Logits(nn.Module):
    """The causal LM's logits as a tensor (what the reference loop projects)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


class TopKMoE(nn.Module):
    """Mixtral's routing written by hand: softmax router, top-k experts per token, the tokens of each
    expert gathered by index and added back with index_add."""

    def __init__(self, d=8, hidden=12, experts=4, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d))
                                     for _ in range(experts))

    def forward(self, x):
        n, t, d = x.shape
        tokens = x.reshape(-1, d)
        weights, chosen = self.router(tokens).softmax(-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(chosen == e)
            if token_idx.numel() == 0:  # data-dependent control flow: neither torch.fx nor torch.export follows it,
                continue  # but a registered block is one layer, which torch.fx calls without tracing into it
            out = out.index_add(0, token_idx, expert(tokens[token_idx]) * weights[token_idx, slot, None])
        return out.reshape(n, t, d)


class MoENet(nn.Module):
    def __init__(self, block=TopKMoE, classes=3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.moe = block()
        self.head = nn.Linear(8, classes)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.moe(h)
        return self.head(h.mean(1))


def moe_net(block=TopKMoE):
    torch.manual_seed(0)
    fxdp.register_moe_block(block)
    return MoENet(block).double()


def tokens(n=N, seed=1):
    return torch.randint(0, VOCAB, (n, T), generator=torch.Generator().manual_seed(seed))


def assert_matches_batches_of_one(model, x, mode, atol, rtol):
    model = copy.deepcopy(model)
    expected, R = expected_grad_samples(model, (x,))
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,), grad_sample_mode=mode)
    batch_loss(compiled(x), R, "mean").backward()
    for name, p in model.named_parameters():
        assert getattr(p, "grad_sample", None) is not None, f"{name} has no grad_sample"
        torch.testing.assert_close(p.grad_sample, expected[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    return compiled


# -- per-sample gradients against batches of one ----------------------------------------------------


@pytest.mark.parametrize("experts_implementation, engine, front_end", [
    ("eager", "hooks", None),  # a loop over the experts hit: torch.export stops at it, the hooks engine takes it
    ("batched_mm", "fx", "torch.export"),
])
@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_mixtral_per_sample_gradients_equal_batches_of_one(experts_implementation, engine, front_end, mode):
    compiled = assert_matches_batches_of_one(Logits(mixtral(experts_implementation)), tokens(), mode,
                                             atol=1e-6, rtol=1e-5)
    report = fxdp.report(compiled)
    assert report.engine == (engine if mode == "fx" else "hooks")
    assert report.front_end == front_end
    assert any("mixture-of-experts: 2 block(s) (MixtralSparseMoeBlock: 'model.model.layers.0.mlp', "
               "'model.model.layers.1.mlp')" in note and "each sample re-run alone" in note for note in report.notes)
    if report.engine == "hooks":
        assert compiled.grad_sample_layers["model.model.layers.0.mlp"].startswith(
            "rule for MixtralSparseMoeBlock: mixture-of-experts")
        assert compiled.verification.startswith("verified")
    else:
        rows = [f.message for f in report.pass_report("per_sample").changes if f.node.endswith("layers_0_mlp")]
        assert len(rows) == 1 and "by the mixture-of-experts (the whole block" in rows[0]


def test_mixtral_grouped_mm_is_folded_to_one_layer_in_the_graph():
    """transformers' default experts implementation (a sort by expert, grouped matmuls) in float32: its
    kernel has no float64 on CPU and no fake-tensor support for float32; the graph engine calls the block as
    one layer."""
    compiled = assert_matches_batches_of_one(Logits(mixtral("grouped_mm", torch.float32)), tokens(), "fx",
                                             atol=1e-5, rtol=1e-3)
    report = fxdp.report(compiled)
    assert (report.engine, report.front_end) == ("fx", "torch.export")
    assert not [f for f in report.findings if f.severity is fxdp.Severity.ERROR]


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_hand_written_moe_per_sample_gradients_equal_batches_of_one(mode):
    compiled = assert_matches_batches_of_one(moe_net(), tokens(4), mode, atol=1e-12, rtol=1e-10)
    report = fxdp.report(compiled)
    assert (report.engine, report.front_end) == ((mode, "torch.fx") if mode == "fx" else ("hooks", "torch.fx"))
    assert any("mixture-of-experts: 1 block(s) (TopKMoE: 'moe')" in note for note in report.notes)
    assert fxdp.check_per_sample_gradients_are_correct(tokens(4, seed=2), moe_net(), atol=1e-12, rtol=1e-10,
                                                       grad_sample_mode=mode)


def test_register_moe_block_gives_the_block_the_moe_rule_and_returns_the_class():
    class Block(TopKMoE):
        pass

    assert fxdp.register_moe_block(Block) is Block
    assert find_grad_sampler(Block()) is moe_block_grad_sampler


# -- training through PrivacyEngine ---------------------------------------------------------------


def _clipped_mean(model, x, y, max_grad_norm, expected_batch):
    """The DP-SGD gradient without noise, from batches of one: the sum of clipped per-sample gradients
    over the expected batch size."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, torch.autograd.grad(
            F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params, allow_unused=True))]  # experts it did not use
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        for t, g in zip(total, grads):
            t += g * min(1.0, max_grad_norm / (norm.item() + 1e-6))
    return [t / expected_batch for t in total]


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_hand_written_moe_trains_with_make_private(mode):
    """One step without noise equals the clipped mean of batches of one."""
    model = moe_net()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (24, T), generator=g), torch.randint(0, 3, (24,), generator=g))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dp_model, dp_optimizer, loader = fxdp.PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0,
        max_grad_norm=0.05, grad_sample_mode=mode, poisson_sampling=False, example_inputs=data.tensors[0][:4])
    x, y = next(iter(loader))
    dp_optimizer.zero_grad()
    F.cross_entropy(dp_model(x), y).backward()
    dp_optimizer.step()
    expected = _clipped_mean(reference, x, y, 0.05, 8)
    for (name, p), p0, step in zip(model.named_parameters(), reference.parameters(), expected):
        torch.testing.assert_close(p.detach(), p0.detach() - 0.5 * step, atol=1e-12, rtol=1e-10,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_mixtral_trains_with_make_private(mode):
    model = mixtral("batched_mm")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (16, T), generator=g))
    engine = fxdp.PrivacyEngine()
    dp_model, optimizer, loader = engine.make_private(
        module=Logits(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, example_inputs=data.tensors[0][:4])
    steps = 0
    for (ids,) in loader:
        optimizer.zero_grad()
        if len(ids):  # Poisson sampling may draw an empty batch: the step still adds noise and counts
            logits = dp_model(ids)
            F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
        steps += 1
    assert steps == len(loader) == 4 and engine.accountant.history == [(1.0, pytest.approx(0.25), 4)]
    assert engine.get_epsilon(1e-5) > 0
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert "model.layers.0.mlp.gate.weight" in moved and "model.layers.1.mlp.experts.down_proj" in moved
    assert len(moved) == len(before)


# -- what is refused ------------------------------------------------------------------------------


@pytest.mark.parametrize("experts_implementation", ["eager", "batched_mm"])
@pytest.mark.parametrize("mode", ["fx", "hooks"])
def test_router_logits_for_an_auxiliary_loss_are_refused_before_backward(mode, experts_implementation):
    """The load-balancing loss averages the router's statistics over the whole batch: it mixes samples. Called
    with labels, the model returns its loss (a scalar, no row per sample) and router logits of N*T rows: the hooks
    engine's self-check cannot verify it and refuses it before the forward (it used to warn, and the router's own
    refusal came in the forward: that one is tested through the hooked layers below)."""
    model = mixtral(experts_implementation, output_router_logits=True)
    before = [p.detach().clone() for p in model.parameters()]
    x = tokens()
    compiled = fxdp.compile_for_dp(model, example_inputs={"input_ids": x, "labels": x}, grad_sample_mode=mode)
    if (mode, experts_implementation) == ("fx", "batched_mm"):  # captured, but the blocks' calls cannot be folded
        assert "the mixture-of-experts block(s) 'model.layers.0.mlp', 'model.layers.1.mlp' cannot be captured as " \
               "one call" in fxdp.report(compiled).fallback_reason
    with pytest.raises(fxdp.errors.UnverifiedModelError) as info:
        compiled(input_ids=x, labels=x)
    message = str(info.value)
    assert "could not verify MixtralForCausalLM on its first batch of 3 samples (output #0 has shape (), without " \
           "the batch (3 samples) in dimension 0)" in message
    assert "call a Hugging Face model without labels" in info.value.findings[0].fix
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_router_logits_asked_for_in_the_call_are_refused_too():
    model = mixtral("eager")
    compiled = fxdp.compile_for_dp(Logits(model), example_inputs=(tokens(),), grad_sample_mode="hooks")
    with pytest.raises(fxdp.errors.PerSampleError, match="runs with output_router_logits=True"):
        compiled.module.model(input_ids=tokens(), output_router_logits=True)  # through the hooked layers


class CapacityMoE(TopKMoE):
    """Switch-style capacity: an expert takes at most ``expert_capacity`` tokens of the whole batch."""

    expert_capacity = 4


def test_capacity_limited_routing_is_refused_when_compiled():
    model = moe_net(CapacityMoE)
    with pytest.raises(fxdp.errors.BatchMixingError) as info:
        fxdp.compile_for_dp(model, example_inputs=(tokens(4),))
    (finding,) = info.value.findings
    assert (finding.pass_name, finding.node, finding.op) == ("validate", "moe", "CapacityMoE")
    assert finding.message.startswith("the mixture-of-experts block 'moe' (CapacityMoE) has expert_capacity=4: "
                                      "capacity-limited routing drops a token when other samples' tokens fill its expert")
    assert finding.fix == "use top-k routing without a capacity limit"


def test_capacity_limited_routing_is_refused_by_the_hooks_engine_before_backward():
    model = moe_net(CapacityMoE)
    before = [p.detach().clone() for p in model.parameters()]
    wrapped = fxdp.GradSampleModule(model)
    with pytest.raises(fxdp.errors.PerSampleError, match=r"fxdp: the mixture-of-experts block 'moe' \(CapacityMoE\) has "
                                                  r"expert_capacity=4: .* To train it: use top-k routing without a "
                                                  r"capacity limit\."):
        wrapped(tokens(4))
    assert all(getattr(p, "grad_sample", None) is None and p.grad is None for p in model.parameters())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_router_jitter_noise_in_training_is_refused():
    model = mixtral("eager", router_jitter_noise=0.1)
    compiled = fxdp.compile_for_dp(Logits(model), example_inputs=(tokens(),), grad_sample_mode="hooks")
    with pytest.raises(fxdp.errors.PerSampleError, match=r"'model.model.layers.0.mlp' \(MixtralSparseMoeBlock\) multiplies "
                                                  r"its input by random jitter noise .*router_jitter_noise=0"):
        compiled(tokens())


def test_an_undeclared_moe_block_trains_as_one_op():
    """Untraceable (data-dependent control flow) and undeclared, its router sees the batch's tokens flattened: the
    per-layer rules cannot serve it, so it runs as one op, each sample re-run alone (fxdp/engines/blocks.py); with
    fxdp.register_moe_block it gets the faster rule (above)."""
    torch.manual_seed(0)
    compiled = assert_matches_batches_of_one(MoENet(TopKMoE).double(), tokens(4), "fx", atol=1e-12, rtol=1e-10)
    assert compiled.blocks == ("moe",)
    assert compiled.grad_sample_layers["moe"] == "block: generic (its whole subtree), checked against each sample alone"
    (line,) = [note for note in fxdp.report(compiled).notes if note.startswith("untraceable part 'moe' (TopKMoE)")]
    assert "engine: hooks, the block as one op" in line


class PooledMoE(TopKMoE):
    """Declared a MoE block, but returns one vector per sample: not shaped like its input."""

    def forward(self, x):
        return super().forward(x).mean(1)


class PooledNet(MoENet):
    def forward(self, ids):
        return self.head(self.moe(self.embed(ids)))


def test_a_declared_block_whose_output_is_not_shaped_like_its_input_is_refused_in_backward():
    """The graph engine analyses what follows a block with an output shaped like its input: a block that
    breaks that declaration is refused before any per-sample gradient is handed out."""
    torch.manual_seed(0)
    fxdp.register_moe_block(PooledMoE)
    model = PooledNet(PooledMoE).double()
    x = tokens(4)
    compiled = fxdp.compile_for_dp(model, example_inputs=(x,))
    with pytest.raises(fxdp.errors.PerSampleError, match=r"the mixture-of-experts block PooledMoE returned a tensor of shape "
                                                  r"\(4, 8\) for an input of shape \(4, 6, 8\)"):
        compiled(x).sum().backward()
    assert getattr(model.moe.router.weight, "grad_sample", None) is None


def _qwen2_moe():
    return transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        moe_intermediate_size=24, shared_expert_intermediate_size=24, num_experts=4, **_SMALL)


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(moe_intermediate_size=24, num_experts=4,
                                                                         head_dim=8, **_SMALL)


def _olmoe():
    return transformers.OlmoeForCausalLM, transformers.OlmoeConfig(num_experts=4, **_SMALL)


_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=16, use_cache=False)


@pytest.mark.parametrize("family, block", [(_qwen2_moe, "Qwen2MoeSparseMoeBlock"),
                                           (_qwen3_moe, "Qwen3MoeSparseMoeBlock"), (_olmoe, "OlmoeSparseMoeBlock")])
def test_other_hugging_face_moe_families_per_sample_gradients_equal_batches_of_one(family, block):
    torch.manual_seed(0)
    cls, config = family()
    model = cls._from_config(config, attn_implementation="eager", experts_implementation="batched_mm").double().train()
    compiled = assert_matches_batches_of_one(Logits(model), tokens(), "fx", atol=1e-6, rtol=1e-5)
    report = fxdp.report(compiled)
    assert (report.engine, report.front_end) == ("fx", "torch.export")
    assert any(f"mixture-of-experts: 2 block(s) ({block}: 'model.model.layers.0.mlp'" in note for note in report.notes)
