"""Qwen2.5-VL: the vision tower (pixels -> decoder tokens).

The tower (`Qwen2_5_VisionTransformer`) takes the processor's ``pixel_values`` rows,
zero-padded to ``N``, and a `qwen2_5_vl_inputs.VisionLayout` built on the host:

1. patch embedding: the checkpoint's Conv3d has kernel = stride = one patch
   (``[E, C, T, p, p]``), so it is one matmul over the flattened rows;
2. the rows are gathered into window order (whole merge units move);
3. ``depth`` pre-norm blocks (RMSNorm, biased fused ``qkv``, 2-D rotary embedding,
   attention, biased ``proj``; RMSNorm, gated SiLU MLP with biases). Blocks of
   ``fullatt_block_indexes`` attend within each frame of each image, the others
   within each window, by the layout's segment ids over the fixed ``N`` rows, so
   images never see each other and padding never touches a real row;
4. the merger: RMSNorm, each unit's ``m*m`` rows concatenated, Linear-GELU-Linear;
5. the merged tokens gathered back to the processor's order.

Output: ``[N / m**2, out_hidden_size]``, image after image (`qwen2_5_vl_inputs.
split_tokens`), then padding rows to ignore.

Attention memory grows linearly with ``N`` (`pallas_kernels.encoder_attention.
segments`; the dense ``[heads, N, N]`` form would need hundreds of GB at the default
processor's largest image, 65536 patches): window blocks take each ``window_rows``
queries against the keys of their own and the two neighbouring query blocks
(`window_attention`: a window is a contiguous run of at most ``window_rows`` rows in
window order), and full-attention blocks score ``query_block`` queries at a time
against all ``N`` keys (`blocked_segment_attention`).

The decoder's M-RoPE is `layers.rope.apply_mrope`, over the 3-row positions of
`qwen2_5_vl_inputs.mrope_chunk`.

Parameters keep the checkpoint's names and layouts: ``model.visual.blocks.3.attn.qkv.
weight`` (or ``visual.blocks...`` in older checkpoints) is ``blocks_3/attn/qkv/weight``,
``merger.mlp.2.bias`` is ``merger/mlp_2/bias`` (`Qwen2_5_VisionTransformer.
hf_param_path`). The tower is small next to the decoder: its weights are replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.layers.basic import Linear, RMSNorm, activation
from jaxengine.models.vision.qwen2_5_vl_inputs import (
    Qwen2_5_VisionConfig,
    VisionLayout,
    vision_layout,
)
from pallas_kernels.encoder_attention import blocked_segment_attention, window_attention


def register_layout(layout_type: type) -> None:
    """Registers a host layout dataclass as a pytree of arrays (a jitted argument)."""
    fields = [f.name for f in dataclasses.fields(layout_type)]
    jax.tree_util.register_dataclass(layout_type, data_fields=fields, meta_fields=[])


register_layout(VisionLayout)

_REPLICATED = (None, "embed")  # logical axes of every tower weight (`sharding.rules`)
_NORM_EPS = 1e-6  # transformers hard-codes the tower's RMSNorm epsilon


def rotate(x: jax.Array, angles: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotate-half rotary embedding of ``x [T, H, D]`` by ``angles [T, D/2]``: feature
    ``j`` pairs with ``j + D/2``. In float32, returned in ``x``'s dtype."""
    cos = (jnp.cos(angles) * scale)[:, None, :]  # [T, 1, D/2]
    sin = (jnp.sin(angles) * scale)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def vision_rope_angles(rope_hw: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Angles ``[N, D/2]`` of the 2-D rotary: ``D/4`` frequencies times h, then w."""
    half = head_dim // 2
    inv_freq = (1.0 / theta ** (np.arange(0, half, 2) / half)).astype(np.float32)  # [D/4]
    angles = rope_hw.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)  # [N, 2, D/4]
    return angles.reshape(rope_hw.shape[0], half)


def tower_linear(cfg: Qwen2_5_VisionConfig, features: int, name: str) -> Linear:
    """A biased, replicated tower projection (this tower's and Qwen3.5's)."""
    return Linear(features, _REPLICATED, use_bias=True, dtype=cfg.dtype, name=name)


class PatchProjection(nn.Module):
    """The patch "Conv3d" ``proj``: ``[N, C*T*p*p]`` rows -> ``[N, E]``; the kernel keeps
    the checkpoint's ``[E, C, T, p, p]`` (the processor flattens rows in C, T, p, p);
    ``use_bias``: plus its ``bias [E]`` (Qwen3.5)."""

    config: Qwen2_5_VisionConfig
    use_bias: bool = False

    @nn.compact
    def __call__(self, patches: jax.Array) -> jax.Array:
        cfg = self.config
        shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size)
        shape += (cfg.patch_size, cfg.patch_size)
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (None,) * 5)
        kernel = self.param("weight", init, shape, cfg.dtype).reshape(cfg.hidden_size, -1)
        out = jnp.dot(patches.astype(cfg.dtype), kernel.T)
        if not self.use_bias:
            return out
        zeros = nn.with_logical_partitioning(nn.initializers.zeros, (None,))
        return out + self.param("bias", zeros, (cfg.hidden_size,), cfg.dtype)


class PatchEmbed(nn.Module):
    """``patch_embed``: holds the ``proj`` kernel, as the checkpoint names it."""

    config: Qwen2_5_VisionConfig

    @nn.compact
    def __call__(self, patches: jax.Array) -> jax.Array:
        return PatchProjection(self.config, name="proj")(patches)


class VisionAttention(nn.Module):
    """Fused ``qkv``, 2-D rotary on q and k, attention within each row's segment
    (``full``: its frame, in query blocks; else its window), ``proj``."""

    config: Qwen2_5_VisionConfig
    full: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, angles: jax.Array, segments: jax.Array) -> jax.Array:
        cfg = self.config
        n, h, d = x.shape[0], cfg.num_heads, cfg.head_dim
        qkv = tower_linear(cfg, 3 * cfg.hidden_size, "qkv")(x).reshape(n, 3, h, d)
        q, k = rotate(qkv[:, 0], angles), rotate(qkv[:, 1], angles)  # [N, H, D]
        if self.full:
            out = blocked_segment_attention(
                q, k, qkv[:, 2], segments, sm_scale=d**-0.5, block=cfg.query_block
            )
        else:
            out = window_attention(
                q, k, qkv[:, 2], segments, sm_scale=d**-0.5, max_len=cfg.window_rows
            )
        return tower_linear(cfg, cfg.hidden_size, "proj")(out.reshape(n, h * d))


class VisionMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, every projection biased."""

    config: Qwen2_5_VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        gate = tower_linear(cfg, cfg.intermediate_size, "gate_proj")(x)
        up = tower_linear(cfg, cfg.intermediate_size, "up_proj")(x)
        down = tower_linear(cfg, cfg.hidden_size, "down_proj")
        return down(activation(cfg.hidden_act)(gate) * up)


class VisionBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    config: Qwen2_5_VisionConfig
    full: bool = False  # full attention (within each frame), else windows

    @nn.compact
    def __call__(self, x: jax.Array, angles: jax.Array, segments: jax.Array) -> jax.Array:
        cfg = self.config
        attn = VisionAttention(cfg, self.full, name="attn")
        x = x + attn(RMSNorm(_NORM_EPS, dtype=cfg.dtype, name="norm1")(x), angles, segments)
        return x + VisionMLP(cfg, name="mlp")(RMSNorm(_NORM_EPS, dtype=cfg.dtype, name="norm2")(x))


class PatchMerger(nn.Module):
    """``ln_q`` RMSNorm, each unit's ``m*m`` rows side by side, ``mlp_0``-GELU-``mlp_2``."""

    config: Qwen2_5_VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [N, E] -> [N / m**2, out]
        cfg = self.config
        width = cfg.hidden_size * cfg.merge_unit
        x = RMSNorm(_NORM_EPS, dtype=cfg.dtype, name="ln_q")(x).reshape(-1, width)
        x = jax.nn.gelu(tower_linear(cfg, width, "mlp_0")(x), approximate=False)
        return tower_linear(cfg, cfg.out_hidden_size, "mlp_2")(x)


_PREFIXES = ("model.visual.", "visual.")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_MERGER_MLP = re.compile(r"^merger\.mlp\.(\d+)\.")


class Qwen2_5_VisionTransformer(nn.Module):
    """The tower: ``pixel_values [N, C*T*p*p]`` and a layout -> ``[N / m**2, out]``."""

    config: Qwen2_5_VisionConfig

    @nn.compact
    def __call__(self, pixel_values: jax.Array, layout: VisionLayout) -> jax.Array:
        cfg = self.config
        full_f32 = jnp.dtype(cfg.dtype) == jnp.float32  # torch keeps float32 dots exact
        precision = jax.default_matmul_precision("float32") if full_f32 else None
        with precision or contextlib.nullcontext():
            x = PatchEmbed(cfg, name="patch_embed")(pixel_values)[layout.patch_order]
            angles = vision_rope_angles(layout.rope_hw, cfg.head_dim, cfg.rope_theta)
            for i in range(cfg.depth):
                full = i in cfg.fullatt_block_indexes
                segments = layout.frame_segments if full else layout.window_segments
                x = VisionBlock(cfg, full, name=f"blocks_{i}")(x, angles, segments)
            return PatchMerger(cfg, name="merger")(x)[layout.token_order]

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], None] | None:
        """A checkpoint tensor's parameter path, or None for the decoder's tensors."""
        body = next((name[len(p) :] for p in _PREFIXES if name.startswith(p)), None)
        if body is None:
            return None
        body = _MERGER_MLP.sub(r"merger.mlp_\1.", _BLOCK.sub(r"blocks_\1.", body))
        return tuple(body.split(".")), None


def example_inputs(config: Qwen2_5_VisionConfig) -> tuple[jax.Array, VisionLayout]:
    """The smallest valid inputs (one merge unit of one image), for init and shapes."""
    m = config.spatial_merge_size
    layout = vision_layout([[1, m, m]], config)
    return jnp.zeros((config.merge_unit, config.patch_dim), config.dtype), layout
