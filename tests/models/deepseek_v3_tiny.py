"""Tiny DeepSeek-V3 (``DeepseekV3ForCausalLM``) configs for the golden and engine tests.

Both take a test's tiny base (``small``: vocabulary, hidden size, heads, ...) and keep
its vocabulary and hidden size; the correction bias is randomized with GLM-4.5's
helpers (`tests.models.glm4_moe_tiny`: same parameter name), so it changes routes.
"""

from __future__ import annotations

MLA_SIZES = dict(
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
"""Small multi-head latent attention widths, all different (a swapped pair would show)."""


def deepseek_v3_tiny(small: dict, **overrides) -> dict:
    """DeepseekV3Config keyword arguments: 2 dense then 2 MoE layers of 8 experts in 4
    groups (2 eligible, 3 per token), a shared expert, scaled renormalized weights;
    MLA with a q low-rank path; YaRN (factor 4 over an original 64 positions) with
    ``mscale`` 1.0 and ``mscale_all_dim`` 0.8, so both the cos/sin factor and the
    softmax scale differ from plain rope; eager attention. ``overrides`` win."""
    base = {k: v for k, v in small.items() if k != "num_key_value_heads"}
    return {
        **base,
        "num_hidden_layers": 4,
        "num_key_value_heads": small["num_attention_heads"],
        **MLA_SIZES,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        "attn_implementation": "eager",
        **overrides,
    }


def kimi_k2_tiny(small: dict) -> dict:
    """Kimi K2's shape of the same architecture: more experts (16, 4 per token) in one
    group, a single dense layer, ``mscale`` = ``mscale_all_dim`` = 1.0 (the cos/sin
    factor cancels, the softmax scale does not), a larger routed scaling factor; and
    queries through one ``q_proj`` (``q_lora_rank`` None), DeepSeek-V2-Lite's path."""
    return deepseek_v3_tiny(
        small,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        routed_scaling_factor=2.827,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
        },
    )
