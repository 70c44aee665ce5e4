"""Idefics3 / SmolVLM: a Llama decoder whose ``<image>`` tokens take image embeddings.

The decoder is the Llama family's (`models.llama`) built from the checkpoint's
``text_config``; its tensors are ``model.text_model.*`` and ``lm_head.weight``
(`Idefics3ForConditionalGeneration.hf_param_path` maps them to the decoder's names
and skips the encoder's). The image encoder (SigLIP tiles, pixel shuffle,
projection: `vision.idefics3`) runs in its own compiled step (`runner.encoder`)
through `Idefics3ImageEncoder`; the step puts its rows at the image tokens' positions
(`layers.decoder.DecoderModel.stage`'s ``image_embeds``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxengine.models import llama
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import CausalLM, hf_param_path
from jaxengine.models.vision import idefics3 as vision

_ENCODER_PREFIXES = ("model.vision_model.", "model.connector.")


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The decoder's config: ``text_config``'s, with the checkpoint's own LM-head tie."""
    config = llama.from_hf(hf_config.text_config, dtype)
    tied = bool(getattr(hf_config, "tie_word_embeddings", config.tie_word_embeddings))
    return dataclasses.replace(config, tie_word_embeddings=tied)


class Idefics3ForConditionalGeneration(CausalLM):
    """The decoder of a SmolVLM checkpoint (`from_hf`); images come in as embeddings."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``model.text_model.*`` -> the decoder's ``model.*``; encoder tensors -> None."""
        if name.startswith(_ENCODER_PREFIXES):
            return None
        if name.startswith("model.text_model."):
            name = "model." + name.removeprefix("model.text_model.")
        return hf_param_path(name)


class Idefics3ImageEncoder:
    """What the engine's encoder step needs of SmolVLM's image encoder: inputs padded
    to a tile count, the pure forward, and its parameters."""

    def __init__(self, hf_config: Any, dtype: Any) -> None:
        self.config = vision.from_hf(hf_config, dtype)
        self.module = vision.Idefics3VisionEncoder(self.config)

    @property
    def hidden_size(self) -> int:
        return self.config.text_hidden_size

    @property
    def embeds_per_unit(self) -> int:
        return self.config.tokens_per_tile

    def pad(self, inputs: dict[str, np.ndarray], units: int) -> dict[str, np.ndarray]:
        """One image's tiles padded to ``units`` (zero tiles, empty masks: their rows
        are dropped), or zeros of that shape when ``inputs`` is None (warm-up)."""
        v = self.config.vision
        pixels = np.zeros((units, v.num_channels, v.image_size, v.image_size), np.float32)
        masks = np.zeros((units, v.image_size, v.image_size), bool)
        if inputs is not None:
            n = inputs["pixel_values"].shape[0]
            pixels[:n] = inputs["pixel_values"]
            masks[:n] = inputs["pixel_attention_mask"]
        return {"pixel_values": pixels, "pixel_attention_mask": masks}

    def apply(self, params: Any, inputs: dict[str, jax.Array]) -> jax.Array:
        """``[units * tokens_per_tile, hidden_size]`` embeddings of padded tiles."""
        v = self.config.vision
        pixels = inputs["pixel_values"].astype(self.config.dtype)
        patch_mask = vision.patch_mask_of(inputs["pixel_attention_mask"], v.patch_size)
        out = self.module.apply({"params": params}, pixels, patch_mask)
        return out.reshape(-1, out.shape[-1])

    def example_inputs(self) -> tuple:
        """The module's init inputs (`loader.encoder_params`)."""
        return vision.example_inputs(self.config)


def image_encoder(hf_config: Any, dtype: Any) -> Idefics3ImageEncoder:
    return Idefics3ImageEncoder(hf_config, dtype)
