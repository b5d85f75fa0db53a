"""Small models as users build them, for the real-model conformance tests.

Every transformers model is built offline from its library-default config (random init, default
attention implementation, i.e. SDPA), changed only in size and with dropout set to 0.  Each model
is wrapped as ``batch -> loss`` and comes with a batch maker, so one training loop runs them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn

BATCH, SEQ, VOCAB, IMAGE, MELS = 2, 8, 128, 16, 16

Batch = dict[str, torch.Tensor]

# Small, shared sizes for every transformer.
_LM = {"vocab_size": VOCAB}


class LossOf(nn.Module):
    """A transformers model as ``batch -> loss`` (the model computes the loss from ``labels``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.model(**batch).loss


class SmallCNN(nn.Module):
    """A plain convolutional classifier: conv/batch-norm/ReLU blocks, pooling, a linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),  # batch norm follows
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, stride=2, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, batch: Batch) -> torch.Tensor:
        logits = self.head(self.body(batch["pixel_values"]))
        return nn.functional.cross_entropy(logits, batch["labels"])


def _lm_batch(g: torch.Generator) -> Batch:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _padded(left: bool) -> Callable[[torch.Generator], Batch]:
    """Language-model batches padded as a tokenizer pads a list of texts: a different length per
    sample, ``attention_mask`` 0 on the padding (left of the text for ``left``, as for decoder
    generation, else right), the padding's labels ignored (-100)."""

    def batch(g: torch.Generator) -> Batch:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        for i in range(BATCH):
            pad = int(torch.randint(0, SEQ // 2, (1,), generator=g)) if i else SEQ // 2
            if pad:
                if left:
                    mask[i, :pad] = 0
                else:
                    mask[i, SEQ - pad :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return batch


def _seq2seq_batch(g: torch.Generator) -> Batch:
    return {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "labels": torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=g),
    }


def _audio_batch(g: torch.Generator) -> Batch:
    """Log-mel features (``MELS`` bins, ``2 * SEQ`` frames: the encoder's convolutions halve them)
    and decoder labels."""
    return {
        "input_features": torch.randn(BATCH, MELS, 2 * SEQ, generator=g),
        "labels": torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g),
    }


def _image_batch(g: torch.Generator) -> Batch:
    return {
        "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
        "labels": torch.randint(0, 10, (BATCH,), generator=g),
    }


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    what: str  # the architectural feature the model stands for


def _hf(cls_name: str, cfg: transformers.PretrainedConfig) -> nn.Module:
    model = getattr(transformers, cls_name)._from_config(cfg)  # library-default attention
    model.train()
    return LossOf(model)


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **_LM,
    )  # fmt: skip
    return _hf("GPT2LMHeadModel", cfg)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, **_LM,
    )  # fmt: skip
    return _hf("LlamaForCausalLM", cfg)


def gemma() -> nn.Module:
    cfg = transformers.GemmaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, intermediate_size=64, max_position_embeddings=32, **_LM,
    )  # fmt: skip
    return _hf("GemmaForCausalLM", cfg)


def bloom() -> nn.Module:
    cfg = transformers.BloomConfig(
        n_layer=2, hidden_size=32, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, **_LM
    )
    return _hf("BloomForCausalLM", cfg)


def gpt_neox() -> nn.Module:
    cfg = transformers.GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, **_LM,
    )  # fmt: skip
    return _hf("GPTNeoXForCausalLM", cfg)


def qwen2() -> nn.Module:
    cfg = transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, **_LM,
    )  # fmt: skip
    return _hf("Qwen2ForCausalLM", cfg)


def bert() -> nn.Module:
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        vocab_size=VOCAB,
    )  # fmt: skip
    return _hf("BertForMaskedLM", cfg)


def roberta() -> nn.Module:
    cfg = transformers.RobertaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        vocab_size=VOCAB,
    )  # fmt: skip
    return _hf("RobertaForMaskedLM", cfg)


def mixtral() -> nn.Module:
    cfg = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **_LM,
    )  # fmt: skip
    return _hf("MixtralForCausalLM", cfg)


