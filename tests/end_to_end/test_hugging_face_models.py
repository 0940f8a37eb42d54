"""Hugging Face transformers models, built from tiny configs (nothing is downloaded), in the graph engine.

torch.fx cannot trace transformers 5 models (each ``forward`` is wrapped in a ``**kwargs`` decorator, the
mask utilities branch on tensor values), so fxdp captures them with torch.export (the second front end,
fxdp/frontends/export.py). Every test compares the compiled model's per-sample gradients of every trainable
parameter with the model run on each sample alone (a batch of one, with the same mask row), in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxdp
from fxdp.diagnostics import Kind, Severity

transformers = pytest.importorskip("transformers")

VOCAB, T, N = 40, 7, 3
_TEXT = dict(vocab_size=VOCAB, max_position_embeddings=16)
_BERTISH = dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **_TEXT)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=VOCAB, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel, cfg


def _bert():
    return transformers.BertForSequenceClassification, transformers.BertConfig(**_BERTISH)


def _roberta():
    return transformers.RobertaForSequenceClassification, transformers.RobertaConfig(pad_token_id=0, **_BERTISH)


def _distilbert():
    cfg = transformers.DistilBertConfig(n_layers=1, dim=16, n_heads=2, hidden_dim=32, dropout=0.0, attention_dropout=0.0,
                                        seq_classif_dropout=0.0, **_TEXT)
    return transformers.DistilBertForSequenceClassification, cfg


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=32, use_cache=False, **_TEXT)
    return transformers.LlamaForCausalLM, cfg


def _opt():
    cfg = transformers.OPTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, ffn_dim=32,
                                 word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0, use_cache=False, **_TEXT)
    return transformers.OPTForCausalLM, cfg


def _t5_encoder():
    cfg = transformers.T5Config(num_layers=1, d_model=16, num_heads=2, d_kv=8, d_ff=32, vocab_size=VOCAB,
                                dropout_rate=0.0, relative_attention_num_buckets=8)
    return transformers.T5EncoderModel, cfg


def _vit():
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification, cfg


def _build(builder, attn: str):
    """The model as people build it from a config (``from_config(config, attn_implementation=...)``)."""
    torch.manual_seed(0)
    cls, config = builder()
    model = cls._from_config(config, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    return model.double().train()


def _padded_mask(n: int = N, t: int = T) -> torch.Tensor:
    """Rows of different lengths (right padding): 7, 5 and 3 real tokens."""
    lengths = torch.tensor([t, t - 2, t - 4][:n])
    return (torch.arange(t)[None, :] < lengths[:, None]).long()


def _token_ids(n: int = N, t: int = T) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, t), generator=torch.Generator().manual_seed(1))


def _summed(out) -> torch.Tensor:
    first = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return first.sum()


def _causal_lm_loss(out, inputs) -> torch.Tensor:
    """Per-token cross-entropy, averaged over each sample's real tokens, then over the batch ("mean")."""
    logits, labels = out.logits[:, :-1], inputs["input_ids"][:, 1:]
    mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))[:, 1:].to(logits.dtype)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    per_sample = (per_token.view(labels.shape) * mask).sum(1) / mask.sum(1)
    return per_sample.mean()


def _assert_per_sample_gradients(model, compiled, inputs, loss_fn, tol=(1e-9, 1e-7)):
    loss_fn(compiled(**inputs), inputs).backward()
    n = next(iter(inputs.values())).shape[0]
    grad_samples = {name: p.grad_sample for name, p in model.named_parameters() if p.requires_grad}
    for name, p in model.named_parameters():
        if p.requires_grad:
            del p.grad_sample
    model.zero_grad()
    for i in range(n):
        one = {k: v[i:i + 1] for k, v in inputs.items()}
        loss_fn(model(**one), one).backward()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            expected = p.grad if p.grad is not None else torch.zeros_like(p)
            assert grad_samples[name].shape == (n, *p.shape), name
            torch.testing.assert_close(grad_samples[name][i], expected, atol=tol[0], rtol=tol[1], msg=f"{name}, sample {i}")
        model.zero_grad()


