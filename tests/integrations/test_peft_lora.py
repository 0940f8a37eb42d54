"""peft LoRA adapters trained privately: only the adapters (and a head kept trainable) are private; their per-sample
gradients match each sample run alone (float64, unpadded); they are book-kept, not materialised; the report lists
the private parameters; merged adapters load into the base model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import fxdp

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from fxdp.integrations.transformers import per_sample_loss  # noqa: E402

VOCAB, T = 50, 8


def _config(**extra):
    return transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB, use_cache=False,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                                   pad_token_id=0, **extra)


def lora_gpt2(task="causal_lm"):
    torch.manual_seed(0)
    if task == "causal_lm":
        base = transformers.GPT2LMHeadModel(_config()).double()
        config = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, fan_in_fan_out=True,
                                 target_modules=["c_attn", "c_proj", "c_fc"])
    else:
        base = transformers.GPT2ForSequenceClassification(_config(num_labels=3)).double()
        config = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0, fan_in_fan_out=True,
                                 target_modules=["c_attn", "c_proj"])  # SEQ_CLS keeps the head ('score') trainable
    model = peft.get_peft_model(base, config)
    for layer in model.modules():  # LoRA's B starts at 0: give it values, so that every gradient is exercised
        if isinstance(layer, peft.tuners.lora.LoraLayer):
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    return model.train()


def _batch(n=5, task="causal_lm"):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (n, T), generator=gen)
    mask = (torch.arange(T)[None, :] < torch.tensor([T - i % 4 for i in range(n)])[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100) if task == "causal_lm" else torch.arange(n) % 3
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loader(task, n=12):
    batch = _batch(n, task)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]
    return DataLoader(rows, batch_size=4)


def _private(model, task, **kwargs):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    return fxdp.PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=_loader(task),
                                             max_grad_norm=0.05, **kwargs)


def _trainable(model):
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _one_sample_grads(model, batch, i, task):
    n = int(batch["attention_mask"][i].sum())
    one = {k: v[i:i + 1, :n] if v.dim() == 2 else v[i:i + 1] for k, v in batch.items()}
    label = one.pop("labels")
    params = _trainable(model)
    grads = torch.autograd.grad(per_sample_loss(model(**one).logits, label, task).sum(), list(params.values()))
    return dict(zip(params, grads))


@pytest.mark.parametrize("task", ["causal_lm", "classification"])
def test_lora_per_sample_gradients_against_each_sample_alone(task):
    model = lora_gpt2(task)
    private, _, _ = _private(model, task, noise_multiplier=1.0, materialise_grad_sample=True)
    assert fxdp.report(private).engine == "fx", str(fxdp.report(private))
    batch = _batch(task=task)
    labels = batch.pop("labels")
    per_sample_loss(private(**batch).logits, labels, task).mean().backward()
    trainable = _trainable(model)
    assert all(name.endswith(("lora_A.default.weight", "lora_B.default.weight")) or ".score." in name
               for name in trainable)
    assert (task == "classification") == any(".score." in name for name in trainable)  # the head, kept trainable
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(getattr(p, "grad_sample", None) is None and p.grad is None for p in frozen)
    batch["labels"] = labels
    for i in range(labels.shape[0]):
        expected = _one_sample_grads(model, batch, i, task)
        for name, p in trainable.items():
            torch.testing.assert_close(p.grad_sample[i], expected[name], atol=1e-9, rtol=1e-7, msg=f"{name}, {i}")


def test_lora_is_book_kept_and_the_report_lists_the_private_parameters():
    model = lora_gpt2()
    private, _, _ = _private(model, "causal_lm", noise_multiplier=1.0)
    notes = fxdp.report(private).notes
    listed = next(n for n in notes if n.startswith("private parameters"))
    trainable = list(_trainable(model))
    assert f": {len(trainable)} of {len(list(model.parameters()))} (" in listed
    assert listed.split("values): ", 1)[1].startswith(", ".join(trainable) + "; the other ")
    plans = [n for n in notes if n.startswith("book-keeping:")]
    adapters = [n for n in plans if ".lora_" in n]
    assert len(adapters) == 2 * 4  # A and B of c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj ('c_proj' names both)
    assert all(": per_sample (" in n or ": ghost (" in n for n in adapters), adapters
    assert not [n for n in plans if ".lora_" not in n]  # frozen base layers: nothing computed, nothing listed


def test_a_private_lora_step_is_the_clipped_sum_and_merges_into_the_base_model():
    """noise_multiplier=0: the adapters move by -lr * Σ clip(g_i) / expected batch size (g_i over the adapters
    alone); the merged model's weights load into a plain GPT2LMHeadModel and compute what the adapted model does."""
    model = lora_gpt2()
    private, optimizer, loader = _private(model, "causal_lm", noise_multiplier=0.0)
    batch = next(b for b in loader if b["input_ids"].shape[0] > 0)
    before = {name: p.detach().clone() for name, p in _trainable(model).items()}
    clipped = {name: torch.zeros_like(p) for name, p in before.items()}
    for i in range(batch["input_ids"].shape[0]):
        grads = _one_sample_grads(model, batch, i, "causal_lm")
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
        for name, g in grads.items():
            clipped[name] += g * min(1.0, 0.05 / (norm + 1e-6))
    optimizer.zero_grad()
    labels = batch.pop("labels")
    per_sample_loss(private(**batch).logits, labels).mean().backward()
    optimizer.step()
    for name, p in _trainable(model).items():
        expected = before[name] - 0.5 * clipped[name] / optimizer.expected_batch_size
        torch.testing.assert_close(p.detach(), expected, atol=1e-10, rtol=1e-8, msg=name)

    model.eval()
    with torch.no_grad():
        adapted = model(**batch).logits
    merged = model.merge_and_unload()
    base = transformers.GPT2LMHeadModel(_config()).double().eval()
    base.load_state_dict(merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(base(**batch).logits, adapted, atol=1e-10, rtol=1e-8)