def t5() -> nn.Module:
    cfg = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, d_ff=64, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, **_LM,
    )  # fmt: skip
    return _hf("T5ForConditionalGeneration", cfg)


def vit() -> nn.Module:
    cfg = transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        image_size=IMAGE, patch_size=4, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return _hf("ViTForImageClassification", cfg)


def mistral() -> nn.Module:
    cfg = transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, sliding_window=4, **_LM,
    )  # fmt: skip
    return _hf("MistralForCausalLM", cfg)


def gemma2() -> nn.Module:
    cfg = transformers.Gemma2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=32, sliding_window=4, **_LM,
    )  # fmt: skip
    return _hf("Gemma2ForCausalLM", cfg)


def qwen3() -> nn.Module:
    cfg = transformers.Qwen3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=32, **_LM,
    )  # fmt: skip
    return _hf("Qwen3ForCausalLM", cfg)


def deberta_v2() -> nn.Module:
    cfg = transformers.DebertaV2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, relative_attention=True, pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=VOCAB,
    )  # fmt: skip
    return _hf("DebertaV2ForMaskedLM", cfg)


def whisper() -> nn.Module:
    cfg = transformers.WhisperConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=MELS,
        max_source_positions=SEQ, max_target_positions=SEQ, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, **_LM,
    )  # fmt: skip
    return _hf("WhisperForConditionalGeneration", cfg)


def swin() -> nn.Module:
    cfg = transformers.SwinConfig(
        image_size=IMAGE, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 4],
        window_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )  # fmt: skip
    return _hf("SwinForImageClassification", cfg)


MODELS: dict[str, Spec] = {
    "gpt2": Spec(gpt2, _lm_batch, "decoder LM, learned positions, tied head, GELU(tanh) in Python"),
    "llama": Spec(llama, _lm_batch, "decoder LM, rotary, grouped-query attention, untied head"),
    "gemma": Spec(gemma, _lm_batch, "decoder LM, rotary, multi-query, GELU(tanh), tied head"),
    "bloom": Spec(bloom, _lm_batch, "decoder LM, ALiBi positions, tied head"),
    "gpt_neox": Spec(gpt_neox, _lm_batch, "decoder LM, partial rotary, parallel residual, untied"),
    "qwen2": Spec(qwen2, _lm_batch, "decoder LM, rotary, GQA with q/k/v bias"),
    "mixtral": Spec(mixtral, _lm_batch, "decoder LM, mixture of experts (top-2 of 4), GQA"),
    "bert": Spec(bert, _lm_batch, "encoder MLM, learned positions"),
    "bert_padded": Spec(bert, _padded(left=False), "encoder MLM, right-padded batch with a mask"),
    "llama_padded": Spec(
        llama, _padded(left=True), "decoder LM, GQA, left-padded batch with a mask"
    ),
    "roberta": Spec(roberta, _lm_batch, "encoder MLM, padding-offset positions"),
    "t5": Spec(t5, _seq2seq_batch, "encoder-decoder, relative position bias, untied head"),
    "vit": Spec(vit, _image_batch, "vision transformer, patch embedding convolution"),
    "cnn": Spec(SmallCNN, _image_batch, "convolutional network with batch norm"),
    "mistral": Spec(mistral, _lm_batch, "decoder LM, sliding-window attention, GQA"),
    "gemma2": Spec(
        gemma2, _lm_batch, "decoder LM, logit soft-capping, sliding/global layers, sandwich norms"
    ),
    "qwen3": Spec(qwen3, _lm_batch, "decoder LM, per-head RMSNorm of queries and keys, GQA"),
    "deberta_v2": Spec(
        deberta_v2, _lm_batch, "encoder MLM, disentangled relative-position attention"
    ),
    "whisper": Spec(
        whisper, _audio_batch, "speech encoder-decoder, convolutional stem, cross-attention"
    ),
    "swin": Spec(swin, _image_batch, "vision, shifted-window attention, relative position bias"),
}
