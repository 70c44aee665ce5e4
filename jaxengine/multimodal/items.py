"""One image of a prompt, as the engine carries it: content hash, positions, inputs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np


def image_text_processor(folder: str, processor_cls: type) -> Any:
    """``processor_cls`` (a transformers processor class cut to images and text) built
    from ``folder``'s tokenizer, image processor and chat template."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    images = transformers.AutoImageProcessor.from_pretrained(folder)
    chat_template = getattr(tokenizer, "chat_template", None)
    return processor_cls(images, tokenizer, chat_template=chat_template)


@dataclasses.dataclass(frozen=True, eq=False)
class ImageItem:
    """An image after the processor: what the encoder takes and where its output goes.

    ``positions`` are the prompt positions whose input embeddings are the encoder's
    output rows, in order (row k at ``positions[k]``); the tokens between them (an
    Idefics3 tile's row/column markers) stay text. ``units`` is the encoder's size
    unit that compiled shapes are bucketed by (Idefics3: tiles)."""

    key: str
    """Content hash of the pixels and the processor arguments (`image_key`)."""
    positions: tuple[int, ...]
    inputs: dict[str, np.ndarray]
    """The processor's arrays for this image alone (e.g. ``pixel_values``)."""
    units: int
    grid: tuple[int, int, int] | None = None
    """Its decoder tokens as (frames, rows, columns) in an M-RoPE model (Qwen2.5-VL:
    their 3-D positions); None elsewhere."""

    @property
    def start(self) -> int:
        return self.positions[0]

    @property
    def end(self) -> int:
        """One past the last position it fills."""
        return self.positions[-1] + 1

    @property
    def num_embeds(self) -> int:
        return len(self.positions)

    def placement(self) -> tuple[str, tuple[int, ...]]:
        """What the runner keeps of it: ``(key, positions)``."""
        return self.key, self.positions


def to_pil(image: Any) -> Any:
    """A ``PIL.Image`` in RGB from a PIL image or an ``[H, W, C]`` / ``[H, W]`` uint8
    numpy array; ValueError naming the type for anything else."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError(
                "an image given as a numpy array must be uint8 [height, width] or "
                f"[height, width, channels], got {image.dtype} {list(image.shape)}"
            )
        return Image.fromarray(image).convert("RGB")
    kind = type(image).__name__
    raise ValueError(
        f"multi_modal_data['image'] takes PIL images or uint8 numpy arrays, got {kind}"
    )


def image_key(image: Any, processor_kwargs: dict | None) -> str:
    """SHA-256 of an RGB PIL image's size and pixels and the processor arguments:
    the same picture under the same arguments gives the same key in any process."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    digest.update(json.dumps(processor_kwargs or {}, sort_keys=True, default=str).encode())
    return digest.hexdigest()
