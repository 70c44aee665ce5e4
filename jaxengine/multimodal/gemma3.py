"""Gemma 3: its processor's output split per image (host side).

The processor replaces each ``<start_of_image>`` of the prompt with
``\\n\\n<start_of_image>`` + ``image_seq_length`` image tokens + ``<end_of_image>\\n\\n``
and gives ``pixel_values [images, C, S, S]``, one square image each (pan-and-scan off:
its crops would add images the prompt did not name). Each image is one unit of
``image_seq_length`` embeddings, and its tokens attend to each other both ways in
the decoder (``BIDIRECTIONAL``), as transformers' Gemma 3 masks them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BIDIRECTIONAL = True


def embeds_per_unit(processor: Any) -> int:
    return int(processor.image_seq_length)


def max_units(processor: Any, kwargs: dict | None = None) -> int:
    """One square image, whatever the processor arguments."""
    return 1


def split(ids: list[int], out: dict, processor: Any, image_token_id: int) -> list[dict]:
    """Per image: ``positions`` of its run of image tokens, ``inputs``
    (``pixel_values [1, C, S, S]``) and ``units`` 1."""
    n = embeds_per_unit(processor)
    positions = np.flatnonzero(np.asarray(ids) == image_token_id)
    pixels = np.asarray(out["pixel_values"])
    if len(positions) != n * pixels.shape[0]:
        raise ValueError(
            f"the prompt has {len(positions)} image tokens for {pixels.shape[0]} images of "
            f"{n} tokens (pan-and-scan, do_pan_and_scan, is not supported yet)"
        )
    runs = positions.reshape(-1, n)
    if np.any(runs[:, -1] - runs[:, 0] != n - 1):
        raise ValueError("an image's tokens are not one contiguous run")
    return [
        dict(
            positions=tuple(int(p) for p in run),
            inputs={"pixel_values": pixels[i : i + 1].astype(np.float32)},
            units=1,
        )
        for i, run in enumerate(runs)
    ]
