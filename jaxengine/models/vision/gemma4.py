"""Gemma 4 image encoder: patches -> encoder -> k x k average pooling -> projection.

The processor (`Gemma4ImageProcessor`) resizes each image, keeping its aspect ratio,
to at most ``max_soft_tokens * k^2`` patches of ``patch_size`` pixels (both sides
multiples of ``k * patch_size``, k = ``pooling_kernel_size``) and gives them as rows
``pixel_values [N, L, 3 * p * p]`` with their (x, y) grid coordinates
``image_position_ids [N, L, 2]``; padding rows have coordinates (-1, -1). The tower:

- patch embedder: ``input_proj(2 * pixels - 1)`` plus the x row and the y row of a
  learned ``position_embedding_table [2, P, D]`` (zero on padding rows);
- encoder layers: Gemma's sandwich norms (RMSNorm times ``weight``), attention with
  q/k/v norms (values without a weight), softmax scale 1 and an axial 2-D rope (the
  first half of each head turns with x, the second with y), over the image's real
  patches only; gated GELU MLP. Every projection may clip its input and output
  (``use_clipped_linears``: scalar ``input_min`` ... ``output_max`` per linear);
- pooler: padding rows zeroed, each ``k x k`` block of patches averaged into one soft
  token (token ``x // k + (width / k) * (y // k)``: row-major, the real ones first),
  times ``sqrt(hidden_size)``; optional ``std_bias`` / ``std_scale`` standardization;
- ``embed_vision``: an RMSNorm without weight, then ``embedding_projection`` to the
  decoder's width. The result replaces the image's soft tokens as it is.

One call encodes padded images of ``L = units * k^2`` rows into ``units`` tokens each;
an image with fewer real tokens leaves the rest as padding (dropped by the caller).
Parameters follow transformers' checkpoint names (``model.vision_tower.*``,
``model.embed_vision.*``: `Gemma4VisionEncoder.hf_param_path`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Linear, RMSNorm, activation
from jaxengine.models.vision.siglip import float32_dots

_REPLICATED = (None, "embed")  # logical axes of every tower weight (`sharding.rules`)


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
    """The image encoder of a ``Gemma4Config``: tower, pooling, projection."""

    hidden_size: int
    """Width of the patch embeddings and of every encoder layer."""
    intermediate_size: int
    """Width of the gated MLP's hidden layer."""
    num_layers: int
    """Number of encoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer; divides ``num_heads``."""
    head_dim: int
    """Width of one head; a multiple of 4 (two axes, each rotated in halves)."""
    patch_size: int
    """Side of one square patch, in pixels."""
    pooling_kernel_size: int
    """k: each soft token averages a ``k x k`` block of patches."""
    position_embedding_size: int
    """Rows of each axis of the position table (the largest coordinate + 1)."""
    text_hidden_size: int
    """The decoder's width: ``embed_vision``'s output."""
    rope_theta: float = 100.0
    """Base of the axial rope's frequencies."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (``embed_vision``'s too)."""
    hidden_act: str = "gelu_pytorch_tanh"
    """The MLP's activation (HF name)."""
    use_clipped_linears: bool = False
    """Each projection clamps its input and output to learned scalar bounds."""
    standardize: bool = False
    """Pooled tokens become ``(x - std_bias) * std_scale``."""
    dtype: Any = jnp.float32
    """Parameter and activation dtype (norms, softmax and pooling run in float32)."""

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads)
        sizes += (self.num_kv_heads, self.head_dim, self.patch_size, self.pooling_kernel_size)
        if min(*sizes, self.position_embedding_size, self.text_hidden_size) <= 0:
            raise ValueError(f"Gemma 4 vision sizes must be positive: {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} is not a multiple of 4 (2-D rope)")
        activation(self.hidden_act)  # raises on an unknown name

    @property
    def patch_dim(self) -> int:
        """Values per patch row: ``3 * patch_size^2``."""
        return 3 * self.patch_size**2

    @property
    def patches_per_token(self) -> int:
        return self.pooling_kernel_size**2


def from_hf(hf_config: Any, dtype: Any) -> Gemma4VisionConfig:
    """The Gemma4VisionConfig of an HF ``Gemma4Config`` (``vision_config``)."""
    v = hf_config.vision_config
    rope = getattr(v, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"Gemma 4 vision rope {rope.get('rope_type')!r} is not supported")
    return Gemma4VisionConfig(
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_layers=v.num_hidden_layers,
        num_heads=v.num_attention_heads,
        num_kv_heads=v.num_key_value_heads,
        head_dim=v.head_dim,
        patch_size=v.patch_size,
        pooling_kernel_size=v.pooling_kernel_size,
        position_embedding_size=v.position_embedding_size,
        text_hidden_size=hf_config.text_config.hidden_size,
        rope_theta=float(rope.get("rope_theta", 100.0)),
        rms_norm_eps=v.rms_norm_eps,
        hidden_act=v.hidden_activation,
        use_clipped_linears=bool(v.use_clipped_linears),
        standardize=bool(v.standardize),
        dtype=dtype,
    )


