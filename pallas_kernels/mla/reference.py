"""Pure-jnp reference of ragged paged multi-head latent attention (MLA, DeepSeek-V2/V3)
in its absorbed form, and its KV-cache write. The spec for later MLA kernels.

Layout contract:

- ``kv_cache``: one array per layer, ``[num_pages, page_size, 1, W]`` with ``W =
  kv_lora_rank + qk_rope_head_dim``: per token one row, the normalized latent
  ``c [L]`` then the rotated shared key ``k_pe [R]`` (on TPU zeros after them, to a
  multiple of 128 lanes; the queries carry as many zeros). There is no head axis: every
  query head reads the same row (multi-query attention with one KV "head"). Under
  tensor parallelism each device holds its own copy of this row (the cache's axis 2
  is the tensor axis, one row per device, `sharding.plan`), so attention needs no
  collective.
- The batch metadata are `pallas_kernels.ragged_paged_attention.reference`'s: request
  ``r`` owns tokens ``query_start_loc[r]:query_start_loc[r + 1]``, its KV length after
  this step is ``seq_lens[r]``, its pages ``page_table[r]``; requests ``>= num_seqs``
  and tokens past ``query_start_loc[num_seqs]`` are padding (zero output, no NaN).

The absorbed form: with ``kv_b_proj``'s key rows ``W_uk[h] [nope, L]`` and value rows
``W_uv[h] [v, L]``, head ``h``'s score of key ``j`` is ``q_nope[h] . (W_uk[h] c_j) +
q_pe[h] . k_pe_j = [q_nope[h] W_uk[h]; q_pe[h]] . [c_j; k_pe_j]``, and its output
``sum_j p_j W_uv[h] c_j = W_uv[h] (sum_j p_j c_j)``. So the model passes the absorbed
query ``[T, Hq, W]`` and gets back ``sum_j p_j c_j`` ``[T, Hq, L]`` (the value is the
row's first ``value_dim = L`` features), applying ``W_uv`` after. Exact for prefill and
decode alike: one formulation for every step.

Algorithm: as the GQA reference, token-major online softmax over chunks of pages in
float32; the row is read once for scores and values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache_update.reference import to_cache_dtype
from pallas_kernels.ragged_paged_attention.reference import _token_layout

_MASKED = -1e30  # finite, so an all-masked chunk gives no NaN


def ragged_paged_mla(
    q: jax.Array,  # [T, Hq, W]: absorbed queries, [q_nope W_uk; q_pe]
    kv_cache: jax.Array,  # [P, S, 1, W]
    seq_lens: jax.Array,  # [R] int32
    page_table: jax.Array,  # [R, M] int32
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    value_dim: int,
    pages_per_chunk: int = 4,
) -> jax.Array:
    """Each new token's attention over its request's latent rows; returns ``[T, Hq,
    value_dim]``: ``sum_j p_j row_j[:value_dim]``, ``p`` the causal softmax of
    ``sm_scale * q . row_j`` over the request's keys up to the token's own position
    (DeepSeek's layers have no window or soft cap). Accumulates in float32; the output
    has ``q``'s dtype."""
    num_tokens, num_heads, width = q.shape
    _, page_size, rows, cache_width = kv_cache.shape
    if rows != 1 or cache_width != width or not 0 < value_dim <= width:
        raise ValueError(
            f"MLA: cache {kv_cache.shape} (one row per token), queries {q.shape}, "
            f"value_dim {value_dim}"
        )
    max_pages = page_table.shape[1]
    chunk = min(pages_per_chunk, max_pages)
    pad = (-max_pages) % chunk
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    chunk_len = chunk * page_size

    req, q_pos, valid = _token_layout(query_start_loc, seq_lens, num_seqs, num_tokens)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    qs = q.astype(jnp.float32) * sm_scale  # [T, Hq, W]
    token_pages = page_table[req]  # [T, M']
    real = jnp.arange(seq_lens.shape[0]) < num_seqs
    longest = jnp.max(jnp.where(real, seq_lens, 0))
    num_chunks = (longest + chunk_len - 1) // chunk_len

    def body(c, carry):
        m, denom, acc = carry  # [T, Hq], [T, Hq], [T, Hq, value_dim]
        pages = jax.lax.dynamic_slice_in_dim(token_pages, c * chunk, chunk, axis=1)
        kv = kv_cache[pages].reshape(num_tokens, chunk_len, width).astype(jnp.float32)
        s = jnp.einsum("thw,tlw->thl", qs, kv, precision=precision)  # [T, Hq, Lc]
        kv_pos = c * chunk_len + jnp.arange(chunk_len)  # [Lc]
        mask = (kv_pos[None, :] <= q_pos[:, None])[:, None, :]  # [T, 1, Lc]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1)
        values = kv[..., :value_dim]  # [T, Lc, value_dim]: the latent
        acc = acc * alpha[..., None] + jnp.einsum("thl,tlv->thv", p, values, precision=precision)
        return m_new, denom, acc

    shape = (num_tokens, num_heads)
    init = (
        jnp.full(shape, _MASKED, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape + (value_dim,), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)
    out = jnp.where(valid[:, None, None], out, 0.0)
    return out.astype(q.dtype)


def check_shapes(q, kv_cache, value_dim: int) -> None:
    """ValueError unless the cache holds one row a token as wide as the queries and
    ``value_dim`` fits in it (the kernels' shared input check)."""
    _, _, rows, cache_width = kv_cache.shape
    if rows != 1 or cache_width != q.shape[-1] or not 0 < value_dim <= cache_width:
        raise ValueError(
            f"MLA: cache {kv_cache.shape} (one row per token), queries {q.shape}, "
            f"value_dim {value_dim}"
        )


def update_mla_cache(
    kv_cache: jax.Array,  # [P, S, 1, L + R]
    latent: jax.Array,  # [T, 1, L]: kv_a_layernorm's output
    k_rope: jax.Array,  # [T, 1, R]: the rotated shared key
    slot_mapping: jax.Array,  # [T] int32, page * page_size + offset
) -> jax.Array:
    """Writes each token's row ``[latent; k_rope]`` into its slot; returns the cache.

    The (cache, first, second, slots) signature of the GQA write
    (`pallas_kernels.kv_cache_update.reference.update_kv_cache`), so the tensor-parallel
    wrapper (`sharding.attention`) runs it per device unchanged. Slots outside
    ``[0, num_pages * page_size)`` are dropped; donate ``kv_cache`` to update in place.
    A cache row wider than ``L + R`` (padded to TPU's 128 lanes,
    `jaxengine.models.layers.attention.kv_cache_shape`) gets zeros after them.
    """
    num_pages, page_size, rows, width = kv_cache.shape
    row = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)  # [T, 1, L + R]
    if 0 < row.shape[-1] < width:  # a row padded to a multiple of 128 lanes (TPU)
        row = jnp.pad(row, ((0, 0), (0, 0), (0, width - row.shape[-1])))
    if row.shape[1:] != (rows, width):
        raise ValueError(f"MLA cache {kv_cache.shape} cannot hold rows {row.shape}")
    num_slots = num_pages * page_size
    flat = kv_cache.reshape(num_slots, rows, width)
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # no wrap-around
    flat = flat.at[slots].set(to_cache_dtype(row, kv_cache.dtype), mode="drop")
    return flat.reshape(kv_cache.shape)
