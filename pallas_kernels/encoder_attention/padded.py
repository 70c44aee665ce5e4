"""Bidirectional attention over the step's own keys, each request padded to ``max_len``
(plain JAX, any backend).

Layout: heads first, ``[H, R, L, D]``, so both products are ``H * R`` small dense
matmuls with contiguous operands (XLA:CPU runs this layout about twice as fast as
``[R, L, H, D]``). Cost: ``H * R * L * L`` scores, whatever the requests' lengths, so
it pays off for short requests only (sentences); `encoder_attention` sends steps with
a longer request to the paged kernel. Measured on the 2-core CPU, 128 requests of
8-23 tokens (12 heads of 32): 4.7 ms per layer with ``max_len`` 32, against 15 ms for
the paged CPU kernel; at ``max_len`` 64 the padded form already costs 38 ms.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

NEG_INF = -1e30
PADDED_MAX_LEN = 32
"""The longest request the padded form takes (longer ones: the paged kernel)."""


def padded_attention(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, H, D]
    v: jax.Array,  # [T, H, D]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    max_len: int = PADDED_MAX_LEN,
    compute_dtype: jax.typing.DTypeLike = jnp.float32,
) -> jax.Array:
    """Each token attends to every token of its own request (the ``query_start_loc``
    spans, each at most ``max_len`` long and wholly in this step); returns
    ``[T, H, D]`` in ``q``'s dtype, zeros for padding tokens. Both products take
    their inputs in ``compute_dtype`` (bfloat16 halves the gathers' bytes and runs
    XLA:CPU's fast bfloat16 dots) and accumulate in float32, as does the softmax."""
    num_tokens = q.shape[0]
    rows = query_start_loc.shape[0] - 1
    lens = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    valid = jnp.arange(max_len)[None, :] < lens[:, None]  # [R, L]
    f32 = jnp.float32
    index = jnp.where(valid, query_start_loc[:-1, None] + jnp.arange(max_len)[None, :], 0)
    qp, kp, vp = (x.astype(compute_dtype).transpose(1, 0, 2)[:, index] for x in (q, k, v))
    scores = jnp.einsum("hrqd,hrkd->hrqk", qp, kp, preferred_element_type=f32)  # [H,R,L,L]
    scores = jnp.where(valid[None, :, None, :], scores * sm_scale, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(compute_dtype)
    out = jnp.einsum("hrqk,hrkd->hrqd", probs, vp, preferred_element_type=f32)  # [H,R,L,D]
    tokens = jnp.arange(num_tokens)
    row = jnp.clip(jnp.searchsorted(query_start_loc, tokens, side="right") - 1, 0, rows - 1)
    local = jnp.clip(tokens - query_start_loc[row], 0, max_len - 1)  # [T]
    out = out[:, row, local].transpose(1, 0, 2)  # [T, H, D]
    real = tokens < query_start_loc[num_seqs]
    return jnp.where(real[:, None, None], out, 0.0).astype(q.dtype)


def encoder_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]: this step's keys
    v: jax.Array,  # [T, Hkv, D]
    cache_like: jax.Array,  # [P, S, 2*Hkv, D]: the layer's cache (its page shape only)
    page_table: jax.Array,  # [R, M]: M pages hold the longest request
    query_start_loc: jax.Array,  # [R + 1]
    num_seqs: jax.Array,  # []
    *,
    sm_scale: float,
    fallback: Callable[..., jax.Array],
    update: Callable[[jax.Array, jax.Array], jax.Array],
    max_len: int = PADDED_MAX_LEN,
    compute_dtype: jax.typing.DTypeLike = jnp.float32,
) -> jax.Array:
    """Bidirectional attention of each token over its request, as the paged reference
    with ``causal=False``, for a step whose requests are all whole (an encoder's: run
    in one step, no cached prefix). `padded_attention` when every request is at most
    ``max_len`` long and query and key heads match; otherwise ``fallback`` (the
    backend's paged kernel) over `step_cache`, a cache of this step's keys only,
    written by ``update(cache, slot_mapping)``. The engine's cache is never read or
    written: an encoder's keys are not used after their step, and a cache operand of
    the `jax.lax.cond` that holds both branches made XLA:CPU copy it (about 10% of a
    step). Both branches live in one program, so the choice compiles nothing new."""

    def paged() -> jax.Array:
        cache, table, lens = step_cache(
            k, v, query_start_loc, num_seqs, cache_like, page_table.shape[1], update
        )
        return fallback(
            q, cache, lens, table, query_start_loc, num_seqs, sm_scale=sm_scale, causal=False
        )

    if q.shape[1] != k.shape[1]:
        return paged()
    short = jnp.max(query_start_loc[1:] - query_start_loc[:-1]) <= max_len
    padded = lambda: padded_attention(  # noqa: E731
        q, k, v, query_start_loc, num_seqs, sm_scale=sm_scale, max_len=max_len,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    return jax.lax.cond(short, padded, paged)


def step_cache(k, v, query_start_loc, num_seqs, cache_like, pages_per_req: int, update):
    """(cache, page_table ``[R, pages_per_req]``, seq_lens ``[R]``) holding this step's
    k/v only: request ``r``'s tokens fill pages ``base[r]..`` of a fresh cache with
    ``cache_like``'s page shape and dtype, enough pages for any packing of the step
    (``T // S + R + 1``; the last one is spare: padding tokens write there and
    unused table entries point there)."""
    num_tokens, rows = k.shape[0], query_start_loc.shape[0] - 1
    size = cache_like.shape[1]
    real_rows = jnp.arange(rows) < num_seqs
    lens = jnp.where(real_rows, query_start_loc[1:] - query_start_loc[:-1], 0)  # [R]
    pages = (lens + size - 1) // size
    base = jnp.cumsum(pages) - pages  # [R]: each request's first page
    num_pages = num_tokens // size + rows + 1
    used = jnp.arange(pages_per_req)[None, :] < pages[:, None]
    table = jnp.where(used, base[:, None] + jnp.arange(pages_per_req)[None, :], num_pages - 1)
    tokens = jnp.arange(num_tokens)
    row = jnp.clip(jnp.searchsorted(query_start_loc, tokens, side="right") - 1, 0, rows - 1)
    pos = tokens - query_start_loc[row]
    real = tokens < query_start_loc[num_seqs]
    spare = (num_pages - 1) * size + tokens % size  # padding tokens: the spare page
    slots = jnp.where(real, (base[row] + pos // size) * size + pos % size, spare)
    cache = update(jnp.zeros((num_pages, *cache_like.shape[1:]), cache_like.dtype), slots)
    return cache, table.astype(jnp.int32), lens
