"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Per token: queries ``[Hq, nope + rope]`` (``q_proj``, or ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``); ``kv_a_proj_with_mqa`` gives the latent ``[L]``
(normalized by ``kv_a_layernorm``) and one rope key ``[R]`` shared by every head. The
cache stores that row, ``[L + R]`` a token (`pallas_kernels.mla.reference`).

Every step runs the absorbed form: ``kv_b_proj``'s key rows fold into the queries
(``q_nope W_uk``) and its value rows into the output (``W_uv`` after attention), so
attention reads the latent rows directly as multi-query attention; this equals
transformers' expanded keys and values exactly (up to float rounding) for prefill
chunks and decodes alike. ``kv_b_proj`` is therefore held as a weight, not a layer
(no LoRA on it), always in the model dtype: a quantized checkpoint's ``kv_b_proj``
(DeepSeek-V3's block fp8) is dequantized to it at load (`loader.params`), as its
two halves are contracted with the queries and the attention output, not used as
one linear. The other projections are `Linear`s, quantized as the model is.

The attention and write functions are injected as `layers.attention.Attention`'s are
(``attention_fn``, ``update_fn``: the MLA backend, `runner.attention_backend`, wrapped
per tensor shard by `sharding.attention` with the heads split and the cache row held
once per device).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Linear, RMSNorm, _normal
from jaxengine.models.layers.config import LayerSpec, TransformerConfig
from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.models.layers.rope import apply_rope
from pallas_kernels.mla import reference


class _Weight(nn.Module):
    """A bare ``weight [out, in]`` parameter (a projection used by its parts)."""

    shape: tuple[int, int]
    axes: tuple[str | None, str | None]
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.with_logical_partitioning(_normal(), self.axes)
        return self.param("weight", init, self.shape, self.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention with transformers' DeepSeek-V3 parameter names."""

    config: TransformerConfig
    spec: LayerSpec
    attention_fn: Callable[..., jax.Array] = reference.ragged_paged_mla
    update_fn: Callable[..., jax.Array] = reference.update_mla_cache

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, H]
        positions: jax.Array,  # [T]
        kv_cache: jax.Array,  # [P, S, 1, L + R]
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        cfg, mla = self.config, self.config.mla
        _check_supported(cfg)
        num_tokens, hq = x.shape[0], cfg.num_heads
        lat, nope, rope = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        q = self._queries(x).reshape(num_tokens, hq, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]  # [T, Hq, nope], [T, Hq, R]
        kv = self._linear(lat + rope, (None, "embed"), cfg.qkv_bias, "kv_a_proj_with_mqa")(x)
        norm = dict(eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        latent = RMSNorm(**norm, name="kv_a_layernorm")(kv[:, :lat])  # [T, L]
        k_pe = kv[:, None, lat:]  # [T, 1, R]
        q_pe, k_pe = (apply_rope(t, positions, self.spec.rope) for t in (q_pe, k_pe))
        kv_cache = self.update_fn(kv_cache, latent[:, None, :], k_pe, md.slot_mapping)

        rows = hq * (nope + mla.v_head_dim)
        w_kv = _Weight((rows, lat), ("q_heads", "embed"), cfg.dtype, name="kv_b_proj")()
        w_kv = w_kv.reshape(hq, nope + mla.v_head_dim, lat)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [Hq, nope, L], [Hq, v, L]
        q_lat = jnp.einsum("thn,hnl->thl", q_nope, w_uk.astype(q_nope.dtype))  # [T, Hq, L]
        q_abs = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)  # [T, Hq, L + R]
        pad = kv_cache.shape[-1] - q_abs.shape[-1]  # a row padded to TPU lanes: zeros
        q_abs = jnp.pad(q_abs, ((0, 0), (0, 0), (0, pad))) if pad else q_abs
        out = self.attention_fn(
            q_abs,
            kv_cache,
            md.seq_lens,
            md.page_table,
            md.query_start_loc,
            md.num_seqs,
            sm_scale=cfg.scale,
            value_dim=lat,
        )
        out = out[..., :lat]  # [T, Hq, L] (a shapes-only stand-in returns the queries)
        o = jnp.einsum("thl,hvl->thv", out, w_uv.astype(out.dtype))  # [T, Hq, v]
        o_proj = self._linear(cfg.hidden_size, ("embed", "q_heads"), cfg.o_bias, "o_proj")
        return o_proj(o.reshape(num_tokens, hq * mla.v_head_dim)), kv_cache

    def _queries(self, x: jax.Array) -> jax.Array:
        """``[T, Hq * (nope + rope)]``: one ``q_proj``, or the low-rank path."""
        cfg, mla = self.config, self.config.mla
        width = cfg.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank is None:
            return self._linear(width, ("q_heads", "embed"), False, "q_proj")(x)
        q = self._linear(mla.q_lora_rank, (None, "embed"), cfg.qkv_bias, "q_a_proj")(x)
        q = RMSNorm(eps=cfg.rms_norm_eps, dtype=cfg.dtype, name="q_a_layernorm")(q)
        return self._linear(width, ("q_heads", "embed"), False, "q_b_proj")(q)

    def _linear(self, features: int, axes: tuple, bias: bool, name: str) -> Linear:
        cfg = self.config
        return Linear(
            features,
            axes,
            bias,
            cfg.dtype,
            cfg.quantization,
            name=name,
            weight_dtype=cfg.matmul_dtype,
        )


def _check_supported(cfg: TransformerConfig) -> None:
    """Refuses what the latent attention does not implement yet, rather than ignore it."""
    missing = {
        "LoRA adapters": cfg.lora is not None,
        "an fp8 KV cache with k/v scales": cfg.kv_cache_scales,
    }
    named = [name for name, asked in missing.items() if asked]
    if named:
        raise NotImplementedError(
            f"multi-head latent attention (DeepSeek-V3) does not support {', '.join(named)} yet"
        )
