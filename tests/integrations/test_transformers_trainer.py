"""fxdp.integrations.transformers.DPTrainer: Hugging Face's Trainer with DP-SGD, end to end.

The step is checked against an independent computation (each sample run alone without its padding, its loss the
mean over its own target tokens, its gradient clipped, the clipped gradients summed over the very batch the
Trainer drew and divided by the expected batch size); the accountant's steps and sampling rate against the
loader; ε in the logs; save_model's checkpoint loaded into the plain model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from fxdp.accounting import create_accountant
import fxdp
from fxdp.diagnostics import PrivacySettingError

transformers = pytest.importorskip("transformers")
from fxdp.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402

VOCAB, T, N_DATA, BATCH = 50, 8, 12, 4


def gpt2():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                                  pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double()


class Texts(Dataset):
    """Lists of token ids of different lengths; the collator pads them (to one length, T)."""

    def __init__(self, n: int = N_DATA):
        gen = torch.Generator().manual_seed(7)
        self.rows = [torch.randint(2, VOCAB, (T - i % 4,), generator=gen).tolist() for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def collate(samples):
    """Right padding to T: attention mask 0 and label -100 on the padding, as Hugging Face collators do."""
    ids = torch.zeros(len(samples), T, dtype=torch.long)
    mask = torch.zeros(len(samples), T, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[i, :len(s["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _args(tmp_path, **extra):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, learning_rate=0.5,
                    optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, report_to=[], save_strategy="no",
                    use_cpu=True, disable_tqdm=True, logging_steps=1)
    settings.update(extra)
    return transformers.TrainingArguments(**settings)


class Recording(DPTrainer):
    """Keeps the batches the Trainer drew, as the training step got them."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.batches = getattr(self, "batches", []) + [{k: v.clone() for k, v in inputs.items()}]
        return super().training_step(model, inputs, num_items_in_batch)