def _assert_graph_engine(compiled):
    report = fxdp.report(compiled)
    assert report.engine == "fx", str(report)
    assert report.front_end == "torch.export"
    assert report.front_end_reason.startswith("torch.fx could not trace the model")
    assert "front end: torch.export, because torch.fx could not trace the model" in str(report)
    unverified = [f for f in report.findings if f.kind is Kind.UNVERIFIED or f.severity is not Severity.INFO
                  and f.kind is not Kind.MOVES_BATCH]
    assert unverified == [], str(report)


TEXT_MODELS = {"gpt2": _gpt2, "bert": _bert, "roberta": _roberta, "distilbert": _distilbert, "llama": _llama,
               "opt": _opt, "t5-encoder": _t5_encoder}
CAUSAL_LMS = ("gpt2", "llama", "opt")
# Llama's and T5's RMS norms compute in float32 whatever the model's dtype: float32 round-off then
_TOLERANCE = {"llama": (1e-6, 1e-5), "t5-encoder": (1e-6, 1e-5), "phi3": (1e-6, 1e-5)}


# each model with a padded mask and without one, each attention implementation once with each
@pytest.mark.parametrize("mask, attn", [("padded", "sdpa"), (None, "eager")])
@pytest.mark.parametrize("name", list(TEXT_MODELS))
def test_text_model_per_sample_gradients_in_the_graph_engine(name, mask, attn):
    model = _build(TEXT_MODELS[name], attn)
    inputs = {"input_ids": _token_ids()}
    if mask is not None:
        inputs["attention_mask"] = _padded_mask()
    causal = name in CAUSAL_LMS
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="mean" if causal else "sum")
    _assert_graph_engine(compiled)
    loss_fn = _causal_lm_loss if causal else (lambda out, inputs: _summed(out))
    _assert_per_sample_gradients(model, compiled, inputs, loss_fn, _TOLERANCE.get(name, (1e-9, 1e-7)))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_vit_per_sample_gradients_in_the_graph_engine(attn):
    model = _build(_vit, attn)
    inputs = {"pixel_values": torch.randn(N, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))}
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="sum")
    _assert_graph_engine(compiled)
    assert type(compiled(**inputs)).__name__ == "ImageClassifierOutput"
    _assert_per_sample_gradients(model, compiled, inputs, lambda out, inputs: _summed(out))


def test_a_captured_model_runs_other_batch_sizes():
    """Compiled on 3 samples, a causal LM trains on batches of 4 and 1 (Poisson sampling varies N)."""
    model = _build(_gpt2, "sdpa")
    example = {"input_ids": _token_ids(), "attention_mask": _padded_mask()}
    compiled = fxdp.compile_for_dp(model, example_inputs=example)
    for n in (4, 1):
        inputs = {"input_ids": torch.randint(1, VOCAB, (n, T), generator=torch.Generator().manual_seed(n)),
                  "attention_mask": torch.cat([_padded_mask(), _padded_mask()])[:n]}
        assert compiled(**inputs).logits.shape == (n, T, VOCAB)
        _assert_per_sample_gradients(model, compiled, inputs, _causal_lm_loss)


def test_without_example_inputs_the_report_says_to_give_them():
    model = _build(_bert, "sdpa")
    report = fxdp.inspect(model)
    assert report.engine == "hooks" and report.front_end is None
    assert report.fallback_reason.startswith("the model cannot be traced by torch.fx (")
    assert report.fallback_reason.endswith("pass example_inputs to let fxdp capture it with torch.export instead")


def test_a_loss_computed_inside_the_model_is_refused():
    """With labels=, a causal LM averages its loss over the whole batch: every sample's gradient then
    depends on the others' token counts; the loss belongs outside the model."""
    model = _build(_gpt2, "sdpa")
    ids = _token_ids()
    with pytest.raises(fxdp.errors.BatchMixingError) as info:
        fxdp.compile_for_dp(model, example_inputs={"input_ids": ids, "labels": ids})
    (finding,) = [f for f in info.value.findings if f.kind is Kind.MIXES_SAMPLES]
    assert finding.op == "aten.cross_entropy_loss.default"
    assert "computes the loss with reduction='mean' inside the model" in finding.message


