"""Idefics3 / SmolVLM: its processor's output split per image (host side).

The processor expands each ``<image>`` of the prompt into tiles: for an image split
into ``rows x cols`` crops, one run per crop (``<fake_token_around_image>
<row_r_col_c>`` then ``image_seq_len`` image tokens), then the global tile's run
(``<fake_token_around_image><global-img>`` and its image tokens); an image that is not
split has the global run alone. ``pixel_values`` holds the prompt's tiles in that
order. So each image ends with the run that follows a ``<global-img>`` token, and
its tiles are the runs since the previous image.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GLOBAL_IMAGE_TOKEN = "<global-img>"
BIDIRECTIONAL = False
"""The decoder attends causally over image tokens too."""


def embeds_per_unit(processor: Any) -> int:
    """Embeddings per tile: the processor's ``image_seq_len``."""
    return int(processor.image_seq_len)


def max_units(processor: Any, kwargs: dict | None = None) -> int:
    """The most tiles one image gives: ``ceil(longest_edge / max_image_size)`` crops a
    side (when splitting), plus the global tile, as the folder's processor config sets
    them (``kwargs`` are not read: a request that asks for more tiles is refused when
    its images come out larger, `processor.ImageProcessor.process`)."""
    image_processor = processor.image_processor
    if not getattr(image_processor, "do_image_splitting", True):
        return 1
    longest = int(image_processor.size["longest_edge"])
    tile = int(image_processor.max_image_size["longest_edge"])
    side = -(-longest // tile)
    return side * side + 1


def split(ids: list[int], out: dict, processor: Any, image_token_id: int) -> list[dict]:
    """Per image: ``positions`` of its image tokens, its ``inputs`` (``pixel_values``
    ``[tiles, C, S, S]``, ``pixel_attention_mask`` ``[tiles, S, S]`` bool) and
    ``units`` (tiles)."""
    ids_arr = np.asarray(ids)
    per_tile = embeds_per_unit(processor)
    image_pos = np.flatnonzero(ids_arr == image_token_id)
    if len(image_pos) % per_tile:
        raise ValueError(
            f"the prompt has {len(image_pos)} image tokens, not a whole number of "
            f"{per_tile}-token tiles"
        )
    global_id = processor.tokenizer.convert_tokens_to_ids(GLOBAL_IMAGE_TOKEN)
    pixels = np.asarray(out["pixel_values"])[0]
    masks = np.asarray(
        out.get("pixel_attention_mask", np.ones(pixels.shape[:1] + pixels.shape[2:]))
    )[0]
    images, tiles = [], []
    for t, first in enumerate(image_pos[::per_tile]):
        tiles.append(image_pos[t * per_tile : (t + 1) * per_tile])
        if first > 0 and ids_arr[first - 1] == global_id:
            images.append(tiles)
            tiles = []
    if tiles:
        raise ValueError("the prompt's last image has no global tile (<global-img>)")
    items, start = [], 0
    for runs in images:
        n = len(runs)
        items.append(
            dict(
                positions=tuple(int(p) for p in np.concatenate(runs)),
                inputs={
                    "pixel_values": pixels[start : start + n].astype(np.float32),
                    "pixel_attention_mask": masks[start : start + n].astype(bool),
                },
                units=n,
            )
        )
        start += n
    return items
