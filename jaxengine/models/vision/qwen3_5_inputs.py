"""What the host computes for Qwen3.5's vision tower: its config and the per-row layout
of a call. numpy only: no JAX is imported here (STYLE 1).

The image processor is Qwen2-VL's (`qwen2_5_vl_inputs`: ``pixel_values [P, C*T*p*p]``
rows in merge-unit order, ``image_grid_thw [I, 3]``), and the decoder's M-RoPE
positions are Qwen2.5-VL's for images (`qwen2_5_vl_inputs.mrope_chunk`: transformers'
``Qwen3_5Model.get_rope_index`` gives the same numbers for ``t = 1``). Unlike
Qwen2.5-VL the tower has no windows: every block attends within each frame, rows stay
in the processor's order, and a learned ``[side * side, E]`` position table is
resampled bilinearly (corners aligned) to each image's patch grid. Per call,
`vision_layout` gives each of ``N`` padded rows:

- its (h, w) patch coordinates, for the 2-D rotary embedding;
- its frame segment (padding: `PAD_SEGMENT`);
- the four table rows and weights of its bilinear position embedding, as transformers'
  ``get_vision_interpolation_indices_and_weights`` computes them in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxengine.models.vision.qwen2_5_vl_inputs import (
    PAD_SEGMENT,
    PatchShapes,
    hf_shape_fields,
    image_grid,
)


@dataclasses.dataclass(frozen=True)
class Qwen3_5VisionConfig(PatchShapes):
    """Shapes of Qwen3.5's vision tower (HF ``Qwen3_5VisionConfig``)."""

    depth: int
    """Number of transformer blocks."""
    hidden_size: int
    """Width of the patch embeddings and of every block."""
    intermediate_size: int
    """Width of the blocks' MLP."""
    num_heads: int
    """Attention heads per block; ``hidden_size`` is a multiple of it."""
    out_hidden_size: int
    """Width of the merged tokens: the decoder's hidden size."""
    num_position_embeddings: int
    """Rows of the learned position table: a square ``side * side``."""
    patch_size: int = 16
    """Side of one patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    in_channels: int = 3
    """Colour channels."""
    spatial_merge_size: int = 2
    """Side ``m`` of the ``m x m`` patches merged into one decoder token."""
    hidden_act: str = "gelu_pytorch_tanh"
    """Activation of the blocks' MLP (HF name)."""
    rope_theta: float = 10000.0
    """Base frequency of the 2-D rotary embedding."""
    dtype: Any = np.float32
    """Parameter and activation dtype (norms, rotary and softmax run in float32)."""
    query_block: int = 512
    """Query rows an attention block scores at once against all the call's rows (not
    the checkpoint's: it bounds the live scores to ``[heads, query_block, N]``)."""

    def __post_init__(self) -> None:
        self.check_sizes("Qwen3.5")
        if self.grid_side**2 != self.num_position_embeddings or self.grid_side < 2:
            raise ValueError(
                f"num_position_embeddings {self.num_position_embeddings} is not a square "
                "of a side of at least 2"
            )

    @property
    def grid_side(self) -> int:
        """Side of the learned position table."""
        return int(round(self.num_position_embeddings**0.5))

    @classmethod
    def from_hf(cls, vision_config: Any, dtype: Any = np.float32) -> Qwen3_5VisionConfig:
        """The config of HF ``Qwen3_5Config.vision_config``."""
        return cls(
            **hf_shape_fields(vision_config),
            num_position_embeddings=vision_config.num_position_embeddings,
            dtype=dtype,
        )


@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """What each of ``N`` padded patch rows is, in the processor's order. Rows from the
    images' patch count on are padding: segment `PAD_SEGMENT`, position weights zero."""

    rope_hw: np.ndarray  # [N, 2] int32: (h, w) patch coordinates
    segments: np.ndarray  # [N] int32: frame of each row, over all the call's images
    pos_index: np.ndarray  # [N, 4] int32: rows of the position table to blend
    pos_weight: np.ndarray  # [N, 4] float32: their bilinear weights


def _frame_coordinates(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of an ``h x w`` frame in merge-unit order: units
    row-major, the ``m x m`` patches of each row-major inside it."""
    p = np.arange(h * w)
    unit, inside = np.divmod(p, m * m)
    unit_row, unit_col = np.divmod(unit, w // m)
    a, b = np.divmod(inside, m)
    return unit_row * m + a, unit_col * m + b


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Two taps ``[n, 2]`` into a ``side``-long axis and their weights for positions
    ``index`` of an axis of ``size`` (bilinear, corners aligned), in float32."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    return taps, np.maximum(np.float32(1) - distance, 0).astype(np.float32)


def vision_layout(
    grid_thw: Any, config: Qwen3_5VisionConfig, num_patches: int | None = None
) -> VisionLayout:
    """The layout of the images of ``grid_thw`` over ``num_patches`` rows (at least the
    images' patch count; None: exactly that). No image (warm-up): padding only."""
    grid, m, side = image_grid(grid_thw), config.spatial_merge_size, config.grid_side
    real = int(grid.prod(axis=1).sum())
    n = real if num_patches is None else num_patches
    if n < real:
        raise ValueError(f"num_patches {n} is less than the images' {real} patches")
    hw = np.zeros((n, 2), np.int32)
    segments = np.full(n, PAD_SEGMENT, np.int32)
    index, weight = np.zeros((n, 4), np.int32), np.zeros((n, 4), np.float32)
    row0 = frame0 = 0
    for t, h, w in grid.tolist():
        if h % m or w % m:
            raise ValueError(f"image grid (t={t}, h={h}, w={w}) is not a multiple of {m}")
        rows, cols = _frame_coordinates(h, w, m)
        (h_taps, h_weights), (w_taps, w_weights) = (
            _axis_taps(rows, h, side), _axis_taps(cols, w, side)
        )  # fmt: skip
        frame_index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        frame_weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        for f in range(t):
            span = slice(row0, row0 + h * w)
            hw[span] = np.stack([rows, cols], axis=-1)
            segments[span] = frame0 + f
            index[span], weight[span] = frame_index, frame_weight
            row0 += h * w
        frame0 += t
    return VisionLayout(hw, segments, index, weight)
