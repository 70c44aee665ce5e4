"""Qwen3.5: its processor (without torchvision) and its output split per image.

Qwen3.5 checkpoints name transformers' ``Qwen3VLProcessor``, whose video processor
needs torchvision, so `load_processor` builds it from the folder's tokenizer and
image processor alone (`qwen2_5_vl.images_only_class`). Its image side is Qwen2.5-VL's:
the image processor is Qwen2-VL's (PIL), each ``<|image_pad|>`` becomes ``t*h*w / m**2``
image tokens, ``pixel_values [patches, C*T*p*p]`` and ``image_grid_thw [images, 3]``
come the same way, and so do the split per image, the unit (one decoder token) and
the size limits: this module reuses them. Videos are not supported (`processor.
prompt_images` refuses every modality but images).
"""

from __future__ import annotations

from typing import Any

from jaxengine.multimodal import qwen2_5_vl
from jaxengine.multimodal.items import image_text_processor

BIDIRECTIONAL = False
"""The decoder attends causally over image tokens too."""

split = qwen2_5_vl.split
embeds_per_unit = qwen2_5_vl.embeds_per_unit
max_units = qwen2_5_vl.max_units


def load_processor(folder: str) -> Any:
    """The model's processor from its folder, for images and text only (module doc)."""
    return image_text_processor(folder, qwen2_5_vl.images_only_class("Qwen3VLProcessor"))