def unit_rms(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a weight over the last axis, in float32."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def axial_rope(x: jax.Array, coords: jax.Array, theta: float) -> jax.Array:
    """``x [N, L, H, d]`` rotated by ``coords [N, L, 2]``: dims ``[0, d/2)`` by x and
    ``[d/2, d)`` by y, each half as rotate-half rope over ``d/4`` frequencies."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = 1.0 / theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half)  # [d/4]
    out = []
    for axis in range(2):
        part = x[..., axis * half : (axis + 1) * half].astype(jnp.float32)  # [N, L, H, d/2]
        angles = coords[..., axis, None].astype(jnp.float32) * inv_freq  # [N, L, d/4]
        cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None]
        sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None]
        a, b = part[..., : half // 2], part[..., half // 2 :]
        out.append(part * cos + jnp.concatenate([-b, a], axis=-1) * sin)
    return jnp.concatenate(out, axis=-1).astype(x.dtype)


class ClippableLinear(nn.Module):
    """``linear`` (``[out, in]``, no bias), clamping input and output to learned scalars
    when ``config.use_clipped_linears``."""

    config: Gemma4VisionConfig
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        if not cfg.use_clipped_linears:
            return Linear(self.features, _REPLICATED, False, cfg.dtype, name="linear")(x)

        def bound(name: str, value: float) -> jax.Array:
            init = nn.with_logical_partitioning(nn.initializers.constant(value), ())
            return self.param(name, init, (), cfg.dtype)

        x = jnp.clip(x, bound("input_min", -jnp.inf), bound("input_max", jnp.inf))
        x = Linear(self.features, _REPLICATED, False, cfg.dtype, name="linear")(x)
        return jnp.clip(x, bound("output_min", -jnp.inf), bound("output_max", jnp.inf))


class Gemma4VisionAttention(nn.Module):
    """Normed, axially rotated attention over one image's real patches (scale 1)."""

    config: Gemma4VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array, coords: jax.Array, real: jax.Array) -> jax.Array:
        cfg = self.config
        n, length, _ = x.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = ClippableLinear(cfg, hq * d, name="q_proj")(x).reshape(n, length, hq, d)
        k = ClippableLinear(cfg, hkv * d, name="k_proj")(x).reshape(n, length, hkv, d)
        v = ClippableLinear(cfg, hkv * d, name="v_proj")(x).reshape(n, length, hkv, d)
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, 0.0, cfg.dtype, "head_dim")
        q = axial_rope(norm(name="q_norm")(q), coords, cfg.rope_theta)
        k = axial_rope(norm(name="k_norm")(k), coords, cfg.rope_theta)
        v = unit_rms(v, cfg.rms_norm_eps)
        q = q.reshape(n, length, hkv, hq // hkv, d)  # [N, L, Hkv, G, d]
        scores = jnp.einsum("nqhgd,nkhd->nhgqk", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(real[:, None, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("nhgqk,nkhd->nqhgd", probs, v).reshape(n, length, hq * d)
        return ClippableLinear(cfg, cfg.hidden_size, name="o_proj")(out)


class Gemma4VisionMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``."""

    config: Gemma4VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        gate = ClippableLinear(cfg, cfg.intermediate_size, name="gate_proj")(x)
        up = ClippableLinear(cfg, cfg.intermediate_size, name="up_proj")(x)
        return ClippableLinear(cfg, cfg.hidden_size, name="down_proj")(
            activation(cfg.hidden_act)(gate) * up
        )


class Gemma4VisionEncoderLayer(nn.Module):
    """Sandwich norms around attention and the MLP."""

    config: Gemma4VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array, coords: jax.Array, real: jax.Array) -> jax.Array:
        cfg = self.config
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, 0.0, cfg.dtype)
        h = Gemma4VisionAttention(cfg, name="self_attn")(
            norm(name="input_layernorm")(x), coords, real
        )
        x = x + norm(name="post_attention_layernorm")(h)
        h = Gemma4VisionMLP(cfg, name="mlp")(norm(name="pre_feedforward_layernorm")(x))
        return x + norm(name="post_feedforward_layernorm")(h)


class Gemma4PatchEmbedder(nn.Module):
    """``input_proj(2 * pixels - 1)`` + the x and y rows of the position table."""

    config: Gemma4VisionConfig

    @nn.compact
    def __call__(self, pixels: jax.Array, coords: jax.Array, real: jax.Array) -> jax.Array:
        cfg = self.config
        x = Linear(cfg.hidden_size, _REPLICATED, False, cfg.dtype, name="input_proj")(
            (2.0 * (pixels - 0.5)).astype(cfg.dtype)
        )  # [N, L, D]
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, None, "embed"))
        shape = (2, cfg.position_embedding_size, cfg.hidden_size)
        table = self.param("position_embedding_table", init, shape, cfg.dtype)
        at = jnp.maximum(coords, 0)
        pos = table[0][at[..., 0]] + table[1][at[..., 1]]  # [N, L, D]
        return x + jnp.where(real[..., None], pos, 0.0).astype(x.dtype)


def pool(x: jax.Array, coords: jax.Array, real: jax.Array, k: int) -> jax.Array:
    """``[N, L, D]`` patches -> ``[N, L / k^2, D]`` float32 soft tokens: each the mean of
    its ``k x k`` block (padding rows count as zeros), in row-major block order."""
    n, length, _ = x.shape
    x = jnp.where(real[..., None], x, 0.0).astype(jnp.float32)
    if k == 1:
        return x
    at = jnp.maximum(coords, 0)
    width = jnp.max(at[..., 0], axis=-1, keepdims=True) + 1  # [N, 1]
    token = at[..., 0] // k + (width // k) * (at[..., 1] // k)  # [N, L]
    weights = jax.nn.one_hot(token, length // (k * k), dtype=jnp.float32) / (k * k)
    return jnp.einsum("nlt,nld->ntd", weights, x, precision=jax.lax.Precision.HIGHEST)


class Gemma4VisionTower(nn.Module):
    """Patch embedder, encoder layers (``encoder/layers_{i}``), pooler and the optional
    standardization: transformers' ``Gemma4VisionModel`` before it drops padding."""

    config: Gemma4VisionConfig

    @nn.compact
    def __call__(self, pixels: jax.Array, coords: jax.Array) -> jax.Array:
        cfg = self.config
        real = jnp.any(coords != -1, axis=-1)  # [N, L]
        x = Gemma4PatchEmbedder(cfg, name="patch_embedder")(pixels, coords, real)
        for i in range(cfg.num_layers):
            x = Gemma4VisionEncoderLayer(cfg, name=f"encoder_layers_{i}")(x, coords, real)
        x = pool(x, coords, real, cfg.pooling_kernel_size) * cfg.hidden_size**0.5
        if cfg.standardize:
            init = nn.with_logical_partitioning(nn.initializers.zeros, ("embed",))
            bias = self.param("std_bias", init, (cfg.hidden_size,), cfg.dtype)
            scale = self.param("std_scale", init, (cfg.hidden_size,), cfg.dtype)
            x = (x - bias.astype(jnp.float32)) * scale.astype(jnp.float32)
        return x.astype(cfg.dtype)


class Gemma4MultimodalEmbedder(nn.Module):
    """An RMSNorm without weight, then ``embedding_projection`` to the decoder's width."""

    config: Gemma4VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        proj = Linear(cfg.text_hidden_size, ("embed", None), False, cfg.dtype,
                      name="embedding_projection")  # fmt: skip
        return proj(unit_rms(x, cfg.rms_norm_eps))


class Gemma4VisionEncoder(nn.Module):
    """Images -> decoder embeddings: ``vision_tower`` then ``embed_vision``.

    ``pixel_values [N, L, 3 p^2]`` and ``image_position_ids [N, L, 2]`` (L a multiple
    of k^2; padding rows at (-1, -1)) -> ``[N, L / k^2, text_hidden_size]``; an image's
    real tokens come first. Images are independent: padding images change no other.
    """

    config: Gemma4VisionConfig

    @float32_dots
    @nn.compact
    def __call__(self, pixel_values: jax.Array, image_position_ids: jax.Array) -> jax.Array:
        cfg = self.config
        x = Gemma4VisionTower(cfg, name="vision_tower")(pixel_values, image_position_ids)
        return Gemma4MultimodalEmbedder(cfg, name="embed_vision")(x)

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], None] | None:
        """``[model.]vision_tower.*`` and ``[model.]embed_vision.*`` -> ``(path, None)``
        (``encoder.layers.3.x`` -> ``encoder_layers_3/x``); None for everything else."""
        top, _, rest = name.removeprefix("model.").partition(".")
        if top not in ("vision_tower", "embed_vision"):
            return None
        parts = rest.split(".")
        if parts[:2] == ["encoder", "layers"] and len(parts) > 2:
            parts = [f"encoder_layers_{parts[2]}", *parts[3:]]
        return (top, *parts), None


def example_inputs(config: Gemma4VisionConfig, tokens: int = 1) -> tuple[jax.Array, jax.Array]:
    """One image of ``tokens`` soft tokens' patches, all real (for init and shapes)."""
    rows, k = tokens * config.patches_per_token, config.pooling_kernel_size
    coords = jnp.stack(jnp.meshgrid(jnp.arange(k), jnp.arange(rows // k), indexing="xy"), -1)
    pixels = jnp.zeros((1, rows, config.patch_dim), config.dtype)
    return pixels, coords.reshape(1, rows, 2).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def image_features(
    config: Gemma4VisionConfig, params: Any, pixel_values: jax.Array, image_position_ids: jax.Array
) -> jax.Array:
    """Pure jitted encoder (`Gemma4VisionEncoder`): ``[N, L / k^2, text_hidden_size]``."""
    return Gemma4VisionEncoder(config).apply({"params": params}, pixel_values, image_position_ids)
