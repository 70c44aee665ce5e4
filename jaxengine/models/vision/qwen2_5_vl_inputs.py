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
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

PAD_SEGMENT = -1
"""Segment id of the padding rows: they attend only to each other."""

DEFAULT_MROPE_SECTION = (16, 24, 24)
"""transformers' default split of the rotary frequencies over the (t, h, w) rows."""


class PatchShapes:
    """Sizes derived from the fields every Qwen vision tower config has (this one's,
    `qwen3_5_inputs.Qwen3_5VisionConfig`'s), and their shared checks."""

    def check_sizes(self, family: str) -> None:
        """ValueError unless every size is positive and the head splits in 4 (2-D
        rotary: h and w halves of pairs)."""
        sizes = (self.depth, self.hidden_size, self.intermediate_size, self.num_heads)
        sizes += (self.out_hidden_size, self.patch_size, self.temporal_patch_size)
        sizes += (self.in_channels, self.spatial_merge_size, self.query_block)
        if min(sizes) <= 0:
            raise ValueError(f"{family} vision sizes must be positive: {self}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must give a "
                "head_dim that is a multiple of 4 (2-D rotary: h and w halves of pairs)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def matmul_dtype(self) -> None:
        """Dots run in ``dtype`` (`layers.basic.matmul_precision` reads both)."""
        return None

    @property
    def merge_unit(self) -> int:
        """Patches per decoder token: ``spatial_merge_size ** 2``."""
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Values per ``pixel_values`` row: ``C * T * p * p``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def hf_shape_fields(vision_config: Any) -> dict[str, Any]:
    """The `PatchShapes` fields of an HF Qwen vision config, and its rotary base."""
    names = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
    names += ("patch_size", "temporal_patch_size", "in_channels", "spatial_merge_size")
    names += ("hidden_act",)
    rope = getattr(vision_config, "rope_parameters", None) or {}
    fields = {name: getattr(vision_config, name) for name in names}
    return {**fields, "rope_theta": float(rope.get("rope_theta", 10000.0))}


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VisionConfig(PatchShapes):
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
    query_block: int = 512
    """Query rows a full-attention block scores at once, against all the call's rows
    (not the checkpoint's: it bounds the live scores to ``[heads, query_block, N]``)."""

    def __post_init__(self) -> None:
        self.check_sizes("Qwen2.5-VL")
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
    def window_units(self) -> int:
        """Side of an attention window in merged units (transformers' integer division)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def window_rows(self) -> int:
        """Patch rows of the largest attention window: ``window_units**2`` units."""
        return self.window_units**2 * self.merge_unit

    @classmethod
    def from_hf(cls, vision_config: Any, dtype: Any = np.float32) -> Qwen2_5_VisionConfig:
        """The config of HF ``Qwen2_5_VLConfig.vision_config``."""
        return cls(
            **hf_shape_fields(vision_config),
            fullatt_block_indexes=tuple(vision_config.fullatt_block_indexes),
            window_size=vision_config.window_size,
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
    of ``merge_unit``, at least the images' patch count; None: exactly that count).
    No image (warm-up): every row is padding."""
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
        ids = np.concatenate([*per_unit, np.zeros(0, np.int64)])  # (no image: padding only)
        return np.concatenate([np.repeat(ids, unit), pad]).astype(np.int32)

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


def token_grid(grid_thw: Any, spatial_merge_size: int) -> list[tuple[int, int, int]]:
    """Each image's decoder tokens as ``(frames, rows, columns)``: its patch grid with
    rows and columns divided by ``m``."""
    m = spatial_merge_size
    return [(int(t), int(h) // m, int(w) // m) for t, h, w in image_grid(grid_thw).tolist()]


def mrope_chunk(
    start: int, count: int, images: Sequence[tuple[int, tuple[int, int, int]]]
) -> np.ndarray:
    """M-RoPE positions ``[3, count]`` (t, h, w rows) of sequence indices ``start..``
    of a request whose images are ``(first index, token grid)`` pairs, in prompt order
    (each image's tokens consecutive: `token_grid`), as transformers' ``get_rope_index``.

    A text token's rows are equal: its index plus what the images before it shifted.
    An image's token ``j`` is at ``p + (frame, row, col)`` of ``j`` (``p``: the position
    its first token would have as text); the text after it goes on from ``p + max(t,
    h, w)``, so each image shifts the later positions by ``max(t, h, w) - t*h*w``. Past
    the prompt (decode) every row is ``index + delta``, ``delta`` the total shift.
    """
    index = np.arange(start, start + count)
    out = np.broadcast_to(index, (3, count)).astype(np.int64)
    shift = 0  # what the images so far moved positions away from indices
    for first, (t, h, w) in images:
        n = t * h * w
        inside = (index >= first) & (index < first + n)
        if inside.any():
            frame_row_col = np.unravel_index(index[inside] - first, (t, h, w))
            out[:, inside] = first + shift + np.stack(frame_row_col)
        out[:, index >= first + n] += max(t, h, w) - n
        shift += max(t, h, w) - n
    return out.astype(np.int32)


def mrope_positions(
    token_ids: Any, grid_thw: Any, image_token_id: int, spatial_merge_size: int
) -> tuple[np.ndarray, int]:
    """The decoder positions ``[3, L]`` of a prompt (`mrope_chunk`: image ``i`` is the
    ``i``-th run of its ``tokens_per_image`` placeholders) and its ``delta``, ``max + 1
    - L``: the token at sequence index ``j >= L`` has all three rows ``j + delta``
    (`mrope_continuation`). Images only, no video."""
    ids, grids = np.asarray(token_ids).reshape(-1), token_grid(grid_thw, spatial_merge_size)
    counts = tokens_per_image(grid_thw, spatial_merge_size)
    is_image = ids == image_token_id
    if is_image.sum() != counts.sum():
        raise ValueError(f"{is_image.sum()} image tokens, the images need {counts.sum()}")
    images, cursor = [], 0
    for k, n in enumerate(counts.tolist()):
        first = cursor + int(np.argmax(is_image[cursor:]))
        if not is_image[first : first + n].all() or first + n > len(ids):
            raise ValueError(f"image {k} needs {n} consecutive tokens")
        images.append((first, grids[k]))
        cursor = first + n
    positions = mrope_chunk(0, len(ids), images)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta


def mrope_continuation(start: int, count: int, delta: int) -> np.ndarray:
    """Positions ``[3, count]`` of the tokens at sequence indices ``start..`` after the
    prompt (decode, or text appended later): every row ``index + delta``."""
    return np.broadcast_to(np.arange(start, start + count) + delta, (3, count)).astype(np.int32)
