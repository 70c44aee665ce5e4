"""SigLIP vision transformer: pixels -> one hidden state per patch.

The image tower of Idefics3 / SmolVLM (`vision.idefics3`) and Gemma 3
(`vision.gemma3`). A ``[N, C, H, W]`` batch of images (or tiles) is cut into
``patch_size`` squares; each patch is embedded by the patch "convolution" (a kernel
as large as its stride: one matmul over the flattened patches), a learned position
embedding is added (the caller picks the position ids: `plain_position_ids` for
SigLIP, Idefics3's buckets for its variable-resolution tiles), then pre-LN encoder
layers (biased q/k/v/o, GELU(tanh) MLP) and a final LayerNorm. Attention is
bidirectional within each image, over the patches its ``patch_mask`` keeps as keys;
images never attend to each other, so a batch can be padded with extra images.

Parameters keep the checkpoint's names and layouts (the patch kernel stays
``[D, C, p, p]``): ``encoder.layers.3.self_attn.q_proj.weight`` is
``encoder/layers_3/self_attn/q_proj/weight`` (`tower_param_path`). The tower is small
next to the decoder, so its weights are replicated (logical axes ``embed`` and None).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Embed, LayerNorm, Linear, activation

_REPLICATED = (None, "embed")  # logical axes of every tower weight (`sharding.rules`)


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig:
    """Shapes and numerics of a SigLIP vision tower (HF ``SiglipVisionConfig`` and
    ``Idefics3VisionConfig`` carry the same fields)."""

    hidden_size: int
    """Width of the patch embeddings and of every encoder layer."""
    intermediate_size: int
    """Width of the MLP's hidden layer."""
    num_layers: int
    """Number of encoder layers."""
    num_heads: int
    """Attention heads per layer; ``hidden_size`` is a multiple of it."""
    image_size: int
    """Side of the square image the position table covers, in pixels."""
    patch_size: int
    """Side of one square patch, in pixels; ``image_size`` is a multiple of it."""
    num_channels: int = 3
    """Colour channels of the pixel values."""
    hidden_act: str = "gelu_pytorch_tanh"
    """The MLP's activation (HF name)."""
    layer_norm_eps: float = 1e-6
    """Epsilon of every LayerNorm."""
    dtype: Any = jnp.float32
    """Parameter and activation dtype (LayerNorm and softmax run in float32)."""

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads)
        if min(*sizes, self.image_size, self.patch_size, self.num_channels) <= 0:
            raise ValueError(f"SigLIP sizes must be positive: {self}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        activation(self.hidden_act)  # raises on an unknown name

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        """Patches along each side of an ``image_size`` image (the position grid's side)."""
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        """Rows of the position table: ``patches_per_side ** 2``."""
        return self.patches_per_side**2


def _square(value: Any, name: str) -> int:
    """An int size, or a [h, w] pair with h == w (HF allows either)."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"non-square {name} {value} is not supported")
        value = value[0]
    return int(value)


def from_hf(hf_vision_config: Any, dtype: Any) -> SiglipVisionConfig:
    """The SiglipVisionConfig of an HF ``SiglipVisionConfig`` / ``Idefics3VisionConfig``."""
    c = hf_vision_config
    return SiglipVisionConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        image_size=_square(c.image_size, "image_size"),
        patch_size=_square(c.patch_size, "patch_size"),
        num_channels=c.num_channels,
        hidden_act=c.hidden_act,
        layer_norm_eps=c.layer_norm_eps,
        dtype=dtype,
    )


def float32_dots(method):
    """Traces a module method with full-float32 dots when ``config.dtype`` is float32
    (XLA would run them as TF32 on GPUs; torch keeps float32), as
    `layers.basic.float32_dots` does for the text models."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if jnp.dtype(self.config.dtype) != jnp.float32:
            return method(self, *args, **kwargs)
        with jax.default_matmul_precision("float32"):
            return method(self, *args, **kwargs)

    return wrapped


def to_patches(pixel_values: jax.Array, patch_size: int) -> jax.Array:
    """``[N, C, H, W]`` -> ``[N, h * w, C * p * p]``: patches in row-major grid order,
    each flattened as (channel, row, column), the layout of a ``[D, C, p, p]`` kernel."""
    n, c, height, width = pixel_values.shape
    p = patch_size
    h, w = height // p, width // p
    x = pixel_values[:, :, : h * p, : w * p].reshape(n, c, h, p, w, p)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(n, h * w, c * p * p)


def plain_position_ids(num_images: int, config: SiglipVisionConfig) -> jax.Array:
    """SigLIP's position ids ``[N, L]``: patch ``i`` of an ``image_size`` image is row
    ``i`` of the table (no interpolation to other sizes)."""
    ids = jnp.arange(config.num_positions, dtype=jnp.int32)
    return jnp.broadcast_to(ids, (num_images, config.num_positions))


class SiglipPatchEmbedding(nn.Module):
    """The patch convolution (kernel = stride = ``patch_size``) as one matmul."""

    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:  # [N, C, H, W] -> [N, L, D]
        cfg = self.config
        p, d = cfg.patch_size, cfg.hidden_size
        init = nn.with_logical_partitioning(
            nn.initializers.normal(0.02), ("embed", None, None, None)
        )
        weight = self.param("weight", init, (d, cfg.num_channels, p, p), cfg.dtype)
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros, ("embed",))
        bias = self.param("bias", bias_init, (d,), cfg.dtype)
        patches = to_patches(pixel_values.astype(cfg.dtype), p)  # [N, L, C*p*p]
        return jnp.einsum("nlk,dk->nld", patches, weight.reshape(d, -1)) + bias


