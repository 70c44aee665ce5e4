"""Qwen3 family: Qwen2's layout with RMSNorm on queries and keys and no q/k/v bias."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxengine.models import qwen2
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import CausalLM


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Qwen3Config."""
    base = qwen2.from_hf(hf_config, dtype)
    bias = bool(getattr(hf_config, "attention_bias", False))
    return dataclasses.replace(base, qk_norm=True, qkv_bias=bias, o_bias=bias)


class Qwen3ForCausalLM(CausalLM):
    """`CausalLM` configured by `from_hf`."""
