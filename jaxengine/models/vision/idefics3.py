"""Idefics3 / SmolVLM image encoder: SigLIP tiles -> pixel shuffle -> projection.

The processor (`Idefics3ImageProcessor`) turns one image into square tiles of
``max_image_size`` pixels: with splitting, ``rows x cols`` crops in row-major order
then the whole image resized (the "global" tile); without, the global tile alone.
Each tile runs through the SigLIP tower (`vision.siglip`) with Idefics3's
variable-resolution position ids (`bucketed_position_ids`), then the connector
folds each ``scale_factor x scale_factor`` block of patch states into one vector
(`pixel_shuffle`) and projects it to the decoder's width (``modality_projection``,
no bias). A tile gives ``tokens_per_tile`` embeddings, one per ``<image>`` token of
its placeholder run, and the prompt holds the runs in the tiles' order.

Parameters follow the checkpoint (``model.vision_model.*``, ``model.connector.*``;
`Idefics3VisionEncoder.hf_param_path`); the decoder's tensors are skipped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.layers.basic import Linear
from jaxengine.models.vision import siglip
from jaxengine.models.vision.siglip import SiglipVisionConfig, SiglipVisionTransformer


@dataclasses.dataclass(frozen=True)
class Idefics3VisionConfig:
    """The image encoder of an ``Idefics3Config``: tower, shuffle, projection."""

    vision: SiglipVisionConfig
    """The SigLIP tower (HF ``vision_config``)."""
    scale_factor: int
    """Side of the block of patches folded into one token (HF ``scale_factor``)."""
    text_hidden_size: int
    """The decoder's width: the projection's output (HF ``text_config.hidden_size``)."""

    def __post_init__(self) -> None:
        if self.scale_factor <= 0 or self.vision.patches_per_side % self.scale_factor:
            raise ValueError(
                f"scale_factor {self.scale_factor} does not divide the tile's "
                f"{self.vision.patches_per_side} patches per side"
            )
        if self.text_hidden_size <= 0:
            raise ValueError(f"text_hidden_size must be positive, got {self.text_hidden_size}")

    @property
    def dtype(self) -> Any:
        return self.vision.dtype

    @property
    def tokens_per_tile(self) -> int:
        """Embeddings per ``image_size`` tile: the processor's ``image_seq_len``."""
        return (self.vision.patches_per_side // self.scale_factor) ** 2


def from_hf(hf_config: Any, dtype: Any) -> Idefics3VisionConfig:
    """The Idefics3VisionConfig of an HF ``Idefics3Config``."""
    return Idefics3VisionConfig(
        vision=siglip.from_hf(hf_config.vision_config, dtype),
        scale_factor=int(hf_config.scale_factor),
        text_hidden_size=hf_config.text_config.hidden_size,
    )


def patch_mask_of(pixel_attention_mask: jax.Array, patch_size: int) -> jax.Array:
    """``[N, H, W]`` pixel mask (the processor's ``pixel_attention_mask``) -> ``[N, h, w]``
    patch mask: a patch is real when any of its pixels is."""
    n, height, width = pixel_attention_mask.shape
    h, w, p = height // patch_size, width // patch_size, patch_size
    blocks = pixel_attention_mask[:, : h * p, : w * p].reshape(n, h, p, w, p)
    return jnp.any(blocks != 0, axis=(2, 4))


def bucketed_position_ids(patch_mask: jax.Array, patches_per_side: int) -> jax.Array:
    """Idefics3's position ids ``[N, h * w]`` of ``[N, h, w]`` patch masks.

    A tile whose real patches span ``nh x nw`` (counted along its first column and
    first row) maps patch (i, j) to the table's cell (floor-bucket of i / nh, of j /
    nw) on the ``patches_per_side`` grid, so any tile covers the whole trained grid;
    padding patches get id 0. A full ``image_size`` tile gets 0..L-1. The float32
    arithmetic is transformers' own, so the buckets agree at the boundaries.
    """
    n, h, w = patch_mask.shape
    side = patches_per_side
    # torch.arange(1/side, 1, 1/side) in float32: values computed in float64, then cast
    boundaries = jnp.asarray(np.arange(1 / side, 1.0, 1 / side, dtype=np.float64), jnp.float32)
    mask = patch_mask.astype(bool)

    def buckets(count: jax.Array, size: int) -> jax.Array:  # [N] real patches -> [N, size]
        step = jnp.float32(1.0) / count.astype(jnp.float32)
        coords = jnp.arange(size, dtype=jnp.float32)[None, :] * step[:, None]
        coords = jnp.minimum(coords, jnp.float32(1.0 - 1e-6))
        return jnp.searchsorted(boundaries, coords, side="right").astype(jnp.int32)

    rows = buckets(jnp.sum(mask[:, :, 0], axis=1), h)  # [N, h]
    cols = buckets(jnp.sum(mask[:, 0, :], axis=1), w)  # [N, w]
    ids = (rows[:, :, None] * side + cols[:, None, :]).reshape(n, h * w)
    return jnp.where(mask.reshape(n, h * w), ids, 0)


def pixel_shuffle(x: jax.Array, scale: int) -> jax.Array:
    """``[N, L, D]`` square grid of patch states -> ``[N, L / s^2, s^2 * D]``.

    Output token (i, j) of the ``(side / s)^2`` grid is the concatenation, row offset
    ``a`` major then column offset ``b``, of the states of patches (s*i + a, s*j + b):
    the order of transformers' ``Idefics3Connector.pixel_shuffle``.
    """
    n, length, d = x.shape
    side = int(round(length**0.5))
    if side * side != length or side % scale:
        raise ValueError(f"pixel_shuffle needs a square grid divisible by {scale}, got {length}")
    g = side // scale
    x = x.reshape(n, g, scale, g, scale, d)  # [N, i, a, j, b, D]
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, g * g, scale * scale * d)