class SiglipEmbeddings(nn.Module):
    """Patch embeddings plus the learned position embedding of each patch's id."""

    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, pixel_values: jax.Array, position_ids: jax.Array) -> jax.Array:
        cfg = self.config
        x = SiglipPatchEmbedding(cfg, name="patch_embedding")(pixel_values)  # [N, L, D]
        table = Embed(cfg.num_positions, cfg.hidden_size, cfg.dtype, _REPLICATED,
                      name="position_embedding")  # fmt: skip
        return x + table(position_ids)  # position_ids [N, L]


class SiglipAttention(nn.Module):
    """Multi-head self-attention over one image's patches; ``key_mask [N, L]`` drops
    padding patches as keys (their own rows are computed all the same)."""

    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, x: jax.Array, key_mask: jax.Array) -> jax.Array:  # [N, L, D]
        cfg = self.config
        n, length, _ = x.shape
        proj = functools.partial(Linear, cfg.hidden_size, _REPLICATED, True, cfg.dtype)
        q, k, v = (
            proj(name=name)(x).reshape(n, length, cfg.num_heads, cfg.head_dim)
            for name in ("q_proj", "k_proj", "v_proj")
        )  # [N, L, H, Dh] each
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores * cfg.head_dim**-0.5  # [N, H, L, L]
        scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, length, cfg.hidden_size)
        return proj(name="out_proj")(out)


class SiglipMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with biases."""

    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = Linear(cfg.intermediate_size, _REPLICATED, True, cfg.dtype, name="fc1")(x)
        return Linear(cfg.hidden_size, _REPLICATED, True, cfg.dtype, name="fc2")(
            activation(cfg.hidden_act)(h)
        )


class SiglipEncoderLayer(nn.Module):
    """Pre-LN: ``x += attn(LN1(x))``, then ``x += mlp(LN2(x))``."""

    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, x: jax.Array, key_mask: jax.Array) -> jax.Array:
        cfg = self.config
        h = LayerNorm(cfg.layer_norm_eps, cfg.dtype, name="layer_norm1")(x)
        x = x + SiglipAttention(cfg, name="self_attn")(h, key_mask)
        h = LayerNorm(cfg.layer_norm_eps, cfg.dtype, name="layer_norm2")(x)
        return x + SiglipMLP(cfg, name="mlp")(h)


class SiglipEncoder(nn.Module):
    """The layers (Linen names them ``layers_{i}``, as ``encoder.layers.{i}``)."""

    config: SiglipVisionConfig

    def setup(self) -> None:
        self.layers = [SiglipEncoderLayer(self.config) for _ in range(self.config.num_layers)]

    def __call__(self, x: jax.Array, key_mask: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


class SiglipVisionTransformer(nn.Module):
    """Embeddings, encoder and ``post_layernorm``: HF's ``last_hidden_state``.

    ``pixel_values [N, C, H, W]`` (H and W multiples of ``patch_size``),
    ``position_ids [N, L]`` rows of the position table (L = (H/p) * (W/p)), and
    ``key_mask [N, L]`` (True: a real patch) -> ``[N, L, D]``.
    """

    config: SiglipVisionConfig

    @float32_dots
    @nn.compact
    def __call__(
        self, pixel_values: jax.Array, position_ids: jax.Array, key_mask: jax.Array
    ) -> jax.Array:
        cfg = self.config
        x = SiglipEmbeddings(cfg, name="embeddings")(pixel_values, position_ids)
        x = SiglipEncoder(cfg, name="encoder")(x, key_mask)
        return LayerNorm(cfg.layer_norm_eps, cfg.dtype, name="post_layernorm")(x)


def tower_param_path(name: str, prefix: tuple[str, ...]) -> tuple[str, ...] | None:
    """A tower tensor's parameter path under ``prefix``, from its name below the
    tower (``encoder.layers.3.mlp.fc1.weight`` -> ``(*prefix, encoder, layers_3, mlp,
    fc1, weight)``); None for what the tower does not hold (SigLIP's pooling ``head``,
    the ``position_ids`` buffer)."""
    parts = name.split(".")
    if parts[0] == "head" or parts[-1] == "position_ids":
        return None
    if parts[:2] == ["encoder", "layers"] and len(parts) > 2:
        parts = ["encoder", f"layers_{parts[2]}", *parts[3:]]
    return (*prefix, *parts)
