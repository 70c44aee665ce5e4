"""Self-attention over the paged KV cache: projections, rope, cache write, attention.

The attention function itself is injected (`attention_fn`): the pure-jnp reference on
CPU, a Pallas kernel on TPU/GPU. Both share the signature of
`pallas_kernels.ragged_paged_attention.reference.ragged_paged_attention`.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Linear, RMSNorm
from jaxengine.models.layers.config import LayerSpec, TransformerConfig
from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.models.layers.rope import apply_mrope, apply_rope
from pallas_kernels.kv_cache_update import reference as kv_update
from pallas_kernels.ragged_paged_attention import reference

AttentionFn = Callable[..., jax.Array]
KV_SCALES = ("k_scale", "v_scale")
"""An fp8 KV cache's per-tensor scales (`TransformerConfig.kv_cache_scales`)."""
KV_SCALE_RANGES = (200.0, 100.0)
"""``--calculate-kv-scales``: k and v scales map the first batch's largest magnitude
to these (vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT), leaving headroom below
float8_e4m3fn's 448 for larger values later."""


class Attention(nn.Module):
    """q/k/v/o projections with optional QK-norm, rope and paged attention (with
    ``config.attention_sinks``, a ``sinks [Hq]`` parameter goes to the kernel).

    With ``config.fused_projections`` q/k/v are one matmul over ``qkv_proj`` (rows
    ``[q; k; v]``, `qkv_rows`), split after the dot; QK-norm and rope follow as usual.
    """

    config: TransformerConfig
    spec: LayerSpec
    attention_fn: AttentionFn = reference.ragged_paged_attention
    update_fn: Callable[..., jax.Array] = kv_update.update_kv_cache

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, H]
        positions: jax.Array,  # [T]
        kv_cache: jax.Array,  # [P, S, 2*Hkv, D]
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        num_tokens = x.shape[0]
        hq, d = cfg.num_heads, cfg.head_dim
        q, k, v = _project_qkv(x, cfg, md.lora_slots)  # [T, Hq, D], [T, Hkv, D] x 2
        if cfg.qk_norm:
            norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=cfg.dtype)
            q = RMSNorm(**norm, axis_name="head_dim", name="q_norm")(q)
            k = RMSNorm(**norm, axis_name="head_dim", name="k_norm")(k)
        q, k = _position_terms(q, k, positions, self.spec, md, cfg.rms_norm_eps)

        if cfg.kv_cache_scales:  # the cache holds k / k_scale and v / v_scale
            if self.is_mutable_collection("intermediates"):  # --calculate-kv-scales' pass
                self.sow("intermediates", "kv_amax", _kv_amax(k, v, md))
            ones = nn.with_logical_partitioning(nn.initializers.ones, ())  # 1 unless given
            k_scale, v_scale = (self.param(n, ones, (), jnp.float32) for n in KV_SCALES)
            k, v = (k / k_scale).astype(k.dtype), (v / v_scale).astype(v.dtype)
            q = (q * k_scale).astype(q.dtype)  # q . k_true == (q * k_scale) . k_stored
        kv_cache = self.update_fn(kv_cache, k, v, md.slot_mapping)
        both_ways = {} if md.attend_until is None else {"attend_until": md.attend_until}
        if self.spec.attention_chunk_size is not None:  # only chunked layers pass it
            both_ways["attention_chunk_size"] = self.spec.attention_chunk_size
        if cfg.attention_sinks:  # gpt-oss: self_attn.sinks, split with the query heads
            init = nn.with_logical_partitioning(nn.initializers.zeros, ("q_heads",))
            both_ways["sinks"] = self.param("sinks", init, (hq,), jnp.float32)
        out = self.attention_fn(
            q,
            kv_cache,
            md.seq_lens,
            md.page_table,
            md.query_start_loc,
            md.num_seqs,
            sm_scale=cfg.scale,
            sliding_window=self.spec.sliding_window,
            soft_cap=cfg.attn_logit_softcap,
            **both_ways,
        )  # [T, Hq, D]
        if cfg.kv_cache_scales:  # p @ v_true == (p @ v_stored) * v_scale
            out = (out * v_scale).astype(out.dtype)
        o_proj = Linear(
            cfg.hidden_size,
            ("embed", "q_heads"),
            cfg.o_bias,
            cfg.dtype,
            cfg.quantization,
            cfg.lora,
            name="o_proj",
            weight_dtype=cfg.matmul_dtype,
        )
        return o_proj(out.reshape(num_tokens, hq * d), md.lora_slots), kv_cache


def _rope(q, k, positions, spec: LayerSpec, md: AttentionMetadata) -> tuple[jax.Array, ...]:
    """q and k rotated by ``positions [T]``, or by an M-RoPE model's
    ``md.mrope_positions [3, T]`` (without them, as text: every row ``positions``)."""
    if spec.rope.mrope_section is None or md.mrope_positions is None:
        return apply_rope(q, positions, spec.rope), apply_rope(k, positions, spec.rope)
    return tuple(apply_mrope(x, md.mrope_positions, spec.rope) for x in (q, k))


