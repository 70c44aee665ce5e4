"""Qwen2.5-VL: its processor (without torchvision) and its output split per image.

transformers' ``Qwen2_5_VLProcessor`` cannot be built without torchvision (its video
processor's base class needs it, and ``AutoProcessor`` builds that too), so
`load_processor` builds it from its parts: the folder's tokenizer and image processor
(``AutoImageProcessor``: the PIL ``Qwen2VLImageProcessorPil`` without torchvision),
in a subclass that has no video processor. Its ``__call__`` is transformers' own: each
``<|image_pad|>`` of the prompt becomes ``t*h*w / m**2`` image tokens, ``pixel_values``
holds every image's patch rows one image after another ``[patches, C*T*p*p]``, and
``image_grid_thw [images, 3]`` their patch grids.

One image is one `ImageItem` of ``units`` = its token count (one embedding each) and
``grid`` = its tokens as (frames, rows, columns): the decoder's M-RoPE positions
(`models.vision.qwen2_5_vl_inputs.mrope_chunk`). Videos are not supported.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from jaxengine.multimodal.items import image_text_processor

BIDIRECTIONAL = False
"""The decoder attends causally over image tokens too."""


def load_processor(folder: str) -> Any:
    """The model's processor from its folder, for images and text only (module doc)."""
    return image_text_processor(folder, images_only_class("Qwen2_5_VLProcessor"))


@functools.cache
def images_only_class(base: str) -> type:
    """transformers' processor class ``base`` (Qwen2.5-VL's, or Qwen3-VL's that Qwen3.5
    uses) built from an image processor and a tokenizer, without a video processor."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    class Qwen2_5_VLImageProcessor(getattr(transformers, base)):
        """transformers' processor with an image processor and a tokenizer only."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return Qwen2_5_VLImageProcessor


def _merge_size(processor: Any) -> int:
    return int(processor.image_processor.merge_size)


def embeds_per_unit(processor: Any) -> int:
    """One unit is one decoder token (``m x m`` patches)."""
    return 1


def max_pixels(processor: Any, kwargs: dict | None = None) -> int:
    """The most pixels the processor resizes an image to with the call arguments
    ``kwargs`` (``max_pixels``, else ``size["longest_edge"]``, flat or under
    ``images_kwargs``, as transformers reads them), else its own config's."""
    kwargs = dict(kwargs or {})
    kwargs.update(kwargs.pop("images_kwargs", None) or {})
    size = kwargs.get("size") or {}
    asked = kwargs.get("max_pixels") or (
        size.get("longest_edge") if isinstance(size, dict) else None
    )
    if asked is not None:
        return int(asked)
    image_processor = processor.image_processor
    own = getattr(image_processor, "size", None) or {}
    return int(own.get("longest_edge") or image_processor.max_pixels)


def max_units(processor: Any, kwargs: dict | None = None) -> int:
    """The most tokens one image gives with the processor arguments ``kwargs`` (the
    engine's ``--mm-processor-kwargs``; a request's over them): `max_pixels` over the
    pixels of one token."""
    side = int(processor.image_processor.patch_size) * _merge_size(processor)
    return max_pixels(processor, kwargs) // (side * side)


def split(ids: list[int], out: dict, processor: Any, image_token_id: int) -> list[dict]:
    """Per image: ``positions`` of its run of image tokens, its ``inputs``
    (``pixel_values [patches, C*T*p*p]``, ``image_grid_thw [1, 3]``), ``units`` (its
    tokens) and ``grid`` (its tokens as frames, rows, columns)."""
    m = _merge_size(processor)
    grids = np.asarray(out["image_grid_thw"], np.int64).reshape(-1, 3)
    pixels = np.asarray(out["pixel_values"])
    tokens = grids.prod(axis=1) // (m * m)
    positions = np.flatnonzero(np.asarray(ids) == image_token_id)
    if len(positions) != tokens.sum():
        raise ValueError(
            f"the prompt has {len(positions)} image tokens, its images need {tokens.sum()}"
        )
    items, starts = [], np.cumsum(grids.prod(axis=1)) - grids.prod(axis=1)
    for i, run in enumerate(np.split(positions, np.cumsum(tokens)[:-1])):
        t, h, w = (int(v) for v in grids[i])
        if run[-1] - run[0] != len(run) - 1:
            raise ValueError("an image's tokens are not one contiguous run")
        rows = pixels[starts[i] : starts[i] + t * h * w]
        items.append(
            dict(
                positions=tuple(int(p) for p in run),
                inputs={
                    "pixel_values": rows.astype(np.float32),
                    "image_grid_thw": grids[i : i + 1],
                },
                units=len(run),
                grid=(t, h // m, w // m),
            )
        )
    return items
