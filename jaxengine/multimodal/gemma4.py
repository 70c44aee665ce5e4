"""Gemma 4: its processor (images and text only) and its output split per image.

transformers' ``Gemma4Processor`` also holds an audio feature extractor and a video
processor (which needs torchvision), so `load_processor` builds it from the folder's
tokenizer and image processor (``AutoImageProcessor``: the PIL
``Gemma4ImageProcessorPil`` without torchvision), in a subclass without the other two.
Its ``__call__`` is transformers' own: each image placeholder of the prompt becomes
``boi`` + one image token per soft token + ``eoi``; ``pixel_values [images, L, 3p^2]``
holds each image's patch rows (aspect ratio kept, at most ``max_soft_tokens * k^2``
patches) padded to L, ``image_position_ids [images, L, 2]`` their grid coordinates
(-1 on padding).

One image is one `ImageItem` of ``units`` = its soft tokens (one embedding each; the
encoder pads its patch rows to a bucket of units). Its tokens attend to each other
both ways when the decoder's ``use_bidirectional_attention`` is ``"vision"``
(`both_ways`; the sliding layers only, `models.gemma4`). Video and audio are not
supported.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from jaxengine.multimodal.items import image_text_processor

BIDIRECTIONAL = False
"""Without ``use_bidirectional_attention="vision"`` the decoder is causal (`both_ways`)."""


def both_ways(hf_config: Any) -> bool:
    """Whether the checkpoint's image tokens attend to each other both ways."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return getattr(text, "use_bidirectional_attention", None) == "vision"


def load_processor(folder: str) -> Any:
    """The model's processor from its folder, for images and text only (module doc)."""
    return image_text_processor(folder, _processor_class())


@functools.cache
def _processor_class() -> type:
    import transformers
    from transformers.processing_utils import ProcessorMixin

    class Gemma4ImageProcessor(transformers.Gemma4Processor):
        """transformers' processor with an image processor and a tokenizer only."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
            self.image_token_id = tokenizer.image_token_id
            self.image_token = tokenizer.image_token
            self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
            for name in ("audio_token", "boa_token", "eoa_token"):  # checked, never used
                setattr(self, name, getattr(tokenizer, name, None) or name)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return Gemma4ImageProcessor


def embeds_per_unit(processor: Any) -> int:
    """One unit is one soft token (``k x k`` patches)."""
    return 1


def max_units(processor: Any, kwargs: dict | None = None) -> int:
    """The most soft tokens one image gives with the processor arguments ``kwargs``
    (``max_soft_tokens``, flat or under ``images_kwargs``), else its config's."""
    kwargs = dict(kwargs or {})
    kwargs.update(kwargs.pop("images_kwargs", None) or {})
    return int(kwargs.get("max_soft_tokens") or processor.image_processor.max_soft_tokens)


def split(ids: list[int], out: dict, processor: Any, image_token_id: int) -> list[dict]:
    """Per image: ``positions`` of its run of image tokens, its ``inputs`` (its real
    ``pixel_values [rows, 3p^2]`` and ``image_position_ids [rows, 2]``) and ``units``
    (its soft tokens)."""
    pixels = np.asarray(out["pixel_values"])
    coords = np.asarray(out["image_position_ids"])
    k2 = int(processor.image_processor.pooling_kernel_size) ** 2
    real = np.all(coords != -1, axis=-1).sum(axis=1)  # [images]: real patch rows first
    positions = np.flatnonzero(np.asarray(ids) == image_token_id)
    runs = (
        np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1) if len(positions) else []
    )
    if [len(r) * k2 for r in runs] != real.tolist():
        raise ValueError(
            f"the prompt's image-token runs {[len(r) for r in runs]} do not match its "
            f"images' soft tokens {(real // k2).tolist()}"
        )
    return [
        dict(
            positions=tuple(int(p) for p in run),
            inputs={
                "pixel_values": pixels[i, : real[i]].astype(np.float32),
                "image_position_ids": coords[i, : real[i]].astype(np.int32),
            },
            units=len(run),
        )
        for i, run in enumerate(runs)
    ]