def _position_terms(q, k, positions, spec: LayerSpec, md, eps: float) -> tuple[jax.Array, ...]:
    """q and k after what the layer's spec asks at their positions: rope (unless
    ``use_rope`` is off), then the weightless QK L2 norm, then the queries' attention
    temperature (Llama 4)."""
    if spec.use_rope:
        q, k = _rope(q, k, positions, spec, md)
    if spec.qk_l2_norm:
        q, k = (_unit_rms(x, eps) for x in (q, k))
    if spec.attn_temperature is not None:
        floor_scale, attn_scale = spec.attn_temperature
        pos = positions.astype(jnp.float32)
        scale = jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]
        q = (q * scale[:, None, None]).astype(q.dtype)
    return q, k


def _unit_rms(x: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x)`` over the last axis (``eps`` inside the root), in float32."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _kv_amax(k: jax.Array, v: jax.Array, md: AttentionMetadata) -> jax.Array:
    """``[2]``: the largest magnitudes of the batch's k and v (padding tokens left out)."""
    real = jnp.arange(k.shape[0]) < md.query_start_loc[md.num_seqs]
    return jnp.stack(
        [
            jnp.max(jnp.where(real[:, None, None], jnp.abs(x), 0.0)).astype(jnp.float32)
            for x in (k, v)
        ]
    )


def qkv_rows(config: TransformerConfig) -> tuple[int, int, int]:
    """Output rows of q, k and v: their order and sizes inside a fused ``qkv_proj``."""
    d = config.head_dim
    return config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d


def _project_qkv(x: jax.Array, cfg: TransformerConfig, lora_slots=None) -> tuple[jax.Array, ...]:
    """q, k, v as ``[T, heads, D]``: three matmuls, or one over the fused ``qkv_proj``.

    The fused weight keeps the ``q_heads`` logical axis on its rows; that is right
    only unsplit (tensor size 1), which is when the loader fuses (never with LoRA:
    adapters hold q, k and v apart)."""
    num_tokens, d = x.shape[0], cfg.head_dim
    rows = qkv_rows(cfg)
    if cfg.fused_projections:
        fused = Linear(
            sum(rows),
            ("q_heads", "embed"),
            cfg.qkv_bias,
            cfg.dtype,
            cfg.quantization,
            name="qkv_proj",
            weight_dtype=cfg.matmul_dtype,
        )
        qkv = fused(x)  # [T, (Hq + 2 Hkv) D]
        parts = jnp.split(qkv, [rows[0], rows[0] + rows[1]], axis=-1)
    else:
        names = (("q_proj", "q_heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads"))
        parts = [
            Linear(
                n,
                (axis, "embed"),
                cfg.qkv_bias,
                cfg.dtype,
                cfg.quantization,
                cfg.lora,
                name=name,
                weight_dtype=cfg.matmul_dtype,
            )(x, lora_slots)  # fmt: skip
            for n, (name, axis) in zip(rows, names, strict=True)
        ]
    return tuple(p.reshape(num_tokens, p.shape[-1] // d, d) for p in parts)


def kv_cache_shape(
    config: TransformerConfig,
    num_pages: int,
    page_size: int,
    num_kv_heads: int | None = None,
    platform: str | None = None,
    shards: int = 1,
) -> tuple:
    """Shape of one layer's cache: ``[num_pages, page_size, 2 * Hkv, D]``; with
    multi-head latent attention (``config.mla``) ``[num_pages, page_size, Hkv, W]``,
    one row a token (latent and rope key, `pallas_kernels.mla.reference`), Hkv 1.

    ``num_kv_heads`` overrides the model's count where a tensor-parallel layout stores
    KV heads once per device (`sharding.plan.ShardingPlan.kv_cache_heads`; an MLA
    cache: one copy of the latent row per tensor device); the head axis splits into
    ``shards`` equal parts, one a tensor device. On ``platform`` "tpu" an MLA
    row ``W`` is padded with zeros to a multiple of 128 lanes (DeepSeek-V3's 576 to
    640), and so is a K/V row ``D`` (gpt-oss's and Llama-3.2-1B's 64 to 128): TPU's HBM
    layout of a row off the 128-lane tile puts the pages on lanes, which no kernel
    reads in place, so XLA would copy the whole cache around every step's attention.
    Likewise each shard's K/V rows are padded (`tpu_cache_rows`: Phi-4's 10 a chip at
    TP 2 to 16); the real heads' rows come first, the writes fill the rest with zeros
    and the attention reads only the real heads (``num_kv_heads`` of the kernels).
    """
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    lanes = TPU_LANES if platform == "tpu" else 1
    width = -(-config.head_dim // lanes) * lanes
    if getattr(config, "mla", None) is None:
        rows = 2 * heads // shards  # K and V of a shard's heads
        rows = tpu_cache_rows(rows) if platform == "tpu" else rows
        return (num_pages, page_size, shards * rows, width)
    return (num_pages, page_size, heads, width)


TPU_LANES = 128
TPU_CACHE_ROW_ALIGN = 8


def tpu_cache_rows(rows: int) -> int:
    """A device's K/V rows of a TPU cache: ``rows`` up to a multiple of 8, or as they
    are where 4 or fewer (Llama's 2 or 4 a chip). Any other count (6, 10, 12, 20...)
    gets an HBM layout the Mosaic kernels do not read, and XLA copies the whole cache
    into theirs around every step's attention and write (found by compiling for v6e,
    bfloat16, float32 and float8 caches alike: tests/sharding/test_tpu_cache_rows.py)."""
    if rows <= 4:
        return rows
    return -(-rows // TPU_CACHE_ROW_ALIGN) * TPU_CACHE_ROW_ALIGN
