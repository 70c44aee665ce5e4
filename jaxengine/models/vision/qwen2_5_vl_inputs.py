"""What the host computes for Qwen2.5-VL: the vision tower's patch layout and the
decoder's M-RoPE positions. numpy only: no JAX is imported here (STYLE 1).

The image processor (transformers' ``Qwen2VLImageProcessor``) resizes each image to
multiples of ``patch_size * spatial_merge_size`` and gives ``pixel_values [P, C*T*p*p]``
(one row per patch, every image's rows one after another) and ``image_grid_thw [I, 3]``
(patches along time, height and width). Its rows come in *merge-unit order*: the
``m x m`` patches (``m = spatial_merge_size``) that become one decoder token are
consecutive, units row-major over the image. The tower (`qwen2_5_vl`) needs, per call:

- the *window order* of the rows: whole units regrouped so that each attention window
  (``window_size`` pixels square; windows row-major, units row-major inside each) is
  a contiguous run, as transformers' ``get_vision_window_index`` orders them;
- the (h, w) patch coordinates of each row for the 2-D rotary embedding;
- segment ids: full-attention layers attend within one frame of one image, window
  layers within one window;
- where each output token sits in window order (the reverse permutation).

`vision_layout` gives these for a fixed padded row count, so one compiled program
serves any images that fit. `mrope_positions` gives a prompt's 3-row decoder positions
(transformers' ``get_rope_index`` for images).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

PAD_SEGMENT = -1
"""Segment id of the padding rows: they attend only to each other."""

DEFAULT_MROPE_SECTION = (16, 24, 24)
"""transformers' default split of the rotary frequencies over the (t, h, w) rows."""


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VisionConfig:
    """Shapes of Qwen2.5-VL's vision tower (HF ``Qwen2_5_VLVisionConfig``)."""

    depth: int
    """Number of transformer blocks."""
    hidden_size: int
    """Width of the patch embeddings and of every block."""
    intermediate_size: int
    """Width of the blocks' gated MLP."""
    num_heads: int
    """Attention heads per block; ``hidden_size`` is a multiple of it."""
    out_hidden_size: int
    """Width of the merged tokens: the decoder's hidden size."""
    fullatt_block_indexes: tuple[int, ...]
    """Blocks with full attention (within each frame); the others use windows."""
    patch_size: int = 14
    """Side of one patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    in_channels: int = 3
    """Colour channels."""
    spatial_merge_size: int = 2
    """Side ``m`` of the ``m x m`` patches merged into one decoder token."""
    window_size: int = 112
    """Side of an attention window, in pixels (a multiple of ``patch_size * m``)."""
    hidden_act: str = "silu"
    """Activation of the blocks' gated MLP (HF name)."""
    rope_theta: float = 10000.0
    """Base frequency of the 2-D rotary embedding."""
    dtype: Any = np.float32
    """Parameter and activation dtype (norms, rotary and softmax run in float32)."""

    def __post_init__(self) -> None:
        sizes = (self.depth, self.hidden_size, self.intermediate_size, self.num_heads)
        sizes += (self.out_hidden_size, self.patch_size, self.temporal_patch_size)
        if min(*sizes, self.in_channels, self.spatial_merge_size) <= 0:
            raise ValueError(f"Qwen2.5-VL vision sizes must be positive: {self}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must give a "
                "head_dim that is a multiple of 4 (2-D rotary: h and w halves of pairs)"
            )
        if self.window_units < 1:
            raise ValueError(
                f"window_size {self.window_size} is smaller than one merged unit "
                f"({self.patch_size * self.spatial_merge_size} pixels)"
            )
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(
                f"fullatt_block_indexes {self.fullatt_block_indexes} outside 0..{self.depth - 1}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per decoder token: ``spatial_merge_size ** 2``."""
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Values per ``pixel_values`` row: ``C * T * p * p``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_units(self) -> int:
        """Side of an attention window in merged units (transformers' integer division)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, vision_config: Any, dtype: Any = np.float32) -> Qwen2_5_VisionConfig:
        """The config of HF ``Qwen2_5_VLConfig.vision_config``."""
        rope = getattr(vision_config, "rope_parameters", None) or {}
        return cls(
            depth=vision_config.depth,
            hidden_size=vision_config.hidden_size,
            intermediate_size=vision_config.intermediate_size,
            num_heads=vision_config.num_heads,
            out_hidden_size=vision_config.out_hidden_size,
            fullatt_block_indexes=tuple(vision_config.fullatt_block_indexes),
            patch_size=vision_config.patch_size,
            temporal_patch_size=vision_config.temporal_patch_size,
            in_channels=vision_config.in_channels,
            spatial_merge_size=vision_config.spatial_merge_size,
            window_size=vision_config.window_size,
            hidden_act=vision_config.hidden_act,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            dtype=dtype,
        )


@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """Where each of ``N`` padded patch rows goes in the tower (int32 numpy arrays).

    "Window order" is the order the blocks see the rows in. Invariants: ``patch_order``
    is a permutation of ``range(N)`` that moves whole merge units and keeps each
    image's rows together; rows from ``num_patches`` on are padding, left in place,
    in segment `PAD_SEGMENT` of both kinds; every real row shares its window segment
    only with rows of its window and its frame segment only with rows of its frame.
    """

    patch_order: np.ndarray  # [N]: processor row of each window-order row
    rope_hw: np.ndarray  # [N, 2]: (h, w) patch coordinates of each window-order row
    frame_segments: np.ndarray  # [N]: full-attention segment (image frame) per row
    window_segments: np.ndarray  # [N]: window-attention segment per row
    token_order: np.ndarray  # [N // unit]: window-order unit of each output token


def image_grid(grid_thw: Any) -> np.ndarray:
    """``grid_thw`` as an ``[I, 3]`` int64 array (a list, numpy or torch array)."""
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)


def tokens_per_image(grid_thw: Any, spatial_merge_size: int) -> np.ndarray:
    """Decoder tokens of each image: ``t * h * w / m**2`` (its placeholder count)."""
    return image_grid(grid_thw).prod(axis=1) // spatial_merge_size**2


class _ImageUnits(NamedTuple):
    """One image's merge units in window order."""

    order: np.ndarray  # [U]: processor-order unit index of each window-order unit
    window: np.ndarray  # [U]: window id (unique within the image) of each
    frame: np.ndarray  # [U]: frame of each
    hw: np.ndarray  # [U * m*m, 2]: (h, w) of each window-order patch row
    num_windows: int  # window ids used, empty windows included


def _image_units(config: Qwen2_5_VisionConfig, t: int, h: int, w: int) -> _ImageUnits:
    """Windows of ``window_units`` units square, row-major over each frame, units
    row-major inside each window (transformers' ``get_vision_window_index``)."""
    m, side = config.spatial_merge_size, config.window_units
    if h % m or w % m:
        raise ValueError(f"image grid (t={t}, h={h}, w={w}) is not a multiple of {m}")
    grids = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
    frame, row, col = (g.ravel() for g in grids)  # of each unit, processor order
    windows_h, windows_w = -(-(h // m) // side), -(-(w // m) // side)
    window = (frame * windows_h + row // side) * windows_w + col // side
    order = np.lexsort((col, row, window))  # by window, then row-major inside it
    a, b = np.divmod(np.arange(m * m), m)  # patch (row, col) inside its unit
    hw = np.stack([row[:, None] * m + a, col[:, None] * m + b], axis=-1)  # [U, m*m, 2]
    return _ImageUnits(
        order, window[order], frame[order], hw[order].reshape(-1, 2), t * windows_h * windows_w
    )


def vision_layout(
    grid_thw: Any, config: Qwen2_5_VisionConfig, num_patches: int | None = None
) -> VisionLayout:
    """The layout of the images of ``grid_thw`` over ``num_patches`` rows (a multiple
    of ``merge_unit``, at least the images' patch count; None: exactly that count)."""
    grid, unit = image_grid(grid_thw), config.merge_unit
    real = int(grid.prod(axis=1).sum())
    n = real if num_patches is None else num_patches
    if n < real or n % unit:
        raise ValueError(f"num_patches {n}: need a multiple of {unit}, at least {real}")
    units, windows, frames, hws = [], [], [], []
    unit_base = window_base = frame_base = 0
    for t, h, w in grid.tolist():
        image = _image_units(config, t, h, w)
        units.append(image.order + unit_base)
        windows.append(image.window + window_base)
        frames.append(image.frame + frame_base)
        hws.append(image.hw)
        unit_base += len(image.order)
        window_base += image.num_windows
        frame_base += t
    unit_order = np.concatenate(units + [np.arange(real // unit, n // unit)])
    pad = np.full(n - real, PAD_SEGMENT)

    def rows(per_unit: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.repeat(np.concatenate(per_unit), unit), pad]).astype(np.int32)

    return VisionLayout(
        patch_order=(unit_order[:, None] * unit + np.arange(unit)).ravel().astype(np.int32),
        rope_hw=np.concatenate(hws + [np.zeros((n - real, 2), np.int64)]).astype(np.int32),
        frame_segments=rows(frames),
        window_segments=rows(windows),
        token_order=np.argsort(unit_order).astype(np.int32),
    )


def split_tokens(features: np.ndarray, grid_thw: Any, spatial_merge_size: int) -> list:
    """The tower's output rows ``[N // unit, D]`` cut into one ``[tokens, D]`` per image."""
    counts = tokens_per_image(grid_thw, spatial_merge_size)
    return np.split(np.asarray(features)[: counts.sum()], np.cumsum(counts)[:-1])


def mrope_section(text_config: Any) -> tuple[int, ...]:
    """How the decoder's ``head_dim / 2`` rotary frequencies split over (t, h, w)."""
    rope = getattr(text_config, "rope_parameters", None) or {}
    return tuple(rope.get("mrope_section", DEFAULT_MROPE_SECTION))


def _image_positions(t: int, units_h: int, units_w: int, start: int) -> np.ndarray:
    grids = np.meshgrid(*map(np.arange, (t, units_h, units_w)), indexing="ij")
    return np.stack([g.ravel() for g in grids]) + start  # [3, t*h*w]


def mrope_positions(
    token_ids: Any, grid_thw: Any, image_token_id: int, spatial_merge_size: int
) -> tuple[np.ndarray, int]:
    """The decoder positions ``[3, L]`` (t, h, w rows) of a prompt, and its delta.

    Text tokens have equal rows, counting on from the previous token. Image ``i``
    (the ``i``-th run of ``tokens_per_image`` placeholders) has rows ``start + (frame,
    unit row, unit col)``; the text after it starts at ``start + max(h, w) / m``.
    ``delta = max + 1 - L``: the token at sequence index ``j >= L`` (decode) has all
    three rows ``j + delta`` (`mrope_continuation`). Images only, no video.
    """
    ids, grid = np.asarray(token_ids).reshape(-1), image_grid(grid_thw)
    counts = tokens_per_image(grid, spatial_merge_size)
    is_image = ids == image_token_id
    if is_image.sum() != counts.sum():
        raise ValueError(f"{is_image.sum()} image tokens, the images need {counts.sum()}")
    parts, pos, i, image = [], 0, 0, 0
    while i < len(ids):
        if is_image[i]:
            t, h, w = (int(v) for v in grid[image])
            m = spatial_merge_size
            if not is_image[i : i + counts[image]].all():
                raise ValueError(f"image {image} needs {counts[image]} consecutive tokens")
            parts.append(_image_positions(t, h // m, w // m, pos))
            pos, i, image = pos + max(h, w) // m, i + int(counts[image]), image + 1
        else:
            end = i + (int(np.argmax(is_image[i:])) if is_image[i:].any() else len(ids) - i)
            parts.append(np.broadcast_to(np.arange(pos, pos + end - i), (3, end - i)))
            pos, i = pos + end - i, end
    positions = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions.astype(np.int32), delta


def mrope_continuation(start: int, count: int, delta: int) -> np.ndarray:
    """Positions ``[3, count]`` of the tokens at sequence indices ``start..`` after the
    prompt (decode, or text appended later): every row ``index + delta``."""
    return np.broadcast_to(np.arange(start, start + count) + delta, (3, count)).astype(np.int32)