class Idefics3SimpleMLP(nn.Module):
    """``modality_projection``: one bias-free linear layer, ``proj``."""

    config: Idefics3VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        return Linear(cfg.text_hidden_size, (None, "embed"), False, cfg.dtype, name="proj")(x)


class Idefics3Connector(nn.Module):
    """Pixel shuffle, then ``modality_projection``: ``[N, L, D]`` -> ``[N, L/s^2, Dt]``."""

    config: Idefics3VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = pixel_shuffle(x, self.config.scale_factor)
        return Idefics3SimpleMLP(self.config, name="modality_projection")(x)


class Idefics3VisionEncoder(nn.Module):
    """Tiles -> decoder embeddings: ``vision_model`` (SigLIP) then ``connector``.

    ``pixel_values [N, C, H, W]`` (N tiles of any images; H = W, so the shuffle sees
    a square grid) and ``patch_mask [N, H/p, W/p]`` (`patch_mask_of`; all True for
    the processor's full tiles) -> ``[N, tokens, text_hidden_size]`` with ``tokens =
    (H / p / s)^2`` (`Idefics3VisionConfig.tokens_per_tile` at ``image_size``).
    Tiles are independent: padding tiles (any values) change no other tile's output.
    """

    config: Idefics3VisionConfig

    def setup(self) -> None:
        self.vision_model = SiglipVisionTransformer(self.config.vision)
        self.connector = Idefics3Connector(self.config)

    @siglip.float32_dots
    def __call__(self, pixel_values: jax.Array, patch_mask: jax.Array) -> jax.Array:
        n = pixel_values.shape[0]
        position_ids = bucketed_position_ids(patch_mask, self.config.vision.patches_per_side)
        key_mask = patch_mask.reshape(n, -1).astype(bool)
        states = self.vision_model(pixel_values, position_ids, key_mask)  # [N, L, D]
        return self.connector(states)

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], None] | None:
        """``model.vision_model.*`` and ``model.connector.*`` (with or without the
        ``model.`` prefix) -> ``(path, None)``; None for the decoder and LM head."""
        body = name.removeprefix("model.")
        top, _, rest = body.partition(".")
        if top == "vision_model":
            path = siglip.tower_param_path(rest, ("vision_model",))
            return None if path is None else (path, None)
        if top == "connector":
            return ("connector", *rest.split(".")), None
        return None


def example_inputs(config: Idefics3VisionConfig) -> tuple[jax.Array, jax.Array]:
    """One ``image_size`` tile and its full patch mask (for init and shapes)."""
    v = config.vision
    pixels = jnp.zeros((1, v.num_channels, v.image_size, v.image_size), v.dtype)
    return pixels, jnp.ones((1, v.patches_per_side, v.patches_per_side), bool)


@functools.partial(jax.jit, static_argnums=0)
def encode_tiles(
    config: Idefics3VisionConfig,
    params: Any,
    pixel_values: jax.Array,
    pixel_attention_mask: jax.Array | None = None,
) -> jax.Array:
    """Pure jitted encoder: ``[N, C, H, W]`` tiles (and optionally the processor's
    ``[N, H, W]`` pixel mask) -> ``[N, tokens, text_hidden_size]``."""
    v = config.vision
    if pixel_attention_mask is None:
        n, _, height, width = pixel_values.shape
        patch_mask = jnp.ones((n, height // v.patch_size, width // v.patch_size), bool)
    else:
        patch_mask = patch_mask_of(pixel_attention_mask, v.patch_size)
    return Idefics3VisionEncoder(config).apply({"params": params}, pixel_values, patch_mask)


def image_features(
    config: Idefics3VisionConfig,
    params: Any,
    pixel_values: jax.Array,
    pixel_attention_mask: jax.Array | None = None,
) -> jax.Array:
    """One image's tiles (in the processor's order: crops row-major, global last) ->
    ``[num_tiles * tokens, text_hidden_size]``, row k for the image's k-th ``<image>``
    placeholder token."""
    out = encode_tiles(config, params, pixel_values, pixel_attention_mask)
    return out.reshape(-1, out.shape[-1])
