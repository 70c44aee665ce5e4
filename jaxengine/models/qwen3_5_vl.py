"""Qwen3.5 with images: the hybrid Qwen3.5 decoder (`models.qwen3_next`) with M-RoPE
in its full-attention layers, whose ``<|image_pad|>`` tokens take image embeddings
(``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``).

The decoder is the one of ``text_config`` (`qwen3_next.from_hf`). Its gated
full-attention layers rotate by M-RoPE positions, ``mrope_section`` split over the
rows with the rows interleaved (t, h, w, t, h, w, ...: transformers'
``Qwen3_5TextRotaryEmbedding``; `layers.rope.apply_mrope`); the step carries them in
``md.mrope_positions``, computed on the host from the request's images as for
Qwen2.5-VL (`Qwen3_5ImageEncoder.mrope_positions`). The Gated DeltaNet layers take no
positions, in transformers as here. Its tensors are ``model.language_model.*`` and
``lm_head.weight``; the tower's (``model.visual.*``) load into the image encoder
(`vision.qwen3_5`), which runs in its own compiled step (`runner.encoder`): one image
per call, its patch rows padded to a bucket of tokens. Multi-token-prediction tensors
(``mtp.*``) are skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxengine.models import qwen3_next
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.qwen2_5_vl import Qwen2_5_VLImageEncoder
from jaxengine.models.vision import qwen3_5 as vision
from jaxengine.models.vision import qwen3_5_inputs as host

DEFAULT_MROPE_SECTION = (11, 11, 10)
"""transformers' split of the rotary frequencies over (t, h, w) when the config has none."""


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The decoder's config: ``text_config``'s hybrid config with interleaved M-RoPE in
    every attention layer and the checkpoint's own LM-head tie."""
    text = getattr(hf_config, "text_config", None) or hf_config
    config = qwen3_next.from_hf(text, dtype)
    rope = getattr(text, "rope_parameters", None) or {}
    section = tuple(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)
    layers = []
    for spec in config.layers:
        mrope = dict(mrope_section=section, mrope_interleaved=True)
        layers.append(dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, **mrope)))
    tied = bool(getattr(hf_config, "tie_word_embeddings", config.tie_word_embeddings))
    return dataclasses.replace(config, layers=tuple(layers), tie_word_embeddings=tied)


class Qwen3_5ForConditionalGeneration(qwen3_next.Qwen3NextForCausalLM):  # noqa: N801 - HF's name
    """The decoder of a Qwen3.5 checkpoint (`from_hf`); images come in as embeddings."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``model.language_model.*`` -> the decoder's ``model.*``; the tower's and the
        multi-token-prediction layer's -> None."""
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        return qwen3_next.Qwen3NextForCausalLM.hf_param_path(name)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):  # noqa: N801
    """Qwen3.5-MoE with images: the same, every MLP experts plus a shared expert."""


class Qwen3_5ImageEncoder(Qwen2_5_VLImageEncoder):
    """Qwen2.5-VL's encoder step contract (one image's rows padded to a number of
    tokens, the decoder's M-RoPE positions) over Qwen3.5's tower and its layout."""

    layout_type = host.VisionLayout
    vision_layout = staticmethod(host.vision_layout)

    def __init__(self, hf_config: Any, dtype: Any) -> None:
        self.config = host.Qwen3_5VisionConfig.from_hf(hf_config.vision_config, dtype)
        self.module = vision.Qwen3_5VisionModel(self.config)

    def example_inputs(self) -> tuple:
        """The module's init inputs (`loader.encoder_params`)."""
        return vision.example_inputs(self.config)


def image_encoder(hf_config: Any, dtype: Any) -> Qwen3_5ImageEncoder:
    return Qwen3_5ImageEncoder(hf_config, dtype)
