"""Llama family: Llama 2/3, SmolLM2, TinyLlama, and Mistral (the same architecture).

Pre-norm decoder with grouped-query attention, SwiGLU MLP and rotary embeddings
(default, linear, dynamic, llama3 or yarn scaling); Mistral adds a sliding window.
"""

from __future__ import annotations

from typing import Any

from jaxengine.models.layers.config import LayerSpec, TransformerConfig, head_dim_of, rope_from_hf
from jaxengine.models.layers.decoder import CausalLM


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a LlamaConfig or MistralConfig."""
    window = getattr(hf_config, "sliding_window", None)
    spec = LayerSpec(rope=rope_from_hf(hf_config), sliding_window=window)
    bias = bool(getattr(hf_config, "attention_bias", False))
    return TransformerConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        head_dim=head_dim_of(hf_config),
        layers=(spec,) * hf_config.num_hidden_layers,
        rms_norm_eps=hf_config.rms_norm_eps,
        hidden_act=hf_config.hidden_act,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        dtype=dtype,
    )


class LlamaForCausalLM(CausalLM):
    """`CausalLM` configured by `from_hf`."""


MistralForCausalLM = LlamaForCausalLM
