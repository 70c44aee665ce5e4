"""Pure-jnp reference of ragged paged attention (the KV-cache write is in
`pallas_kernels.kv_cache_update`).

Layout contract (DESIGN §3):

- ``kv_cache``: one array per layer, ``[num_pages, page_size, 2 * num_kv_heads, head_dim]``
  with K and V interleaved on axis 2: index ``2h`` holds K of KV head ``h``, ``2h + 1``
  holds V of KV head ``h``. On TPU each device's rows may be padded past ``2 *
  num_kv_heads`` (`jaxengine.models.layers.attention.kv_cache_shape`): the real heads'
  rows come first, and the kernels take their count as ``num_kv_heads``; each row may
  be padded past ``head_dim`` with zeros (a 64-value head in 128 lanes), the kernels
  read its first ``head_dim`` (``q``'s) values.
- The batch is flat and ragged: request ``r`` owns the new tokens
  ``query_start_loc[r]:query_start_loc[r + 1]``; its KV length after this step is
  ``seq_lens[r]`` (cached context + new tokens), so its new tokens sit at positions
  ``seq_lens[r] - q_len[r] ... seq_lens[r] - 1`` and attend causally to everything
  before them. Requests ``>= num_seqs`` and tokens ``>= query_start_loc[num_seqs]`` are
  padding: their output is zero and they never produce NaN.
- ``page_table[r, j]`` is the page holding the request's tokens ``j*page_size ...``.
  Unused entries may hold any valid page id (0, the reserved null page, by convention).

Algorithm: token-major flash attention. The loop walks the KV axis in chunks of pages;
each step gathers, for every query token, the chunk of its own request's pages and
updates an online softmax (float32 accumulation). The trip count is the longest real
sequence, so short batches do little work; a decode batch costs one gather of each
request's pages. Prefill chunks gather their request's pages once per token, which is
the price of one formulation for every batch shape; the Pallas kernels avoid it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so an all-masked chunk gives no NaN


def chunk_start(q_pos: jax.Array, chunk_size: int) -> jax.Array:
    """The first key a token at ``q_pos`` sees under chunked local attention: the start
    of its chunk, ``(q_pos // C) * C`` (padding positions, -1, clamp to 0)."""
    return (jnp.maximum(q_pos, 0) // chunk_size) * chunk_size


def join_sinks(
    m: jax.Array, denom: jax.Array, acc: jax.Array, sinks: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The online-softmax state after the attention sinks join it (gpt-oss): each row's
    sink logit adds ``exp(sink - m')`` to the denominator and nothing to the values,
    where ``m'`` is the running max ``m`` updated with the sink. ``m``, ``denom`` and
    ``sinks`` broadcast together (``[..., rows]``), ``acc`` is ``[..., rows, D]``;
    returns the new ``(denom, acc)``. A sink of -inf changes nothing."""
    sinks = sinks.astype(jnp.float32)
    m_new = jnp.maximum(m, sinks)
    alpha = jnp.exp(m - m_new)
    return denom * alpha + jnp.exp(sinks - m_new), acc * alpha[..., None]


def _token_layout(query_start_loc, seq_lens, num_seqs, num_tokens):
    """For each flat token: its request, its absolute position, whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_reqs = seq_lens.shape[0]
    req = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    req = jnp.minimum(req, num_reqs - 1)  # [T]
    valid = t < query_start_loc[num_seqs]  # [T]
    q_len = query_start_loc[req + 1] - query_start_loc[req]
    q_pos = seq_lens[req] - q_len + (t - query_start_loc[req])  # [T]
    return req, jnp.where(valid, q_pos, -1), valid


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [P, S, 2*Hkv, D]
    seq_lens: jax.Array,  # [R] int32
    page_table: jax.Array,  # [R, M] int32
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_chunk: int = 4,
    causal: bool = True,
    attend_until: jax.Array | None = None,
    attention_chunk_size: int | None = None,
    sinks: jax.Array | None = None,
    num_kv_heads: int | None = None,
) -> jax.Array:
    """Attention of each new token over its request's paged KV; returns ``[T, Hq, D]``.

    ``sinks`` ``[Hq]`` (gpt-oss's attention sinks): a learned logit per query head that
    joins each token's softmax denominator and carries no value, so the weights of the
    token's keys sum to less than one; None: no sink (a sink of -inf is the same).
    ``sliding_window`` w keeps keys with ``q_pos - kv_pos < w``; ``attention_chunk_size``
    C (chunked local attention, Llama 4) keeps keys in the token's own chunk,
    ``kv_pos >= (q_pos // C) * C`` (both may apply); ``soft_cap`` c maps
    scores to ``c * tanh(s / c)`` after scaling. ``causal`` False (an encoder): every
    token attends to all ``seq_lens[r]`` keys of its request, as if it were the last.
    ``attend_until`` ``[T]`` (the tokens of an image that attend both ways, Gemma 3
    and 4; the CPU, TPU and GPU kernels take it too): each token's last key position,
    at or after its own (which the step holds); keys up to it are seen, the sliding
    window and the attention chunk still count from the token.
    ``num_kv_heads``: the KV heads in the cache's first rows, where its head axis is
    padded past them (TPU); None: every row, ``2 * num_kv_heads`` of them.
    Accumulates in float32; the output has ``q``'s dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, rows, width = kv_cache.shape
    num_kv_heads = num_kv_heads or rows // 2
    group = num_q_heads // num_kv_heads
    max_pages = page_table.shape[1]
    chunk = min(pages_per_chunk, max_pages)
    pad = (-max_pages) % chunk
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    chunk_len = chunk * page_size

    req, q_pos, valid = _token_layout(query_start_loc, seq_lens, num_seqs, num_tokens)
    if not causal:
        q_pos = jnp.where(valid, seq_lens[req] - 1, -1)
    q_end = q_pos if attend_until is None else jnp.where(valid, attend_until, -1)
    # float32 inputs get float32 dots, as in the kernels (XLA's default is TF32 on GPUs)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = qg * sm_scale
    token_pages = page_table[req]  # [T, M']

    real = jnp.arange(seq_lens.shape[0]) < num_seqs
    longest = jnp.max(jnp.where(real, seq_lens, 0))
    num_chunks = (longest + chunk_len - 1) // chunk_len

    def body(c, carry):
        m, denom, acc = carry  # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
        pages = jax.lax.dynamic_slice_in_dim(token_pages, c * chunk, chunk, axis=1)
        kv = kv_cache[pages].reshape(num_tokens, chunk_len, rows, width)
        kv = kv[:, :, : 2 * num_kv_heads, :head_dim]  # [T, L, 2Hkv, D]: a padded cache's real
        k = kv[:, :, 0::2].astype(jnp.float32)  # [T, L, Hkv, D]
        v = kv[:, :, 1::2].astype(jnp.float32)
        s = jnp.einsum("tkgd,tlkd->tkgl", qg, k, precision=precision)  # [T, Hkv, G, L]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = c * chunk_len + jnp.arange(chunk_len)  # [L]
        mask = kv_pos[None, :] <= q_end[:, None]  # [T, L]
        if sliding_window is not None:
            mask &= q_pos[:, None] - kv_pos[None, :] < sliding_window
        if attention_chunk_size is not None:
            mask &= kv_pos[None, :] >= chunk_start(q_pos, attention_chunk_size)[:, None]
        mask = mask[:, None, None, :]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgl,tlkd->tkgd", p, v, precision=precision)
        return m_new, denom, acc

    shape = (num_tokens, num_kv_heads, group)
    init = (
        jnp.full(shape, _MASKED, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape + (head_dim,), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    if sinks is not None:
        denom, acc = join_sinks(m, denom, acc, sinks.reshape(num_kv_heads, group))
    out = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
