"""Gemma 3: sandwich norms, QK-norm, sliding-window layers, scaled embeddings; images.

Each layer normalizes before and after attention and before and after the MLP; norms
multiply by ``1 + weight``. Local (sliding-window) and global layers alternate as
``layer_types`` says, each kind with its own rope base. Embeddings are scaled by
``sqrt(hidden_size)``; scores use ``query_pre_attn_scalar ** -0.5``; optional soft caps
on attention scores and final logits.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jaxengine.models.layers.attention import Attention
from jaxengine.models.layers.basic import RMSNorm
from jaxengine.models.layers.config import LayerSpec, RopeSpec, TransformerConfig, rope_from_hf
from jaxengine.models.layers.decoder import CausalLM, hf_param_path
from jaxengine.models.layers.mlp import GatedMLP
from jaxengine.models.vision import gemma3 as vision


def _rope(hf_config: Any, layer_type: str) -> RopeSpec:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type in params:
        return rope_from_hf(hf_config, layer_type)
    if layer_type == "sliding_attention":  # legacy configs: a plain local base
        return RopeSpec(theta=float(getattr(hf_config, "rope_local_base_freq", 10000.0)))
    return rope_from_hf(hf_config)


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Gemma3TextConfig (a vision-language Gemma3Config's
    ``text_config``)."""
    hf_config = getattr(hf_config, "text_config", None) or hf_config
    window = hf_config.sliding_window
    layers = tuple(
        LayerSpec(
            rope=_rope(hf_config, t), sliding_window=window if t == "sliding_attention" else None
        )
        for t in hf_config.layer_types
    )
    return TransformerConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=hf_config.head_dim,
        layers=layers,
        rms_norm_eps=hf_config.rms_norm_eps,
        norm_offset=1.0,
        hidden_act=getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        o_bias=bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=True,
        sm_scale=hf_config.query_pre_attn_scalar**-0.5,
        attn_logit_softcap=getattr(hf_config, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
        embed_scale=hf_config.hidden_size**0.5,
        dtype=dtype,
    )


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP blocks."""

    config: TransformerConfig
    spec: LayerSpec
    attention_kwargs: Any = None
    moe_kwargs: Any = None  # dense: no experts to place

    @nn.compact
    def __call__(self, x, positions, kv_cache, md):
        cfg = self.config
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=cfg.dtype)
        attn = Attention(cfg, self.spec, **(self.attention_kwargs or {}), name="self_attn")
        h, kv_cache = attn(RMSNorm(**norm, name="input_layernorm")(x), positions, kv_cache, md)
        x = x + RMSNorm(**norm, name="post_attention_layernorm")(h)
        h = GatedMLP(cfg, name="mlp")(
            RMSNorm(**norm, name="pre_feedforward_layernorm")(x), md.lora_slots
        )
        return x + RMSNorm(**norm, name="post_feedforward_layernorm")(h), kv_cache


class Gemma3ForCausalLM(CausalLM):
    """`CausalLM` with Gemma 3 decoder layers."""

    layer_cls: Any = Gemma3DecoderLayer


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The decoder of a Gemma 3 vision-language checkpoint (``text_config``); its
    images come in as embeddings (`Gemma3ImageEncoder`) whose tokens attend to each
    other both ways (`multimodal.gemma3`)."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``[model.]language_model.[model.]*`` -> the decoder's ``model.*``; the
        tower's and projector's tensors -> None."""
        body = name.removeprefix("model.")
        if body.startswith(("vision_tower.", "multi_modal_projector.")):
            return None
        if body.startswith("language_model."):
            rest = body.removeprefix("language_model.")
            name = rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
        return hf_param_path(name)


class Gemma3ImageEncoder:
    """What the engine's encoder step needs of Gemma 3's image encoder (SigLIP, pool,
    projection: `vision.gemma3`): one square image per unit."""

    def __init__(self, hf_config: Any, dtype: Any) -> None:
        self.config = vision.from_hf(hf_config, dtype)
        self.module = vision.Gemma3VisionEncoder(self.config)

    @property
    def hidden_size(self) -> int:
        return self.config.text_hidden_size

    @property
    def embeds_per_unit(self) -> int:
        return self.config.mm_tokens_per_image

    def pad(self, inputs: dict[str, np.ndarray] | None, units: int) -> dict[str, np.ndarray]:
        """Images padded to ``units`` with zero images (their rows are dropped)."""
        v = self.config.vision
        pixels = np.zeros((units, v.num_channels, v.image_size, v.image_size), np.float32)
        if inputs is not None:
            pixels[: inputs["pixel_values"].shape[0]] = inputs["pixel_values"]
        return {"pixel_values": pixels}

    def apply(self, params: Any, inputs: dict[str, jax.Array]) -> jax.Array:
        """``[units * mm_tokens_per_image, hidden_size]`` embeddings."""
        pixels = inputs["pixel_values"].astype(self.config.dtype)
        out = self.module.apply({"params": params}, pixels)
        return out.reshape(-1, out.shape[-1])

    def example_inputs(self) -> tuple:
        """The module's init inputs (`loader.encoder_params`)."""
        return vision.example_inputs(self.config)


def image_encoder(hf_config: Any, dtype: Any) -> Gemma3ImageEncoder | None:
    """A vision-language checkpoint's image encoder; None for a text-only one."""
    if getattr(hf_config, "vision_config", None) is None:
        return None
    return Gemma3ImageEncoder(hf_config, dtype)
