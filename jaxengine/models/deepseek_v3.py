"""DeepSeek-V3 family (``DeepseekV3ForCausalLM``: DeepSeek-V3 / R1, Kimi K2).

Attention is multi-head latent attention (`layers.mla`): the paged cache holds one
row a token, the normalized latent (``kv_lora_rank``) and the rotated shared key
(``qk_rope_head_dim``): 576 values a token and layer at V3's sizes, against
``2 * Hkv * D`` for grouped-query attention. In the `TransformerConfig` that is one
KV head of width ``kv_lora_rank + qk_rope_head_dim`` (``num_kv_heads`` 1, ``head_dim``
the row's width), which is what the cache shape, its sizing and the tensor-parallel
layout read: under tensor parallelism the query heads split and each device holds
its own copy of the latent cache (the layout `sharding.plan` already gives a model
with fewer KV heads than devices), so attention needs no collective; the cache's
memory per device is that of one device.

Rope: only the ``qk_rope_head_dim`` features rotate (``rope_interleave``: adjacent
pairs, `RopeSpec.interleaved`). With YaRN, transformers scales cos/sin by
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the softmax scale
``qk_head_dim ** -0.5`` by ``mscale(factor, mscale_all_dim) ** 2``; both are here.

Layers ``0 .. first_k_dense_replace - 1`` are dense, the rest MoE routed as GLM-4.5's
(`models.glm4_moe`: sigmoid scores, ``e_score_correction_bias``, group-limited top-k,
``routed_scaling_factor``, shared experts), whose checkpoint names and
multi-token-prediction layers (skipped) these checkpoints share. That layer drafts
for ``--speculative-config '{"method": "mtp", ...}'`` (`mtp_layer`, `models.mtp`).
DeepSeek-V2 (its softmax routing ranks groups by their best expert, not the sum of
two) is not served.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn

from jaxengine.models.glm4_moe import Glm4MoeForCausalLM
from jaxengine.models.layers.basic import RMSNorm
from jaxengine.models.layers.config import (
    LayerSpec,
    MLASpec,
    RopeSpec,
    TransformerConfig,
    rope_from_hf,
)
from jaxengine.models.layers.decoder import CausalLM, DecoderLayer
from jaxengine.models.layers.mla import MLAttention
from jaxengine.models.layers.routing import RoutingSpec


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a DeepseekV3Config."""
    rope, mscale = _rope(hf_config)
    mla = MLASpec(
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        q_lora_rank=hf_config.q_lora_rank or None,
    )
    first_moe = hf_config.first_k_dense_replace
    layers = tuple(
        LayerSpec(rope=rope, moe=i >= first_moe) for i in range(hf_config.num_hidden_layers)
    )
    bias = bool(getattr(hf_config, "attention_bias", False))
    qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return TransformerConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=1,  # the latent row, shared by every head
        head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,  # the cache row's width
        layers=layers,
        rms_norm_eps=hf_config.rms_norm_eps,
        hidden_act=hf_config.hidden_act,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        sm_scale=qk_head_dim**-0.5 * mscale * mscale,
        num_experts=hf_config.n_routed_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        routing=_routing(hf_config),
        shared_expert_intermediate_size=hf_config.moe_intermediate_size
        * (hf_config.n_shared_experts or 0),
        dtype=dtype,
        mla=mla,
    )


def _rope(hf_config: Any) -> tuple[RopeSpec, float]:
    """The rope of the ``qk_rope_head_dim`` features, and the softmax scale's mscale."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    spec = rope_from_hf(hf_config)
    interleaved = bool(getattr(hf_config, "rope_interleave", True))
    spec = dataclasses.replace(spec, interleaved=interleaved, partial_rotary_factor=1.0)
    if spec.rope_type == "default":
        return spec, 1.0
    factor = params.get("factor") or (
        hf_config.max_position_embeddings / spec.original_max_position_embeddings
    )
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if spec.rope_type == "yarn" and spec.attention_factor is None and mscale and mscale_all_dim:
        attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        spec = dataclasses.replace(spec, attention_factor=attention_factor)
    spec = dataclasses.replace(spec, factor=float(factor))
    return spec, (_mscale(factor, mscale_all_dim) if mscale_all_dim else 1.0)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _routing(hf_config: Any) -> RoutingSpec:
    """V3's routing: sigmoid scores, chosen with the correction bias among the best
    ``topk_group`` of ``n_group`` groups, weighted by the uncorrected scores."""
    return RoutingSpec(
        scoring="sigmoid",
        correction_bias=True,
        n_group=hf_config.n_group or 1,
        topk_group=hf_config.topk_group or 1,
        scaling_factor=float(hf_config.routed_scaling_factor),
        float32_router=True,
    )


def mtp_layer(hf_config: Any, config: TransformerConfig) -> LayerSpec:
    """The multi-token-prediction layer (``model.layers.{num_hidden_layers}``, `models.mtp`)
    as the stack's next layer would be: the same rope, MoE from ``first_k_dense_replace``."""
    moe = hf_config.num_hidden_layers >= hf_config.first_k_dense_replace
    return dataclasses.replace(config.layers[-1], moe=moe)


class DeepseekV3DecoderLayer(DecoderLayer):
    """`DecoderLayer` with multi-head latent attention (`layers.mla.MLAttention`)."""

    @nn.compact
    def __call__(self, x, positions, kv_cache, md):
        cfg = self.config
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=cfg.dtype)
        attn = MLAttention(cfg, self.spec, **(self.attention_kwargs or {}), name="self_attn")
        h, kv_cache = attn(RMSNorm(**norm, name="input_layernorm")(x), positions, kv_cache, md)
        x = x + h
        h = RMSNorm(**norm, name="post_attention_layernorm")(x)
        return x + self.feed_forward(h, md), kv_cache


class DeepseekV3ForCausalLM(CausalLM):
    """`CausalLM` with `DeepseekV3DecoderLayer`s, configured by `from_hf`; GLM-4.5's
    checkpoint hooks (correction bias name, fused experts, MTP layers skipped), held
    as this class's own so ``DeepseekV3ForSequenceClassification`` reads them too
    (`models._with_checkpoint_hooks`)."""

    layer_cls: Any = DeepseekV3DecoderLayer
    hf_param_path = staticmethod(Glm4MoeForCausalLM.hf_param_path)
    split_tensors = staticmethod(Glm4MoeForCausalLM.split_tensors)
