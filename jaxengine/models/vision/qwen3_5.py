"""Qwen3.5: the vision tower (pixels -> decoder tokens).

The tower (`Qwen3_5VisionModel`) takes the processor's ``pixel_values`` rows,
zero-padded to ``N``, and a `qwen3_5_inputs.VisionLayout` built on the host:

1. patch embedding: the checkpoint's biased Conv3d has kernel = stride = one patch,
   so it is one matmul over the flattened rows (Qwen2.5-VL's `PatchProjection`);
2. plus the learned position table resampled to each image's grid: each row blends
   four table rows by the layout's bilinear weights;
3. ``depth`` pre-norm blocks (LayerNorm, Qwen2.5-VL's `VisionAttention`: biased fused
   ``qkv``, the same 2-D rotary embedding, attention within each frame of each image
   by segment ids over the fixed ``N`` rows, biased ``proj``; LayerNorm, biased
   ``linear_fc1``-act-``linear_fc2`` MLP);
4. the merger: LayerNorm, each unit's ``m*m`` rows concatenated, Linear-GELU-Linear.

Rows keep the processor's order throughout (no windows), so the output ``[N / m**2,
out_hidden_size]`` is image after image (`qwen2_5_vl_inputs.split_tokens`), then
padding rows to ignore.

Parameters keep the checkpoint's names: ``model.visual.blocks.3.attn.qkv.weight`` is
``blocks_3/attn/qkv/weight`` (Qwen2.5-VL's `hf_param_path`). The tower is small next to
the decoder: its weights are replicated.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import LayerNorm, activation, matmul_precision
from jaxengine.models.vision.qwen2_5_vl import (
    PatchProjection,
    Qwen2_5_VisionTransformer,
    VisionAttention,
    register_layout,
    tower_linear,
    vision_rope_angles,
)
from jaxengine.models.vision.qwen3_5_inputs import Qwen3_5VisionConfig, VisionLayout, vision_layout

register_layout(VisionLayout)

_NORM_EPS = 1e-6  # transformers hard-codes the tower's LayerNorm epsilon


def _norm(cfg: Qwen3_5VisionConfig, name: str) -> LayerNorm:
    return LayerNorm(_NORM_EPS, dtype=cfg.dtype, name=name)


class PatchEmbed(nn.Module):
    """``patch_embed``: holds the biased ``proj`` kernel, as the checkpoint names it."""

    config: Qwen3_5VisionConfig

    @nn.compact
    def __call__(self, patches: jax.Array) -> jax.Array:
        return PatchProjection(self.config, use_bias=True, name="proj")(patches)


class PositionTable(nn.Module):
    """``pos_embed``: the ``[side * side, E]`` table, each row's four taps blended."""

    config: Qwen3_5VisionConfig

    @nn.compact
    def __call__(self, index: jax.Array, weight: jax.Array) -> jax.Array:  # [N, 4] x 2
        cfg = self.config
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed"))
        shape = (cfg.num_position_embeddings, cfg.hidden_size)
        table = self.param("weight", init, shape, cfg.dtype)
        return (table[index] * weight[:, :, None].astype(cfg.dtype)).sum(axis=1)  # [N, E]


class VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``, both biased."""

    config: Qwen3_5VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = activation(cfg.hidden_act)(tower_linear(cfg, cfg.intermediate_size, "linear_fc1")(x))
        return tower_linear(cfg, cfg.hidden_size, "linear_fc2")(h)


class VisionBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``; attention
    within each frame (query blocks against all rows, by segment)."""

    config: Qwen3_5VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array, angles: jax.Array, segments: jax.Array) -> jax.Array:
        cfg = self.config
        attn = VisionAttention(cfg, full=True, name="attn")
        x = x + attn(_norm(cfg, "norm1")(x), angles, segments)
        return x + VisionMLP(cfg, name="mlp")(_norm(cfg, "norm2")(x))


class PatchMerger(nn.Module):
    """``norm`` LayerNorm, each unit's ``m*m`` rows side by side, ``linear_fc1``-GELU-
    ``linear_fc2``."""

    config: Qwen3_5VisionConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [N, E] -> [N / m**2, out]
        cfg = self.config
        width = cfg.hidden_size * cfg.merge_unit
        x = _norm(cfg, "norm")(x).reshape(-1, width)
        x = jax.nn.gelu(tower_linear(cfg, width, "linear_fc1")(x), approximate=False)
        return tower_linear(cfg, cfg.out_hidden_size, "linear_fc2")(x)


class Qwen3_5VisionModel(nn.Module):
    """The tower: ``pixel_values [N, C*T*p*p]`` and a layout -> ``[N / m**2, out]``."""

    config: Qwen3_5VisionConfig

    @nn.compact
    def __call__(self, pixel_values: jax.Array, layout: VisionLayout) -> jax.Array:
        cfg = self.config
        with matmul_precision(cfg):  # float32: exact dots, as torch's
            x = PatchEmbed(cfg, name="patch_embed")(pixel_values)
            x = x + PositionTable(cfg, name="pos_embed")(layout.pos_index, layout.pos_weight)
            angles = vision_rope_angles(layout.rope_hw, cfg.head_dim, cfg.rope_theta)
            for i in range(cfg.depth):
                x = VisionBlock(cfg, name=f"blocks_{i}")(x, angles, layout.segments)
            return PatchMerger(cfg, name="merger")(x)

    hf_param_path = staticmethod(Qwen2_5_VisionTransformer.hf_param_path)
    """``model.visual.*`` (or ``visual.*``) with ``blocks.N`` as ``blocks_N``; the
    decoder's tensors -> None."""


def example_inputs(config: Qwen3_5VisionConfig) -> tuple[jax.Array, VisionLayout]:
    """The smallest valid inputs (one merge unit of one image), for init and shapes."""
    m = config.spatial_merge_size
    layout = vision_layout([[1, m, m]], config)
    return jnp.zeros((config.merge_unit, config.patch_dim), config.dtype), layout
