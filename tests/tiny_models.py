"""Tiny random Llama configs for tests: one definition of the shapes they share."""

from __future__ import annotations

from typing import Any

import transformers


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
