"""Qwen2.5-VL: a Qwen2 decoder with M-RoPE whose ``<|image_pad|>`` tokens take image
embeddings.

The decoder is the Qwen2 family's (`models.qwen2`) built from the checkpoint's
``text_config``, every layer's rope an M-RoPE (`layers.rope.apply_mrope`, split by
``mrope_section``): the step carries each token's (temporal, height, width) positions
in ``md.mrope_positions``, which the host computes from the request's images
(`Qwen2_5_VLImageEncoder.mrope_positions`). Its tensors are
``model.language_model.*`` and ``lm_head.weight`` (older checkpoints: ``model.*``);
the tower's (``model.visual.*`` or ``visual.*``) load into the image encoder, which
runs in its own compiled step (`runner.encoder`): one image per call, its patch rows
padded to a bucket of tokens (`vision.qwen2_5_vl`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxengine.models import qwen2
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import CausalLM, hf_param_path
from jaxengine.models.vision import qwen2_5_vl as vision
from jaxengine.models.vision import qwen2_5_vl_inputs as host


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The decoder's config: ``text_config``'s Qwen2 config with M-RoPE layers and the
    checkpoint's own LM-head tie."""
    text = getattr(hf_config, "text_config", None) or hf_config
    config = qwen2.from_hf(text, dtype)
    section = host.mrope_section(text)
    layers = []
    for spec in config.layers:
        rope_type = "default" if spec.rope.rope_type == "mrope" else spec.rope.rope_type
        rope = dataclasses.replace(spec.rope, rope_type=rope_type, mrope_section=section)
        layers.append(dataclasses.replace(spec, rope=rope))
    tied = bool(getattr(hf_config, "tie_word_embeddings", config.tie_word_embeddings))
    return dataclasses.replace(config, layers=tuple(layers), tie_word_embeddings=tied)


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    """The decoder of a Qwen2.5-VL checkpoint (`from_hf`); images come in as embeddings."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``model.language_model.*`` -> the decoder's ``model.*``; the tower's -> None."""
        if name.startswith(("model.visual.", "visual.")):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        return hf_param_path(name)


class Qwen2_5_VLImageEncoder:
    """What the engine's encoder step needs of Qwen2.5-VL's tower: one image's patch
    rows padded to a number of tokens (a unit is one token, ``m*m`` patch rows) with
    their layout, the pure forward, its parameters, and the decoder's positions."""

    mrope = True
    """Every batch of this model carries M-RoPE positions (`runner.encoder`)."""
    layout_type: Any = host.VisionLayout
    """The tower's per-row layout (Qwen3.5's encoder swaps it and `vision_layout`)."""
    vision_layout = staticmethod(host.vision_layout)

    def __init__(self, hf_config: Any, dtype: Any) -> None:
        self.config = host.Qwen2_5_VisionConfig.from_hf(hf_config.vision_config, dtype)
        self.module = vision.Qwen2_5_VisionTransformer(self.config)

    @property
    def hidden_size(self) -> int:
        return self.config.out_hidden_size

    @property
    def embeds_per_unit(self) -> int:
        return 1

    def pad(self, inputs: dict[str, np.ndarray] | None, units: int) -> dict[str, np.ndarray]:
        """One image's rows padded to ``units`` tokens, and the layout of its windows
        (`qwen2_5_vl_inputs.vision_layout`); padding only when ``inputs`` is None
        (warm-up). The padded tokens come out last, and their rows are dropped."""
        cfg = self.config
        rows = np.zeros((units * cfg.merge_unit, cfg.patch_dim), np.float32)
        grid = np.zeros((0, 3), np.int64)
        if inputs is not None:
            pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
            rows[: len(pixels)] = pixels
        layout = self.vision_layout(grid, cfg, len(rows))
        fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
        return {"pixel_values": rows, **fields}

    def apply(self, params: Any, inputs: dict[str, jax.Array]) -> jax.Array:
        """``[units, hidden_size]`` embeddings of an image's padded rows."""
        layout = self.layout_type(**{k: v for k, v in inputs.items() if k != "pixel_values"})
        return self.module.apply({"params": params}, inputs["pixel_values"], layout)

    def example_inputs(self) -> tuple:
        """The module's init inputs (`loader.encoder_params`)."""
        return vision.example_inputs(self.config)

    def mrope_positions(
        self, images: Sequence[tuple], grids: Sequence[tuple], start: int, count: int
    ) -> np.ndarray:
        """Positions ``[3, count]`` of a request's tokens ``start..`` whose images are
        ``(key, prompt positions)`` pairs with their token ``grids``."""
        firsts = [(positions[0], grid) for (_, positions), grid in zip(images, grids, strict=True)]
        return host.mrope_chunk(start, count, firsts)


def image_encoder(hf_config: Any, dtype: Any) -> Qwen2_5_VLImageEncoder:
    return Qwen2_5_VLImageEncoder(hf_config, dtype)
