"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Same signature and semantics as `reference.ragged_paged_attention`; see there for the
layout and padding rules.

Work split. The flat token axis is cut into q blocks of ``block_q`` tokens (aligned,
so the BlockSpecs stay plain) and the KV heads into groups of ``heads_per_block``; the
grid is ``(head groups, q blocks)``. A q block may hold the tail of one request, some
whole decodes and the head of a prefill chunk: the kernel walks the requests that
overlap it (their range comes in by scalar prefetch, computed in the wrapper with one
`searchsorted`), and for each one walks the pages its rows can see in blocks of
``pages_per_block`` pages. Each page block is copied HBM -> VMEM with one DMA per page
into one of two buffers, so block ``b + 1`` is in flight while block ``b`` is
computed. Scores of all ``G * block_q`` query rows of a KV head are one MXU matmul;
rows outside the current request (or past the causal / window bounds) are masked and
leave the online-softmax state (float32 scratch, kept across requests and page blocks)
untouched. The output tile is written once per grid step; rows no request owns (the
padding tokens) come out as zeros.

Layout. Queries travel as ``[Hkv, G, T, D]`` (one transpose in the wrapper), so each
KV head's ``G`` query heads form a ``[G * block_q, D]`` tile with the token axis on
sublanes. The cache keeps the engine's ``[P, S, 2 * Hkv, D]`` layout in HBM; a page
copy moves ``[S, 2 * heads_per_block, D]``, or the page's every row where the block
holds every head (its padding too: a TPU cache's head axis is padded to a multiple of
8 rows, `jaxengine.models.layers.attention.kv_cache_shape`, and only the first ``2 *
num_kv_heads`` rows are read). A row padded past the head's ``D`` values (a 64-value
head in 128 lanes) gets ``q`` padded with zeros to its width, which leaves the scores
unchanged, and the output's extra lanes (zeros, from V's padding) are dropped.
Attention sinks (optional, gpt-oss) come in as one more VMEM block ``[heads_per_block,
G, 128]`` (each query head's sink on every lane) and join the denominators once, when
the output tile is written. ``attend_until`` (optional, an image's tokens that attend
both ways: Gemma 3 and 4) comes in twice: as a VMEM block ``[block_q, 128]`` beside q's
(each token's last key on every lane), which bounds each score row's keys in place of
its position, and as one more scalar prefetch, each token's largest ``attend_until``
over its request's tokens in its q block (`_reach`), which extends that request's page
loop to the image's last key. Without it the kernel is the plain causal program.

Block sizes (`choose_blocks`), from the shapes, overridable by keyword:

==================  ===========================================================
``block_q``         8 x the dtype's sublane packing (8 f32, 16 bf16) when the
                    batch has at most two tokens per request (decode-like), else
                    64 (prefill chunks: fewer re-reads of each request's pages)
``pages_per_block`` enough pages for 256 KV positions, at most a page-table row
``heads_per_block`` every KV head, halved while the VMEM estimate exceeds
                    ``vmem_limit_bytes`` (default 16 MiB, the scoped VMEM of v5e)
                    and the half still moves a multiple of 8 cache rows
(then)              ``block_q`` halved down to the sublane packing, then
                    ``pages_per_block`` down to one page, while it still exceeds
==================  ===========================================================

Nothing here calls `pltpu.get_tpu_info()`: the limits come in as arguments, so the
kernel runs under TPU interpret mode on CPU (``interpret=True``), which simulates the
DMAs and semaphores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.cost import attention_cost

_MASKED = -1e30  # finite: an all-masked row gives exp(0) * 0, never NaN
DEFAULT_VMEM_LIMIT = 16 * 1024 * 1024
KV_POSITIONS_PER_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class Blocks:
    block_q: int
    pages_per_block: int
    heads_per_block: int


_HEAD_ROWS_ALIGN = 8
"""A block of fewer heads than the cache holds starts at a traced row offset of the
cache's head axis, which Mosaic needs tile-aligned: its 2 * heads_per_block rows a
multiple of 8."""


def _sublanes(dtype) -> int:
    return 8 * max(1, 4 // np.dtype(dtype).itemsize)


def vmem_bytes(
    blocks: Blocks, group: int, page_size: int, head_dim: int, dtype, kv_rows: int | None = None
) -> int:
    """VMEM one grid step needs: two KV buffers (``kv_rows`` rows a slot, default ``2 *
    heads_per_block``), double-buffered q and out, state."""
    item = np.dtype(dtype).itemsize
    hb, bq = blocks.heads_per_block, blocks.block_q
    head_dim = -(-head_dim // 128) * 128  # VMEM tiles pad the lane axis to 128
    kv = 2 * blocks.pages_per_block * page_size * (kv_rows or 2 * hb) * head_dim * item
    q_out = 2 * 2 * hb * group * bq * head_dim * item
    state = hb * group * bq * (head_dim + 2 * 128) * 4
    return kv + q_out + state


def choose_blocks(
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    group: int,
    page_size: int,
    max_pages: int,
    head_dim: int,
    dtype,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
    cache_rows: int | None = None,
) -> Blocks:
    """The documented block table (module docstring); ``cache_rows``: the cache's head
    axis where padded past ``2 * num_kv_heads`` (a block of every head copies it all)."""
    sub = _sublanes(dtype)
    block_q = sub if num_tokens <= 2 * num_reqs else max(64, sub)
    pages = max(1, min(max_pages, KV_POSITIONS_PER_BLOCK // page_size))
    blocks = Blocks(block_q, pages, num_kv_heads)

    def fits(b: Blocks) -> bool:
        rows = _buffer_rows(b.heads_per_block, num_kv_heads, cache_rows or 2 * num_kv_heads)
        return vmem_bytes(b, group, page_size, head_dim, dtype, rows) <= vmem_limit_bytes

    while not fits(blocks) and blocks.heads_per_block % _HEAD_ROWS_ALIGN == 0:
        blocks = dataclasses.replace(blocks, heads_per_block=blocks.heads_per_block // 2)
    while not fits(blocks) and blocks.block_q > sub:
        blocks = dataclasses.replace(blocks, block_q=blocks.block_q // 2)
    while not fits(blocks) and blocks.pages_per_block > 1:
        blocks = dataclasses.replace(blocks, pages_per_block=blocks.pages_per_block // 2)
    return blocks


def _buffer_rows(heads_per_block: int, num_kv_heads: int, cache_rows: int) -> int:
    """Rows of a page in the VMEM buffer: the cache's every row (padding included) for
    a block of every head, else the block's K and V rows."""
    return cache_rows if heads_per_block == num_kv_heads else 2 * heads_per_block


def _request_ranges(query_start_loc, num_seqs, num_blocks: int, block_q: int):
    """For each q block: the first and last request with tokens in it (last < first: none)."""
    real_end = query_start_loc[num_seqs]
    ends = query_start_loc[1:]
    start = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    last_tok = jnp.minimum(start + block_q, real_end) - 1
    first = jnp.searchsorted(ends, start, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, last_tok, side="right").astype(jnp.int32)
    last = jnp.where(start < real_end, last, first - 1)
    return first, last


def _kernel(
    # scalar prefetch (SMEM)
    seq_lens_ref,  # [R]
    page_table_ref,  # [R * M]
    qsl_ref,  # [R + 1]
    first_ref,  # [NB]
    last_ref,  # [NB]
    # inputs
    q_ref,  # [hb, G, bq, D] VMEM
    kv_hbm,  # [P, S, 2Hkv, D] HBM
    # output
    o_ref,  # [hb, G, bq, D] VMEM
    # scratch
    kv_buf,  # [2, ppb, S, 2hb, D] VMEM
    sems,  # DMA semaphores [2]
    m_sc,  # [hb, G*bq, 128] f32
    l_sc,  # [hb, G*bq, 128] f32
    acc_sc,  # [hb, G*bq, D] f32
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    max_pages: int,
    attention_chunk_size: int | None = None,
    sinks_ref=None,  # [hb, G, 128] f32 VMEM, lanes equal: the sinks (`_kernel_entry`)
    reach_ref=None,  # [T] SMEM: a token's (q block, request) run's last key (`_reach`)
    ends_ref=None,  # [bq, 128] int32 VMEM, lanes equal: each token's attend_until
):
    hb, group, bq, head_dim = q_ref.shape
    _, ppb, page_size, _, _ = kv_buf.shape
    rows = group * bq
    block_kv = ppb * page_size
    h_blk, q_blk = pl.program_id(0), pl.program_id(1)
    h0 = h_blk * hb
    blk_start = q_blk * bq

    m_sc[...] = jnp.full(m_sc.shape, _MASKED, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    # token offset of each score row inside the block: rows are (g, t) flattened
    row_tok = blk_start + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) % bq
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
    v_row = jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
    if ends_ref is not None:  # each score row's last key: its token's attend_until
        ends = jnp.broadcast_to(ends_ref[...][None], (group, bq, 128))
        row_end = ends.reshape(rows, 128)[:, :1]  # [rows, 1]

    # one block of every head: the whole axis, padding included (a slice at a traced
    # offset must be provably tile-aligned, which 2 * hb rows are not for odd counts)
    whole = kv_buf.shape[3] == kv_hbm.shape[2]
    heads = pl.ds(pl.multiple_of(2 * h0, 2 * hb), 2 * hb)

    def page_copies(req, first_page, b, slot):
        copies = []
        for p in range(ppb):
            idx = jnp.minimum(first_page + b * ppb + p, max_pages - 1)
            page = page_table_ref[req * max_pages + idx]
            src = kv_hbm.at[page] if whole else kv_hbm.at[page, :, heads, :]
            copies.append(pltpu.make_async_copy(src, kv_buf.at[slot, p], sems.at[slot]))
        return copies

    def one_request(req, carry):
        q_start, q_end = qsl_ref[req], qsl_ref[req + 1]
        seq_len = seq_lens_ref[req]
        ctx = seq_len - (q_end - q_start)  # position of the request's first new token
        t_first = jnp.maximum(q_start, blk_start)
        t_last = jnp.minimum(q_end, blk_start + bq) - 1
        kv_hi = ctx + (t_last - q_start) + 1  # keys [kv_lo, kv_hi) are visible to some row
        if reach_ref is not None:  # an image's later keys, written by this step
            kv_hi = jnp.maximum(kv_hi, reach_ref[t_last] + 1)
        kv_lo = 0
        if sliding_window is not None:
            kv_lo = jnp.maximum(ctx + (t_first - q_start) - sliding_window + 1, 0)
        if attention_chunk_size is not None:  # the first row's chunk starts earliest
            kv_lo = jnp.maximum(
                kv_lo, _chunk_start(ctx + (t_first - q_start), attention_chunk_size)
            )
        first_page = jax.lax.div(kv_lo, page_size)  # kv_lo >= 0: no floor fix-up
        num_pages = pl.cdiv(kv_hi, page_size) - first_page
        num_kv_blocks = pl.cdiv(num_pages, ppb)

        in_req = (row_tok >= q_start) & (row_tok < q_end)
        q_pos = ctx + row_tok - q_start
        if attention_chunk_size is not None:  # rows outside the request: masked anyway
            chunk_lo = _chunk_start(jnp.maximum(q_pos, 0), attention_chunk_size)

        for copy in page_copies(req, first_page, 0, 0):
            copy.start()

        def kv_block(b, carry):
            slot = jax.lax.rem(b, 2)

            @pl.when(b + 1 < num_kv_blocks)
            def _prefetch():
                for copy in page_copies(req, first_page, b + 1, 1 - slot):
                    copy.start()

            for copy in page_copies(req, first_page, b, slot):
                copy.wait()

            kv_pos = (first_page + b * ppb) * page_size + col
            mask = in_req & (kv_pos <= (q_pos if ends_ref is None else row_end))
            # slots past the request's keys may hold anything (NaN included): 0 * NaN
            # in the PV product would leak, so those rows of V are zeroed
            v_ok = (first_page + b * ppb) * page_size + v_row < kv_hi
            if sliding_window is not None:
                mask &= q_pos - kv_pos < sliding_window
            if attention_chunk_size is not None:
                mask &= kv_pos >= chunk_lo
            for h in range(hb):
                _online_softmax_step(
                    q_ref[h].reshape(rows, head_dim),
                    kv_buf[slot, :, :, 2 * h, :].reshape(block_kv, head_dim),
                    jnp.where(
                        v_ok, kv_buf[slot, :, :, 2 * h + 1, :].reshape(block_kv, head_dim), 0
                    ),
                    mask,
                    m_sc.at[h],
                    l_sc.at[h],
                    acc_sc.at[h],
                    sm_scale=sm_scale,
                    soft_cap=soft_cap,
                )
            return carry

        return jax.lax.fori_loop(0, num_kv_blocks, kv_block, carry)

    jax.lax.fori_loop(first_ref[q_blk], last_ref[q_blk] + 1, one_request, 0)

    if sinks_ref is not None:
        _finish_with_sinks(m_sc, l_sc, acc_sc, sinks_ref, o_ref)
        return
    for h in range(hb):
        denom = l_sc[h][:, :1]
        out = jnp.where(denom > 0, acc_sc[h] / jnp.where(denom > 0, denom, 1.0), 0.0)
        o_ref[h] = out.reshape(group, bq, head_dim).astype(o_ref.dtype)


def _finish_with_sinks(m_sc, l_sc, acc_sc, sinks_ref, o_ref):
    """The output tile when attention sinks join each row's denominator
    (`reference.join_sinks`): per KV head and query head ``g``, the score rows
    ``g * bq ...`` share one sink (``sinks_ref[h, g]``, lanes equal)."""
    hb, group, bq, _ = o_ref.shape
    for h in range(hb):
        for g in range(group):
            rows = pl.ds(g * bq, bq)
            m_prev, denom = m_sc[h, rows, :][:, :1], l_sc[h, rows, :][:, :1]  # [bq, 1]
            sink = sinks_ref[h, pl.ds(g, 1), :][:, :1]  # [1, 1]
            m_next = jnp.maximum(m_prev, sink)
            alpha = jnp.exp(m_prev - m_next)
            denom = denom * alpha + jnp.exp(sink - m_next)
            safe = jnp.where(denom > 0, denom, 1.0)  # 0 only for a sink of -inf and no key
            out = jnp.where(denom > 0, acc_sc[h, rows, :] * alpha / safe, 0.0)
            o_ref[h, g] = out.astype(o_ref.dtype)


def _kernel_entry(*refs, both_ways: bool, with_sinks: bool, **kwargs):
    """`_kernel` with the optional operands: ``both_ways`` adds one scalar prefetch
    after ``last`` (``reach``) and one input after the cache (``ends``), ``with_sinks``
    one input after those (the sinks' VMEM block)."""
    num_prefetch, num_inputs = 5 + both_ways, 2 + both_ways + with_sinks
    prefetch, refs = refs[:num_prefetch], refs[num_prefetch:]
    (q_ref, kv_hbm, *optional), (o_ref, *scratch) = refs[:num_inputs], refs[num_inputs:]
    ends_ref = optional.pop(0) if both_ways else None
    sinks_ref = optional.pop(0) if with_sinks else None
    reach_ref = prefetch[5] if both_ways else None
    _kernel(*prefetch[:5], q_ref, kv_hbm, o_ref, *scratch, sinks_ref=sinks_ref,
            reach_ref=reach_ref, ends_ref=ends_ref, **kwargs)  # fmt: skip


def _reach(attend_until, query_start_loc, num_seqs, block_q: int):
    """``[T]``: for each token, the largest ``attend_until`` of its run (the tokens of
    its request inside its q block; a run's tokens are contiguous), so the kernel reads
    a request's KV bound for a q block at any of its tokens (its last). Padding tokens
    count as -1: they never raise a real run's bound."""
    num_tokens = attend_until.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    attend_until = jnp.where(t < query_start_loc[num_seqs], attend_until, -1)
    req = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    req = jnp.minimum(req, query_start_loc.shape[0] - 2)
    starts = (t % block_q == 0) | (t == query_start_loc[req])
    run = jnp.cumsum(starts.astype(jnp.int32)) - 1  # [T]: run ids, from 0
    most = jax.ops.segment_max(attend_until, run, num_segments=num_tokens)
    return most[run]


def _chunk_start(pos, chunk_size: int):
    """``(pos // C) * C`` for ``pos >= 0`` (scalar or vector), as
    `reference.chunk_start`."""
    return pos - jax.lax.rem(pos, jnp.asarray(chunk_size, pos.dtype))


def _online_softmax_step(q, k, v, mask, m_ref, l_ref, acc_ref, *, sm_scale, soft_cap):
    """Folds one block of keys into the running max, denominator and accumulator. An
    8-bit float cache is widened to ``q``'s dtype here, in VMEM."""
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, _MASKED)
    m_prev = m_ref[...]  # [rows, 128], lanes equal
    m_cur = jnp.max(s, axis=1, keepdims=True)
    m_next = jnp.maximum(m_prev, m_cur)  # [rows, 128]
    p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_next
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    acc_ref[...] = alpha[:, :1] * acc_ref[...] + pv


_STATIC = ("sm_scale", "sliding_window", "soft_cap", "attention_chunk_size", "block_q",
           "pages_per_block", "heads_per_block", "vmem_limit_bytes", "interpret",
           "num_kv_heads")  # fmt: skip


@functools.partial(jax.jit, static_argnames=_STATIC)
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
    block_q: int | None = None,
    pages_per_block: int | None = None,
    heads_per_block: int | None = None,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
    interpret: bool = False,
    causal: bool = True,
    attention_chunk_size: int | None = None,
    sinks: jax.Array | None = None,
    num_kv_heads: int | None = None,
    attend_until: jax.Array | None = None,
) -> jax.Array:
    """Attention of each new token over its request's paged KV; returns ``[T, Hq, D]``.
    ``attention_chunk_size``: chunked local attention; ``sinks`` [Hq]: attention sinks,
    joining each row's denominator at the end; ``num_kv_heads``: the heads in a padded
    cache's first rows; ``attend_until`` [T]: each token's last key, at or after its
    own and before its request's ``seq_lens`` (an image's tokens that attend both
    ways, Gemma 3 and 4), the window still counting from the token
    (`reference.ragged_paged_attention`). None compiles the plain causal program."""
    if not causal:  # an encoder's bidirectional attention: the reference runs it
        return reference.ragged_paged_attention(
            q, kv_cache, seq_lens, page_table, query_start_loc, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, causal=False,
            sinks=sinks, num_kv_heads=num_kv_heads, attend_until=attend_until,
        )  # fmt: skip
    num_tokens, num_q_heads, real_dim = q.shape
    _, page_size, cache_rows, head_dim = kv_cache.shape  # head_dim: the row, padded or not
    num_kv_heads = num_kv_heads or cache_rows // 2
    group = num_q_heads // num_kv_heads
    num_reqs, max_pages = page_table.shape
    auto = choose_blocks(num_tokens, num_reqs, num_kv_heads, group, page_size, max_pages,
                         head_dim, q.dtype, vmem_limit_bytes, cache_rows)  # fmt: skip
    blocks = Blocks(block_q or auto.block_q, pages_per_block or auto.pages_per_block,
                    heads_per_block or auto.heads_per_block)  # fmt: skip
    bq, hb = blocks.block_q, blocks.heads_per_block
    if num_kv_heads % hb:
        raise ValueError(f"heads_per_block {hb} does not divide {num_kv_heads} KV heads")
    num_blocks = pl.cdiv(num_tokens, bq)
    padded = num_blocks * bq
    buffer_rows = _buffer_rows(hb, num_kv_heads, cache_rows)

    q4 = q.reshape(num_tokens, num_kv_heads, group, real_dim).transpose(1, 2, 0, 3)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, padded - num_tokens), (0, head_dim - real_dim)))
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    first, last = _request_ranges(query_start_loc, num_seqs, num_blocks, bq)

    q_spec = pl.BlockSpec((hb, group, bq, head_dim), lambda h, i, *_: (h, 0, i, 0))
    rows = group * bq
    kernel = functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, max_pages=max_pages,
                               attention_chunk_size=attention_chunk_size)  # fmt: skip
    in_specs = [q_spec, pl.BlockSpec(memory_space=pl.ANY)]
    prefetch, extra = (), ()
    if attend_until is not None:  # per token, beside q's blocks; runs' bounds in SMEM
        ends = attend_until.astype(jnp.int32)
        prefetch = (_reach(ends, query_start_loc.astype(jnp.int32), num_seqs, bq),)
        ends = jnp.pad(ends, (0, padded - num_tokens), constant_values=-1)
        extra = (jnp.broadcast_to(ends[:, None], (padded, 128)),)  # [T', 128]
        in_specs.append(pl.BlockSpec((bq, 128), lambda h, i, *_: (i, 0)))
    if sinks is not None:  # [Hkv, G, 128]: query head (h, g)'s sink on every lane
        per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)
        extra += (jnp.broadcast_to(per_head, (num_kv_heads, group, 128)),)
        in_specs.append(pl.BlockSpec((hb, group, 128), lambda h, i, *_: (h, 0, 0)))
    if extra:
        optional = dict(both_ways=attend_until is not None, with_sinks=sinks is not None)
        kernel = functools.partial(_kernel_entry, **optional, **kernel.keywords)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5 + len(prefetch),
            grid=(num_kv_heads // hb, num_blocks),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM(
                    (2, blocks.pages_per_block, page_size, buffer_rows, head_dim),
                    kv_cache.dtype,
                ),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((hb, rows, 128), jnp.float32),
                pltpu.VMEM((hb, rows, 128), jnp.float32),
                pltpu.VMEM((hb, rows, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        cost_estimate=attention_cost(
            (num_tokens, num_q_heads, head_dim), kv_cache.shape, page_table.shape, q.dtype
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(
        seq_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        query_start_loc.astype(jnp.int32),
        first,
        last,
        *prefetch,
        q4,
        kv_cache,
        *extra,
    )
    return out[:, :, :num_tokens, :real_dim].transpose(2, 0, 1, 3).reshape(q.shape)
