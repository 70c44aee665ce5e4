"""Windowed bidirectional attention over the step's own keys (plain JAX, any backend).

Cost: a step of T tokens does ``T * (block_q + 2 * (max_len - 1))`` scores per head,
independent of how the requests are laid out: no loop over requests, one batched
matmul pair per tile. With short requests (sentences of 10-30 tokens) that is a few
times the work of exact per-request attention and far less than walking requests one
by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def segments(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """``[T]`` int32: 1 + the request of each token; padding tokens (past the last real
    one) get ``R + 1``, one past every real request."""
    return jnp.searchsorted(query_start_loc, jnp.arange(num_tokens), side="right").astype(jnp.int32)


def windowed_attention(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, H, D]
    v: jax.Array,  # [T, H, D]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    max_len: int,
    block_q: int = 32,
) -> jax.Array:
    """Each token attends to every token of its own request (requests are the
    ``query_start_loc`` spans, each at most ``max_len`` long and wholly in this step);
    returns ``[T, H, D]`` in ``q``'s dtype, zeros for padding tokens. Accumulates in
    float32."""
    num_tokens, heads, head_dim = q.shape
    reach = max_len - 1
    pad_t = (-num_tokens) % block_q
    tiles = (num_tokens + pad_t) // block_q
    width = block_q + 2 * reach
    seg = segments(query_start_loc, num_tokens)  # [T]
    real = jnp.arange(num_tokens) < query_start_loc[num_seqs]  # [T]

    def padded(x, value):  # pad `reach` before, `reach + pad_t` after the tokens
        widths = [(reach, reach + pad_t)] + [(0, 0)] * (x.ndim - 1)
        return jnp.pad(x, widths, constant_values=value)

    window = jnp.arange(tiles)[:, None] * block_q + jnp.arange(width)[None, :]  # [N, W]
    kw, vw = padded(k, 0)[window], padded(v, 0)[window]  # [N, W, H, D]
    seg_k = padded(seg, -1)[window]  # [N, W]
    qt = jnp.pad(q, ((0, pad_t), (0, 0), (0, 0))).reshape(tiles, block_q, heads, head_dim)
    seg_q = jnp.pad(seg, (0, pad_t), constant_values=-2).reshape(tiles, block_q)
    f32 = jnp.float32
    scores = jnp.einsum("nqhd,nkhd->nhqk", qt.astype(f32), kw.astype(f32)) * sm_scale
    same = seg_q[:, None, :, None] == seg_k[:, None, None, :]  # [N, 1, Q, W]
    probs = jax.nn.softmax(jnp.where(same, scores, NEG_INF), axis=-1)
    out = jnp.einsum("nhqk,nkhd->nqhd", probs, vw.astype(f32))  # [N, Q, H, D]
    out = out.reshape(tiles * block_q, heads, head_dim)[:num_tokens]
    return jnp.where(real[:, None, None], out, 0.0).astype(q.dtype)


def encoder_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]: this step's keys (already written to the cache)
    v: jax.Array,  # [T, Hkv, D]
    kv_cache: jax.Array,  # [P, S, 2*Hkv, D]
    seq_lens: jax.Array,  # [R]
    page_table: jax.Array,  # [R, M]
    query_start_loc: jax.Array,  # [R + 1]
    num_seqs: jax.Array,  # []
    *,
    sm_scale: float,
    fallback: Callable[..., jax.Array],
    windows: Sequence[int] = (32, 128),
) -> jax.Array:
    """Bidirectional attention of each token over its request, as the paged reference
    with ``causal=False``. Runs `windowed_attention` with the smallest of ``windows``
    covering the step's longest request when every request is wholly in this step
    (``seq_lens == q_len``) and query and key heads match; otherwise ``fallback`` (the
    backend's paged kernel). All branches live in one program (`jax.lax.switch`), so
    the choice compiles nothing new."""
    paged = lambda: fallback(  # noqa: E731
        q, kv_cache, seq_lens, page_table, query_start_loc, num_seqs,
        sm_scale=sm_scale, causal=False,
    )  # fmt: skip
    if q.shape[1] != k.shape[1]:
        return paged()
    local = [
        lambda w=w: windowed_attention(
            q, k, v, query_start_loc, num_seqs, sm_scale=sm_scale, max_len=w
        )
        for w in windows
    ]
    branch = choose_window(seq_lens, query_start_loc, num_seqs, windows)
    return jax.lax.switch(branch, [*local, paged])


def choose_window(
    seq_lens: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, windows: Sequence[int]
) -> jax.Array:
    """``[]`` int32: the index of the smallest of ``windows`` (increasing) covering the
    step's longest request, or ``len(windows)`` (the paged fallback) when a request is
    longer than all of them or has keys from earlier steps (``seq_lens > q_len``)."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    rows = jnp.arange(q_lens.shape[0]) < num_seqs
    whole = jnp.all(jnp.where(rows, seq_lens == q_lens, True))
    branch = jnp.searchsorted(jnp.asarray(windows, jnp.int32), jnp.max(q_lens))
    return jnp.where(whole, branch, len(windows)).astype(jnp.int32)
