"""Ragged paged attention laid out for XLA's CPU backend: request-major, not token-major.

Same signature and semantics as `reference.py` (the definition); it pairs with the
reference KV-cache write (`pallas_kernels.kv_cache_update.reference`), whose XLA scatter
is already in place on CPU.

Why: the reference gathers each *token's* pages and runs one tiny ``[G, D] x [D, L]``
dot per token and KV head. A prefill chunk of n tokens then gathers its request's pages
n times, and XLA's CPU backend runs those small batched dots far below its matmul rate.

Algorithm. Every real request has at least one new token, so the batch splits in two:

- **last tokens**: the last new token of every request, one row per request (for a
  decode batch that is every token). One request-major pass: each chunk of context
  pages is gathered once per request into ``[R, L, 2Hkv, D]`` and met by that
  request's query row; online softmax over chunks, trip count the longest sequence.
- **earlier tokens** of multi-token requests (prefill chunks): cut into tiles of
  ``block_q`` consecutive tokens of one request. A loop over the tiles (dynamic trip
  count, zero for a decode batch) runs the same pass with one request and ``block_q``
  rows: a ``[G * block_q, D] x [D, L]`` dot per KV head, pages gathered once per tile,
  the KV walk bounded by the tile's causal end and its sliding window's start.

Both passes share `_attend`. Shapes are static per bucket (T, R, M); the tile count
and the chunk counts are loop bounds, so one compile serves every batch of a bucket.
Memory is bounded by ``R * kv_chunk`` (last tokens) and ``block_q * kv_chunk`` (tiles)
KV rows, whatever the context length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import chunk_start, join_sinks

_MASKED = -1e30  # finite, so an all-masked chunk gives no NaN


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
    kv_chunk: int = 64,
    block_q: int | None = None,
    causal: bool = True,
    attend_until: jax.Array | None = None,
    attention_chunk_size: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of each new token over its request's paged KV; returns ``[T, Hq, D]``.

    As `reference.ragged_paged_attention` (``sinks`` [Hq]: attention sinks, joining
    each row's denominator after its last chunk; ``causal`` False: bidirectional;
    ``attend_until``: each token's last key, for image tokens that attend both ways;
    ``attention_chunk_size``: chunked local attention, keys of the token's own chunk).
    ``kv_chunk`` (tokens, rounded to whole pages) is the context walked per step;
    ``block_q`` the query rows of a prefill tile (default 128; 32 for ``causal``
    False: an encoder's requests are short, and a tile never spans two of them).
    Accumulates in float32; the output has ``q``'s dtype; padding tokens are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    block_q = block_q or (128 if causal else 32)
    page_size, two_hkv = kv_cache.shape[1], kv_cache.shape[2]
    group = num_q_heads // (two_hkv // 2)
    pages_per_chunk = max(1, min(kv_chunk // page_size, page_table.shape[1]))
    pad = (-page_table.shape[1]) % pages_per_chunk
    page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    qg = q.astype(jnp.float32) * sm_scale
    qg = qg.reshape(num_tokens, two_hkv // 2, group, head_dim)  # [T, Hkv, G, D]
    spec = dict(pages_per_chunk=pages_per_chunk, sliding_window=sliding_window, soft_cap=soft_cap)
    if attention_chunk_size is not None:
        spec["attention_chunk_size"] = attention_chunk_size
    if sinks is not None:
        spec["sinks"] = sinks.reshape(two_hkv // 2, group)  # [Hkv, G]
    out = jnp.zeros((num_tokens + 1,) + qg.shape[1:], jnp.float32)  # row T: dropped writes
    ends = None if attend_until is None else jnp.append(attend_until, -1)  # row T: none
    args = (qg, kv_cache, seq_lens, page_table, query_start_loc, num_seqs, spec)
    out = _last_tokens(out, *args, ends)
    out = _earlier_tokens(out, *args, block_q, causal, ends)
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _last_tokens(out, qg, kv_cache, seq_lens, page_table, qsl, num_seqs, spec, ends=None):
    """One query row per request: its last new token. Writes them into ``out``.
    ``ends`` [T + 1]: each row's last key (`ragged_paged_attention`'s attend_until)."""
    num_tokens = qg.shape[0]
    num_reqs = seq_lens.shape[0]
    real = (jnp.arange(num_reqs) < num_seqs) & (qsl[1:] > qsl[:-1])  # [R]
    rows = jnp.where(real, qsl[1:] - 1, num_tokens)  # [R]; padding -> the spare row
    q_rows = qg[jnp.minimum(rows, num_tokens - 1)][:, None]  # [R, 1, Hkv, G, D]
    q_pos = jnp.where(real, seq_lens - 1, -1)[:, None]  # [R, 1]
    # columns past a request's end read the null page (a cache hit), not cold memory
    col_start = jnp.arange(page_table.shape[1]) * kv_cache.shape[1]  # [M]
    pages = jnp.where(col_start[None, :] < seq_lens[:, None], page_table, 0)
    q_end = None if ends is None else jnp.where(real, ends[rows], -1)[:, None]
    o = _attend(q_rows, q_pos, kv_cache, pages, q_end=q_end, **spec)  # [R, 1, Hkv, G, D]
    return out.at[rows].set(o[:, 0])


def _earlier_tokens(
    out, qg, kv_cache, seq_lens, page_table, qsl, num_seqs, spec, block_q, causal=True, ends=None
):
    """The other new tokens of multi-token requests, in tiles of ``block_q`` rows
    (``causal`` False: each sees its request's every key, as its last token does)."""
    num_tokens = qg.shape[0]
    block_q = max(1, min(block_q, num_tokens))
    num_tiles, tile_req, rows, q_pos = _tiles(seq_lens, qsl, num_seqs, num_tokens, block_q, causal)

    q_end = q_pos if ends is None else jnp.where(q_pos >= 0, ends[rows], -1)

    def tile(i, out):
        q_rows = qg[jnp.minimum(rows[i], num_tokens - 1)][None]  # [1, B, Hkv, G, D]
        pages = page_table[tile_req[i]][None]
        o = _attend(q_rows, q_pos[i][None], kv_cache, pages, q_end=q_end[i][None], **spec)
        return out.at[rows[i]].set(o[0])

    return jax.lax.fori_loop(0, num_tiles, tile, out)


def _tiles(seq_lens, qsl, num_seqs, num_tokens, block_q, causal):
    """The query tiles of the earlier tokens, as a table the tile loop only indexes:
    (tile count, request of each tile [N], its rows in ``out`` [N, B] (``num_tokens``:
    none), their positions [N, B] (-1: none)). ``N`` is the static bound on the count.

    Computed from the batch metadata alone, so every layer's copy is the same
    expression and XLA computes it once per step, outside the layers' loops.
    """
    num_reqs = seq_lens.shape[0]
    real = jnp.arange(num_reqs) < num_seqs
    q_len = qsl[1:] - qsl[:-1]
    earlier = jnp.where(real, jnp.maximum(q_len - 1, 0), 0)  # [R]
    tiles_end = jnp.cumsum((earlier + block_q - 1) // block_q)  # [R]
    ids = jnp.arange(-(-num_tokens // block_q) + num_reqs)  # [N] (a tile may be partial)
    req = jnp.sum(tiles_end[None, :] <= ids[:, None], axis=1)  # searchsorted, no loop
    req = jnp.minimum(req, num_reqs - 1).astype(jnp.int32)
    first_tile = tiles_end[req] - (earlier[req] + block_q - 1) // block_q
    local = (ids - first_tile)[:, None] * block_q + jnp.arange(block_q)  # [N, B]
    ok = local < earlier[req][:, None]
    rows = jnp.where(ok, qsl[req][:, None] + local, num_tokens)
    end = seq_lens[req][:, None]
    pos = end - q_len[req][:, None] + local if causal else end - 1 + 0 * local
    return tiles_end[-1], req, rows, jnp.where(ok, pos, -1)


def _attend(
    q,
    q_pos,
    kv_cache,
    pages,
    *,
    pages_per_chunk,
    sliding_window,
    soft_cap,
    q_end=None,
    attention_chunk_size=None,
    sinks=None,
):
    """Rows ``q`` [N, B, Hkv, G, D] (scaled, float32) at positions ``q_pos`` [N, B]
    (-1: padding) over the KV of page rows ``pages`` [N, M]; returns [N, B, Hkv, G, D].
    ``q_end`` [N, B]: each row's last key (default its position). ``sinks`` [Hkv, G]:
    attention sinks (`reference.join_sinks`), or None.

    Walks context chunks from the earliest any row can see (its sliding window, its
    attention chunk's start) to the last (the causal end); each chunk's pages are
    gathered once per page row.
    """
    n, b, num_kv_heads, group, head_dim = q.shape
    chunk_len = pages_per_chunk * kv_cache.shape[1]
    valid = q_pos >= 0
    q_end = q_pos if q_end is None else q_end
    last = jnp.max(q_end)
    stop = (last + chunk_len) // chunk_len  # 0 when every row is padding
    start = 0
    first_key = _first_keys(q_pos, sliding_window, attention_chunk_size)  # [N, B] or None
    if first_key is not None:
        earliest = jnp.min(jnp.where(valid, first_key, jnp.maximum(last, 0)))
        start = jnp.minimum(earliest // chunk_len, stop)
    qt = q.transpose(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group * b, head_dim)

    heads = 2 * jnp.arange(num_kv_heads)[None, :, None]  # K of head h at 2h, V at 2h + 1
    cache = _gatherable(kv_cache)

    def body(c, carry):
        m, denom, acc = carry  # [N, Hkv, G*B], same, [N, Hkv, G*B, D]
        cols = jax.lax.dynamic_slice_in_dim(pages, c * pages_per_chunk, pages_per_chunk, 1)
        # head-major gathers: [N, Hkv, L, D] is the dots' layout, so nothing is transposed
        k = _read(cache[cols[:, None, :], :, heads, :], kv_cache.dtype)
        v = _read(cache[cols[:, None, :], :, heads + 1, :], kv_cache.dtype)
        k = k.reshape(n, num_kv_heads, chunk_len, head_dim)
        v = v.reshape(n, num_kv_heads, chunk_len, head_dim)
        s = jnp.einsum("nkqd,nkld->nkql", qt, k)  # [N, Hkv, G*B, L]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = c * chunk_len + jnp.arange(chunk_len)  # [L]
        mask = kv_pos[None, None, :] <= q_end[:, :, None]  # [N, B, L]
        if sliding_window is not None:
            mask &= q_pos[:, :, None] - kv_pos[None, None, :] < sliding_window
        if attention_chunk_size is not None:
            mask &= kv_pos[None, None, :] >= chunk_start(q_pos, attention_chunk_size)[..., None]
        mask = jnp.broadcast_to(mask[:, None, None], (n, 1, group, b, chunk_len))
        mask = mask.reshape(n, 1, group * b, chunk_len)
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("nkql,nkld->nkqd", p, v)
        return m_new, denom, acc

    shape = (n, num_kv_heads, group * b)
    init = (
        jnp.full(shape, _MASKED, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape + (head_dim,), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(start, stop, body, init)
    if sinks is not None:  # rows are (g, b), g-major: each query head's sink b times
        denom, acc = join_sinks(m, denom, acc, jnp.repeat(sinks, b, axis=1))
    out = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)
    out = out.reshape(n, num_kv_heads, group, b, head_dim).transpose(0, 3, 1, 2, 4)
    return jnp.where(valid[..., None, None, None], out, 0.0)


def _first_keys(q_pos, sliding_window, attention_chunk_size):
    """Each row's first visible key (>= 0) under its sliding window and attention
    chunk, or None when neither limits it."""
    first = None
    if sliding_window is not None:
        first = jnp.maximum(q_pos - sliding_window + 1, 0)
    if attention_chunk_size is not None:
        start = chunk_start(q_pos, attention_chunk_size)
        first = start if first is None else jnp.maximum(first, start)
    return first


def _gatherable(kv_cache: jax.Array) -> jax.Array:
    """The cache as XLA's CPU backend gathers it well: 16- and 8-bit floats as uints.

    XLA:CPU gathers bfloat16 by converting the whole operand to float32 first, a pass
    over the entire cache on every call; a same-width bitcast costs nothing.
    """
    unsigned = {2: jnp.uint16, 1: jnp.uint8}.get(kv_cache.dtype.itemsize)
    if unsigned is not None:
        return jax.lax.bitcast_convert_type(kv_cache, unsigned)
    return kv_cache


def _read(kv: jax.Array, dtype) -> jax.Array:
    """Gathered cache rows (see `_gatherable`) as float32."""
    if kv.dtype != dtype:
        kv = jax.lax.bitcast_convert_type(kv, dtype)
    return kv.astype(jnp.float32)
