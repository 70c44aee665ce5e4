"""Gemma 3 image encoder: SigLIP -> average pooling -> soft-embedding norm -> projection.

The processor (`Gemma3ImageProcessor`) resizes each image (and each pan-and-scan
crop, when asked) to ``image_size`` square. The SigLIP tower (`vision.siglip`, plain
position ids) gives ``patches_per_side^2`` states; the projector averages each
``k x k`` block of them (``k = patches_per_side / sqrt(mm_tokens_per_image)``) into
``mm_tokens_per_image`` vectors in row-major order, applies Gemma's RMSNorm (scale
``1 + weight``, ``mm_soft_emb_norm``) and multiplies by ``mm_input_projection_weight``
``[vision_hidden, text_hidden]``. The result replaces the image's
``mm_tokens_per_image`` ``<image_soft_token>`` placeholders as it is: the decoder's
``sqrt(hidden)`` embedding scale applies to text tokens only.

Parameters follow the checkpoint: transformers 5 writes ``model.vision_tower.*`` and
``model.multi_modal_projector.*``; Google's checkpoints hold
``vision_tower.vision_model.*`` and ``multi_modal_projector.*``; both load
(`Gemma3VisionEncoder.hf_param_path`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import RMSNorm
from jaxengine.models.vision import siglip
from jaxengine.models.vision.siglip import SiglipVisionConfig, SiglipVisionTransformer


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    """The image encoder of a ``Gemma3Config``: tower, pooling, projection."""

    vision: SiglipVisionConfig
    """The SigLIP tower (HF ``vision_config``)."""
    mm_tokens_per_image: int
    """Embeddings per image (HF ``mm_tokens_per_image``): a square number whose side
    divides the tower's patches per side."""
    text_hidden_size: int
    """The decoder's width: the projection's output (HF ``text_config.hidden_size``)."""

    def __post_init__(self) -> None:
        side = self.tokens_per_side
        if side * side != self.mm_tokens_per_image or self.vision.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {self.mm_tokens_per_image} is not the square of a "
                f"divisor of the tower's {self.vision.patches_per_side} patches per side"
            )
        if self.text_hidden_size <= 0:
            raise ValueError(f"text_hidden_size must be positive, got {self.text_hidden_size}")

    @property
    def dtype(self) -> Any:
        return self.vision.dtype

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.mm_tokens_per_image**0.5))

    @property
    def pool_size(self) -> int:
        """Side of the block of patches averaged into one token."""
        return self.vision.patches_per_side // self.tokens_per_side


def from_hf(hf_config: Any, dtype: Any) -> Gemma3VisionConfig:
    """The Gemma3VisionConfig of an HF ``Gemma3Config``."""
    return Gemma3VisionConfig(
        vision=siglip.from_hf(hf_config.vision_config, dtype),
        mm_tokens_per_image=int(hf_config.mm_tokens_per_image),
        text_hidden_size=hf_config.text_config.hidden_size,
    )


def average_pool(x: jax.Array, pool: int) -> jax.Array:
    """``[N, side^2, D]`` row-major grid -> ``[N, (side/pool)^2, D]``: the mean of each
    ``pool x pool`` block, blocks in row-major order (``AvgPool2d(pool, pool)``)."""
    n, length, d = x.shape
    side = int(round(length**0.5))
    g = side // pool
    blocks = x.reshape(n, g, pool, g, pool, d).astype(jnp.float32)
    return jnp.mean(blocks, axis=(2, 4)).reshape(n, g * g, d).astype(x.dtype)


class Gemma3MultiModalProjector(nn.Module):
    """Pool, ``mm_soft_emb_norm`` (Gemma RMSNorm), ``@ mm_input_projection_weight``."""

    config: Gemma3VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [N, L, Dv] -> [N, T, Dt]
        cfg = self.config
        v = cfg.vision
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None))
        weight = self.param(
            "mm_input_projection_weight", init, (v.hidden_size, cfg.text_hidden_size), v.dtype
        )
        x = average_pool(x, cfg.pool_size)
        x = RMSNorm(v.layer_norm_eps, 1.0, v.dtype, name="mm_soft_emb_norm")(x)
        return jnp.einsum("ntd,de->nte", x, weight)


class Gemma3VisionEncoder(nn.Module):
    """Images -> decoder embeddings: ``vision_tower`` (SigLIP) then
    ``multi_modal_projector``.

    ``pixel_values [N, C, image_size, image_size]`` -> ``[N, mm_tokens_per_image,
    text_hidden_size]``. Images are independent: padding images change no other.
    """

    config: Gemma3VisionConfig

    def setup(self) -> None:
        self.vision_tower = SiglipVisionTransformer(self.config.vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(self.config)

    @siglip.float32_dots
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        v = self.config.vision
        n, _, height, width = pixel_values.shape
        if (height, width) != (v.image_size, v.image_size):
            raise ValueError(
                f"Gemma 3 images are {v.image_size}x{v.image_size} pixels, got {height}x{width}"
            )
        position_ids = siglip.plain_position_ids(n, v)
        key_mask = jnp.ones((n, v.num_positions), bool)
        states = self.vision_tower(pixel_values, position_ids, key_mask)  # [N, L, Dv]
        return self.multi_modal_projector(states)

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], None] | None:
        """``[model.]vision_tower.[vision_model.]*`` and ``[model.]multi_modal_projector.*``
        -> ``(path, None)``; None for the decoder, the LM head and SigLIP's unused
        pooling head."""
        body = name.removeprefix("model.")
        top, _, rest = body.partition(".")
        if top == "vision_tower":
            path = siglip.tower_param_path(rest.removeprefix("vision_model."), ("vision_tower",))
            return None if path is None else (path, None)
        if top == "multi_modal_projector":
            return ("multi_modal_projector", *rest.split(".")), None
        return None


def example_inputs(config: Gemma3VisionConfig) -> tuple[jax.Array]:
    """One image of zeros (for init and shapes)."""
    v = config.vision
    return (jnp.zeros((1, v.num_channels, v.image_size, v.image_size), v.dtype),)


@functools.partial(jax.jit, static_argnums=0)
def image_features(config: Gemma3VisionConfig, params: Any, pixel_values: jax.Array) -> jax.Array:
    """Pure jitted encoder: ``[N, C, S, S]`` images -> ``[N, mm_tokens_per_image,
    text_hidden_size]``; row k of image i replaces its k-th ``<image_soft_token>``."""
    return Gemma3VisionEncoder(config).apply({"params": params}, pixel_values)
