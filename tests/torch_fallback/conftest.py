"""Tiny random checkpoints of architectures run through ``--model-impl transformers``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

VOCAB = 256
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256
    ),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **SIZES, intermediate_size=128, max_position_embeddings=256
    ),
    "opt": lambda: transformers.OPTConfig(
        **SIZES, ffn_dim=128, max_position_embeddings=256, word_embed_proj_dim=64
    ),
    "olmo2": lambda: transformers.Olmo2Config(
        **SIZES, intermediate_size=128, max_position_embeddings=256
    ),
    "phi": lambda: transformers.PhiConfig(
        **SIZES, intermediate_size=128, max_position_embeddings=256
    ),
    "llama": lambda: transformers.LlamaConfig(
        **SIZES, num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256
    ),
}
PROMPTS = [list(np.random.RandomState(i).randint(0, VOCAB, n)) for i, n in enumerate((5, 19, 33))]
ENGINE_KWARGS = dict(
    model_impl="transformers",
    skip_tokenizer_init=True,
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=16,  # prompts of 19 and 33 tokens prefill in chunks
    compile_token_buckets=[16],
    num_gpu_blocks_override=32,
    swap_space=0,
    enable_compilation_cache=False,
)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Architecture -> (folder, transformers' own model of it, eager attention)."""
    made = {}

    def get(arch: str):
        if arch not in made:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                CONFIGS[arch](), attn_implementation="eager"
            ).eval()
            folder = tmp_path_factory.mktemp(arch)
            model.save_pretrained(folder)
            made[arch] = (str(folder), model)
        return made[arch]

    return get
