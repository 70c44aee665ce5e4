"""Tiny random Llama configs for tests: one definition of the shapes they share."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def tiny_llama_config(vocab_size: int, **overrides: Any) -> transformers.LlamaConfig:
    """A Llama config of hidden size 64, MLP 128, 2 layers, 4 query / 2 KV heads and
    256 positions, with ``overrides``."""
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return transformers.LlamaConfig(**{**fields, **overrides})


def tiny_cross_encoder(folder: Path, tokenizer_dir: Path, num_labels: int):
    """A random 2-layer `BertForSequenceClassification` (BERT's vocabulary) saved in
    ``folder`` with the tokenizer files of ``tokenizer_dir``; returns the model."""
    torch.manual_seed(num_labels)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, num_labels=num_labels,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return model


def save_tiny_smollm2(folder: Path, tokenizer) -> transformers.PreTrainedModel:
    """A random 2-layer Llama with SmolLM2's vocabulary, tied embeddings and rope (6
    query / 3 KV heads: tensor parallelism over 3 devices splits it as it splits
    SmolLM2's 9/3), saved in ``folder`` with SmolLM2's tokenizer and chat template.
    Its step compiles in about a second where SmolLM2's 30 layers take eight. Seeded:
    every process that builds it gets the same weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model
