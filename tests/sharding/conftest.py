"""Tiny random checkpoints and a one-device reference for the parallelism tests.

Every parallel layout runs on the 8 virtual CPU devices that tests/conftest.py sets
up, with token-id prompts (no tokenizer) and float32 weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import tiny_llama_config

VOCAB = 256
ENGINE_KWARGS = dict(
    skip_tokenizer_init=True,
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    compile_token_buckets=[32],
    enable_compilation_cache=False,
    swap_space=0,
)
PROMPTS = [list(np.random.RandomState(i).randint(0, VOCAB, 5 + 7 * i)) for i in range(4)]
MAX_TOKENS = 10


def save_checkpoint(hf_config, path) -> str:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    """8 query heads, 2 KV heads: TP 4 and 8 store one KV head per device."""
    config = tiny_llama_config(VOCAB, num_hidden_layers=4, num_attention_heads=8)
    return save_checkpoint(config, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> str:
    """Qwen3-MoE: 8 experts, top 2, every layer sparse."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=256,
    )
    return save_checkpoint(config, tmp_path_factory.mktemp("qwen3_moe"))