# -- output_hidden_states / output_attentions: transformers 5 records them with forward hooks -----------------

def _deberta_v2():
    return transformers.DebertaV2ForSequenceClassification, transformers.DebertaV2Config(**_BERTISH)


def _phi3():
    cfg = transformers.Phi3Config(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                  intermediate_size=32, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attention_dropout=0.0, pad_token_id=0, eos_token_id=0, bos_token_id=0, **_TEXT)
    return transformers.Phi3ForCausalLM, cfg


def _with_hidden_states(builder):
    def build():
        cls, config = builder()
        config.output_hidden_states = config.output_attentions = True
        return cls, config
    return build


def _hidden_states_loss(out, inputs):
    """The head's output, every hidden state and attention map, each its own weight: the first hidden state (the
    embeddings') feeds all the others, and the last is the one the head reads."""
    attentions = [a for a in out.attentions if a is not None]
    return (_summed(out) + sum((h ** 2).sum() * (k + 1) for k, h in enumerate(out.hidden_states))
            + sum((a * 3).sum() for a in attentions))


@pytest.mark.parametrize("name, builder", [("gpt2", _gpt2), ("bert", _bert), ("deberta-v2", _deberta_v2)])
def test_output_hidden_states_stays_in_the_graph_engine(name, builder):
    """The recording hooks change nothing and torch.export runs them as it captures the model, so the graph
    returns the hidden states: they are no reason to leave the graph engine."""
    model = _build(_with_hidden_states(builder), "eager")
    inputs = {"input_ids": _token_ids(), "attention_mask": _padded_mask()}
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="sum")
    _assert_graph_engine(compiled)
    if name != "deberta-v2":  # which collects them in its own loop
        assert any(m._forward_hooks for m in model.modules())  # transformers recorded them with hooks
    out = compiled(**inputs)
    assert len(out.hidden_states) == 2 and len(out.attentions) == 1  # the embeddings' output and the one layer's
    _assert_per_sample_gradients(model, compiled, inputs, _hidden_states_loss)


@pytest.mark.parametrize("name", ["gpt2-with-a-hook-of-yours", "phi3"])
def test_output_hidden_states_in_the_whole_model_engine(name):
    """A hook of the user's (or, for Phi-3, ops the graph engine cannot serve) sends the model to fx+whole-model:
    each hidden state feeds the next, and each path from a parameter to the loss counts once."""
    model = _build(_with_hidden_states(_gpt2 if name.startswith("gpt2") else _phi3), "eager")
    seen = []
    if name.startswith("gpt2"):
        model.transformer.ln_f.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    inputs = {"input_ids": _token_ids(), "attention_mask": _padded_mask()}
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="sum")
    assert fxdp.report(compiled).engine == "fx+whole-model", str(fxdp.report(compiled))
    if name.startswith("gpt2"):
        assert "hooks of yours on 'transformer.ln_f' (forward hook);" in fxdp.report(compiled).fallback_reason
    _assert_per_sample_gradients(model, compiled, inputs, _hidden_states_loss, _TOLERANCE.get(name, (1e-9, 1e-7)))


def test_an_encoder_decoder_in_the_whole_model_engine_counts_the_encoder_once():
    """Whisper: the decoder's position lookup sends it to fx+whole-model; the encoder's output is returned and
    also feeds the decoder."""
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=4, encoder_layers=1, decoder_layers=1, d_model=16,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_source_positions=4, max_target_positions=8, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=0,
                                     bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    model = transformers.WhisperModel._from_config(cfg, attn_implementation="eager").double().train()
    gen = torch.Generator().manual_seed(3)
    inputs = {"input_features": torch.randn(N, 4, 8, dtype=torch.float64, generator=gen),
              "decoder_input_ids": torch.randint(1, VOCAB, (N, 5), generator=gen)}
    compiled = fxdp.compile_for_dp(model, example_inputs=inputs, loss_reduction="sum")
    assert fxdp.report(compiled).engine == "fx+whole-model"

    def loss(out, inputs):
        return (out.last_hidden_state ** 2).sum() + (out.encoder_last_hidden_state * 0.5).sum()

    _assert_per_sample_gradients(model, compiled, inputs, loss)
