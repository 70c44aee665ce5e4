"""Qwen2 family: the Llama architecture with biases on q/k/v (not on o_proj).

Qwen2's optional sliding window applies to layers from ``max_window_layers`` on, and
only when ``use_sliding_window`` is set; `layer_types` in the config says which.
"""

from __future__ import annotations

from typing import Any

from jaxengine.models import llama
from jaxengine.models.layers.config import LayerSpec, TransformerConfig, rope_from_hf
from jaxengine.models.layers.decoder import CausalLM


def layer_specs(hf_config: Any) -> tuple[LayerSpec, ...]:
    """Per-layer rope and window from `layer_types` (full or sliding attention)."""
    rope = rope_from_hf(hf_config)
    types = getattr(hf_config, "layer_types", None) or (
        ["full_attention"] * hf_config.num_hidden_layers
    )
    window = getattr(hf_config, "sliding_window", None)
    return tuple(
        LayerSpec(rope=rope, sliding_window=window if t == "sliding_attention" else None)
        for t in types
    )


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Qwen2Config."""
    import dataclasses

    base = llama.from_hf(hf_config, dtype)
    return dataclasses.replace(
        base, layers=layer_specs(hf_config), qkv_bias=True, o_bias=False, mlp_bias=False
    )


class Qwen2ForCausalLM(CausalLM):
    """`CausalLM` configured by `from_hf`."""
