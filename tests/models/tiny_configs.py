"""Config pieces of the tiny models that the golden test (`test_golden_tiny.py`), the
engine test (`test_new_families_engine.py`) and the placement tests
(`tests/sharding/placement_checks.py`) share: their common sizes, and Llama 4 and Phi-3
(LongRoPE) pieces that take a test's own tiny base (``small``: vocabulary, hidden
size, heads, ...)."""

from __future__ import annotations

TINY_SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
"""Hidden size, MLP width, layers, heads and positions of the tests' tiny bases (each
test adds its vocabulary); the family helpers (`llama4_tiny`, ``glm4_moe_tiny``,
``gpt_oss_tiny``) build on them."""


def llama4_tiny(small: dict) -> dict:
    """Llama4TextConfig keyword arguments on ``small``: four layers, three of them
    chunked local rope layers (chunks of 8: the tests' prompts cross them) and a global
    NoPE layer whose attention temperature grows within the prompts (floor_scale 4);
    layer 0 dense, layers 1-3 sigmoid top-1 MoE over 4 experts with a shared expert;
    eager attention."""
    return {
        **{**small, "num_hidden_layers": 4},
        "head_dim": 16,
        "intermediate_size_mlp": 80,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "moe_layers": [1, 2, 3],
        "attention_chunk_size": 8,
        "floor_scale": 4,
        "attn_scale": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attn_implementation": "eager",
    }


def longrope_parameters(small: dict, **extra) -> dict:
    """LongRoPE parameters for a tiny Phi-3 rotating 3/4 of each head (as Phi-4-mini),
    with distinct short and long factors, and ``extra``. (The original length is the
    config's own ``original_max_position_embeddings``: Phi3Config overrides this dict's
    with it.)"""
    rot_half = int(small["hidden_size"] // small["num_attention_heads"] * 0.75) // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.5 * i for i in range(rot_half)],
        "long_factor": [2.0 + 3.0 * i for i in range(rot_half)],
        **extra,
    }