def _clipped_sum(model, batch, bound):
    """Σ_i clip(g_i): each sample alone, without its padding, its loss the mean over its own next-token targets."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i:i + 1, :n]
        logits = model(input_ids=ids).logits[0, :-1]
        loss = F.cross_entropy(logits, ids[0, 1:])  # every one of its tokens is a target: the mean over them
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        factor = min(1.0, bound / (norm.item() + 1e-6))
        total = [t + g * factor for t, g in zip(total, grads)]
    return total


def test_a_step_is_the_clipped_sum_of_the_batch_the_trainer_drew(tmp_path):
    """noise_multiplier=0, so the update is exactly -lr * Σ clip(g_i) / expected batch size, step after step."""
    model, data = gpt2(), Texts()
    reference = copy.deepcopy(model)
    trainer = Recording(model=model, args=_args(tmp_path, max_steps=3), train_dataset=data, data_collator=collate,
                        privacy_args=PrivacyArguments(per_sample_max_grad_norm=0.05, noise_multiplier=0.0))
    trainer.train()
    assert len(trainer.batches) == 3 and sum(b["input_ids"].shape[0] for b in trainer.batches) > 0
    expected_batch = round(N_DATA / math.ceil(N_DATA / BATCH))
    assert trainer._dp_optimizer.expected_batch_size == expected_batch == 4
    for batch in trainer.batches:
        step = _clipped_sum(reference, batch, 0.05)
        with torch.no_grad():
            for p, s in zip(reference.parameters(), step):
                p -= 0.5 * s / expected_batch
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-8, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), gpt2().parameters()))


def test_accounting_epsilon_in_the_logs_and_a_checkpoint_for_the_plain_model(tmp_path):
    model = gpt2()
    trainer = DPTrainer(model=model, args=_args(tmp_path, num_train_epochs=2), train_dataset=Texts(),
                        eval_dataset=Texts(4), data_collator=collate,
                        privacy_args=PrivacyArguments(per_sample_max_grad_norm=1.0, noise_multiplier=1.3,
                                                      target_delta=1e-3))
    trainer.train()
    steps = 2 * math.ceil(N_DATA / BATCH)  # one accountant step per Poisson batch, len(loader) of them an epoch
    assert trainer.state.global_step == steps
    assert trainer.privacy_engine.accountant.history == [(1.3, 1 / 3, steps)]
    independent = create_accountant("pld")
    for _ in range(steps):
        independent.step(noise_multiplier=1.3, sample_rate=1 / 3)
    epsilon = independent.get_epsilon(1e-3)
    logged = [entry["epsilon"] for entry in trainer.state.log_history if "epsilon" in entry]
    assert len(logged) >= steps and logged == sorted(logged)
    assert logged[-1] == pytest.approx(epsilon, rel=1e-9) == trainer.get_epsilon()
    assert not any("grad_norm" in entry for entry in trainer.state.log_history)  # the batch's, before clipping
    assert "eval_loss" in trainer.evaluate()  # the plain model, its own loss
    trainer.save_model(str(tmp_path / "final"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"), dtype=torch.float64)
    trained = dict(model.named_parameters())
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name]), name
    assert not torch.equal(loaded.transformer.h[0].mlp.c_fc.weight, gpt2().transformer.h[0].mlp.c_fc.weight)


def test_a_target_epsilon_is_met_over_the_training(tmp_path):
    trainer = DPTrainer(model=gpt2(), args=_args(tmp_path, max_steps=5, logging_steps=5), train_dataset=Texts(),
                        data_collator=collate,
                        privacy_args=PrivacyArguments(target_epsilon=3.0, target_delta=1e-3))
    trainer.train()
    assert len(trainer.privacy_engine.accountant) == 5
    assert 0.99 * 3.0 <= trainer.get_epsilon() <= 3.0


@pytest.mark.parametrize("extra, words", [
    (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=2: one Poisson batch is one private step"),
    (dict(bf16=True), "fp16/bf16 mixed precision: not verified"),
])
def test_training_arguments_dp_cannot_train_with_are_refused(tmp_path, extra, words):
    with pytest.raises(PrivacySettingError) as info:
        DPTrainer(model=gpt2(), args=_args(tmp_path, **extra), train_dataset=Texts(), data_collator=collate,
                  privacy_args=PrivacyArguments(noise_multiplier=1.0))
    assert words in str(info.value)


def test_privacy_arguments_need_one_of_noise_and_target(tmp_path):
    with pytest.raises(PrivacySettingError, match="exactly one of noise_multiplier and target_epsilon"):
        DPTrainer(model=gpt2(), args=_args(tmp_path), train_dataset=Texts(), data_collator=collate,
                  privacy_args=PrivacyArguments(noise_multiplier=1.0, target_epsilon=2.0))


def test_resuming_from_a_checkpoint_is_refused_before_anything_moves(tmp_path):
    model = gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = DPTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=Texts(), data_collator=collate,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0))
    with pytest.raises(PrivacySettingError, match="cannot resume from a checkpoint: the Trainer's checkpoints do not"):
        trainer.train(resume_from_checkpoint=str(tmp_path))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert len(trainer.privacy_engine.accountant) == 0


def test_a_collator_padding_each_batch_to_its_longest_sample_trains_each_step_on_the_clipped_sum(tmp_path):
    """Batches of different lengths (padded to their longest sample): the model is captured again once per length,
    and each step is still exactly -lr * Σ clip(g_i) / expected batch size, each g_i its sample's alone."""
    def to_longest(samples):
        batch = collate(samples)
        longest = int(batch["attention_mask"].sum(1).max()) if samples else T
        return {k: v[:, :longest] for k, v in batch.items()}

    data = Texts()
    data.rows = [row[:3 + i % 6] for i, row in enumerate(data.rows)]  # lengths 3 to 8
    model = gpt2()
    reference = copy.deepcopy(model)
    trainer = Recording(model=model, args=_args(tmp_path, max_steps=6), train_dataset=data, data_collator=to_longest,
                        privacy_args=PrivacyArguments(per_sample_max_grad_norm=0.05, noise_multiplier=0.0))
    trainer.train()
    lengths = [b["input_ids"].shape[1] for b in trainer.batches if b["input_ids"].shape[0] > 0]
    assert len(set(lengths)) >= 2, lengths
    for batch in trainer.batches:
        step = _clipped_sum(reference, batch, 0.05)
        with torch.no_grad():
            for p, s in zip(reference.parameters(), step):
                p -= 0.5 * s / 4
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-8, msg=name)
    note = fxdp.report(trainer.private_model).notes[-1]
    captured = to_longest([data[0], data[1]])["input_ids"].shape[1]  # make_private's: the first two samples
    assert note.startswith(f"torch.export: captured once per input shape seen ({len(set(lengths) | {captured})} "
                           "graphs"), note
