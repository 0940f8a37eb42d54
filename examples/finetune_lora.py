"""Fine-tune a GPT-2-architecture model with LoRA adapters (peft) and differential privacy, through Hugging Face's
``Trainer``: fxdp's :class:`~fxdp.integrations.transformers.DPTrainer`.

    pip install -e ".[examples,transformers]" && python examples/finetune_lora.py

The task is the text example's (``examples/text_data.py``): pieces of standard-library docstrings, classified by
the family of modules they document (three balanced classes, chance is 33%), read from Python's own source files:
nothing is downloaded. The model is ``GPT2ForSequenceClassification`` built from a config (randomly initialised;
the tokenizer hashes words into a fixed vocabulary), with LoRA adapters (rank ``--rank``) on the attention and
projection layers and the classification head trainable: only those are private, the rest is frozen. The
Trainer draws Poisson batches, clips each sample's gradient and adds noise calibrated to ``--target-epsilon``;
ε is in its logs and printed at the end with the test accuracy. ``--quick`` is a short run for the tests.

With pretrained weights the same code fine-tunes them: ``GPT2ForSequenceClassification.from_pretrained("gpt2",
num_labels=3)`` and that model's tokenizer (padding every batch to one length: the graph fxdp captures has the
sequence length of the first batch built in).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # text_data.py sits next to this file
import text_data  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Private LoRA fine-tuning (DP-SGD) with the Trainer and fxdp.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=float, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="expected (Poisson) batch size")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=2048, help="hash buckets of the word tokenizer (+2 reserved)")
    parser.add_argument("--train-subset", type=int, default=None, help="train on the first N training samples")
    parser.add_argument("--test-subset", type=int, default=None, help="evaluate on the first N test samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a short run for tests: 1 layer of width 32, 600 training and 300 test samples, 1 epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.vocab_size, args.train_subset, args.epochs, args.batch_size = 1, 32, 256, 600, 1, 100
        args.test_subset = 300
    return args


class Docstrings(Dataset):
    """``{"input_ids": [...], "labels": family}`` per sample, as a tokenised Hugging Face dataset gives them."""

    def __init__(self, split: text_data.TextSplit, limit: Optional[int] = None):
        self.ids, self.labels = split.ids[:limit], split.labels[:limit]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Dict[str, object]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def collate(samples: List[Dict[str, object]]) -> Dict[str, torch.Tensor]:
    """Right padding to one length (``MAX_TOKENS``) with an attention mask, as ``DataCollatorWithPadding(tokenizer,
    padding="max_length")`` does: GPT-2's classifier reads the last token that is not padding."""
    input_ids, attention_mask, labels = text_data.pad_batch(
        [(torch.tensor(s["input_ids"]), s["labels"]) for s in samples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_model(args: argparse.Namespace, vocab_size: int):
    import peft
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=text_data.MAX_TOKENS, n_layer=args.layers, n_embd=args.width,
        n_head=4, num_labels=len(text_data.LABELS), pad_token_id=text_data.PAD, bos_token_id=text_data.CLS,
        eos_token_id=text_data.CLS, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2ForSequenceClassification(config)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                           target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    return peft.get_peft_model(model, lora)  # SEQ_CLS keeps the head ('score') trainable


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    args = parse_args(argv)
    import transformers

    import fxdp
    from fxdp.integrations.transformers import DPTrainer, PrivacyArguments

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    tokenizer = text_data.HashingTokenizer(vocab_size=args.vocab_size)
    train_split, test_split = text_data.load_docstring_classification(tokenizer)
    train_set, test_set = Docstrings(train_split, args.train_subset), Docstrings(test_split, args.test_subset)
    model = build_model(args, tokenizer.vocab_size)

    with tempfile.TemporaryDirectory() as output_dir:
        training = transformers.TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
            learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, seed=args.seed, report_to=[],
            save_strategy="no", logging_strategy="epoch", disable_tqdm=True, per_device_eval_batch_size=512,
            dataloader_pin_memory=torch.cuda.is_available())
        trainer = DPTrainer(
            model=model, args=training, train_dataset=train_set, data_collator=collate,
            compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())},
            privacy_args=PrivacyArguments(per_sample_max_grad_norm=args.max_grad_norm,
                                          target_epsilon=args.target_epsilon, target_delta=args.delta))
        trainer.train()
        report = fxdp.report(trainer.private_model)
        print(next(note for note in report.notes if note.startswith("private parameters")))
        metrics = trainer.evaluate(test_set)
    epsilon = trainer.get_epsilon()
    print(f"final: test accuracy {100 * metrics['eval_accuracy']:.1f}% at epsilon {epsilon:.2f}, delta {args.delta:g} "
          f"({len(trainer.privacy_engine.accountant)} private steps, noise multiplier "
          f"{trainer._dp_optimizer.noise_multiplier:.3f}; {time.perf_counter() - start:.0f} s, chance is "
          f"{100 / len(text_data.LABELS):.1f}%)")
    return {"accuracy": metrics["eval_accuracy"], "epsilon": epsilon, "steps": len(trainer.privacy_engine.accountant)}


if __name__ == "__main__":
    main()
