"""Ragged paged attention as a Pallas GPU kernel (Triton lowering).

Same signature and semantics as `reference.ragged_paged_attention`; see there for the
layout and padding rules.

Why the Triton lowering and not Mosaic GPU. Every key is fetched through the page
table, position by position: ``page_table[r, n // S] * S + n % S`` names a row of the
cache, and a block of keys is a gather of rows scattered over the cache. Triton
expresses that directly (a tensor of pointers and a masked load; Pallas lowers an
integer-array index on a ref to exactly that), and the lowering runs on any CUDA GPU,
the H100 included, at this jax version. Mosaic GPU wants static, TMA-friendly tiles
and Hopper-specific code (warpgroups, barriers) for its speed; a per-token gather is
what it does not do well, and pages of 8 or 16 tokens are too small for one TMA copy
each to pay off.

Work split. A program owns one q block of one KV head: ``block_q = block_m // G``
consecutive tokens of ONE request times the ``G`` query heads that share the KV head,
stacked into ``block_m`` score rows (row ``m`` is token ``start + m // G``, query head
``h * G + m % G``). One request never shares a block with another, so every row of a
block sees the same keys, and a decode (one token) fills ``G`` rows.

Program -> request without host work. Request ``r`` owns the block slots
``[qsl[r] // block_q + r, qsl[r + 1] // block_q + r + 1)``: enough for its tokens
however they fall, and the slot ranges of consecutive requests tile ``[0, T // block_q
+ R)``, the grid's static first axis. A program loads ``query_start_loc`` (R + 1
values), finds its request as the last one whose first slot is not past its own, and
its first token; a slot past its request's tokens (or of a padding request) runs a
KV loop of zero trips and stores nothing. Padding tokens belong to no slot: the output
starts as zeros (an aliased buffer) so they come out as exact zeros.

KV loop. Keys ``[lo, hi)`` are visible to some row of the block: ``hi`` is one past the
last token's position (with ``attend_until``, an image's tokens that attend both ways:
one past the block's rows' largest, and each row's keys end at its own), ``lo`` the
first token's window start (0 without a window), rounded down to ``block_n``. Each
step gathers ``block_n`` positions' page ids, then their K rows (cache row ``2h``) and
V rows (``2h + 1``) from the cache viewed as ``[P * S * 2 * Hkv, D]`` (a free
reshape), with masked loads. Scores ``[block_m,
block_n]`` come from one ``dot`` with float32 accumulation (IEEE for float32 inputs,
so results match the reference to 1e-5; tensor cores in bf16); then scale, soft cap,
masks (causal, window, ``n < seq_len``) and an online softmax in float32. The masked
value is a large finite negative, and the final divide is guarded: no NaN anywhere.

KV paths (`choose_kv_path`). A block's ``block_n`` positions start at a multiple of
``block_n``, so where pages and blocks nest, the page table need not be read per
position. ``contiguous_pages=True`` (off by default until a GPU run says it pays;
``bench.device``'s kernels sweep times both) picks:

- ``"slice"`` (``page_size`` a multiple of ``block_n``: the block lies in one page):
  one page id per block, and K and V are ``block_n`` consecutive cache slots of the
  cache viewed as ``[P * S, 2 * Hkv, D]`` (a ``pl.ds`` slice: fixed-stride rows, no
  pointer gather);
- ``"pages"`` (``block_n`` a multiple of ``page_size``): ``block_n // page_size`` page
  ids in one vector load, each page's ``S`` slots in order (a ``[pages, S]`` reshape
  to the block's rows), then the row loads of the gather;
- ``"gather"`` otherwise, and where the head dim is not a power of two (its columns
  are clamped and masked): one page id per position, as above.

(A strided ``pl.ds`` over the flat ``[P * S * 2Hkv, D]`` view would say the same,
but interpret mode cannot discharge strided loads at this jax version.)

Block sizes (`choose_blocks`), from the shapes, overridable by keyword:

==============  ==============================================================
``block_m``     16 score rows when the batch has at most two tokens per request
                (decode-like: a block holds one request's few tokens anyway),
                else 64 (prefill chunks: each KV block is reused by 64 rows).
                At least ``next_pow2(G)`` (one token's query heads); a power of
                two >= 16 (``tl.dot`` needs 16 rows; interpret mode takes
                any power of two, for tests).
``block_n``     64 KV positions, 32 for head_dim > 128 (registers and shared
                memory grow with ``block_n * head_dim``).
``num_warps``   4; 8 when ``block_m * head_dim`` > 8192 (the float32
                accumulator stays at <= 64 registers per thread).
``num_stages``  2: the gathers of step ``i + 1`` overlap the math of step ``i``.
                ``num_warps`` and ``num_stages`` are keyword arguments too.
==============  ==============================================================

Larger tiles for long prefill chunks are accepted and tested (interpret mode, and
lowered for CUDA): ``block_m`` 128 or 256, ``block_n`` 128, ``num_stages`` 3. The
defaults stay until a GPU run picks: ``block_m`` 128 at head dim 128 puts a 64 KiB
float32 accumulator in registers (64 a thread at 8 warps, beside the ``[BM, BN]``
scores), 256 twice that, which Hopper's 255 registers a thread hold only without
much else; and each extra stage holds another K and V block in shared memory
(``2 * block_n * D * 2`` bytes: 64 KiB at 128 x 128 in bf16) of the 227 KiB an
H100/H200 SM has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.cost import attention_cost

_MASKED = -1e30  # finite: an all-masked row gives exp(0) * 0, never NaN
NUM_STAGES = 2


class Blocks(NamedTuple):
    block_m: int  # score rows per program: tokens * query heads of one KV head
    block_n: int  # KV positions per loop step


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def choose_blocks(num_tokens: int, num_reqs: int, group: int, head_dim: int) -> Blocks:
    """The documented block table (module docstring)."""
    block_m = 16 if num_tokens <= 2 * num_reqs else 64
    return Blocks(max(block_m, _next_pow2(group)), 64 if head_dim <= 128 else 32)


def _num_warps(block_m: int, head_dim: int) -> int:
    return 8 if block_m * head_dim > 8192 else 4


def _check_block(name: str, value: int, minimum: int) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def choose_kv_path(contiguous_pages: bool, page_size: int, block_n: int, head_dim: int) -> str:
    """How a KV block's rows are found (module docstring, "KV paths")."""
    if not contiguous_pages or head_dim != _next_pow2(head_dim):
        return "gather"  # a padded head dim needs the clamped column gather
    if page_size % block_n == 0:
        return "slice"
    return "pages" if block_n % page_size == 0 else "gather"


class _KVLayout(NamedTuple):
    """Where one KV block's K and V rows lie in the flat cache, and their loads."""

    page_table_ref: Any  # [R * M]
    kv_ref: Any  # [P * S * 2Hkv, D]; [P * S, 2Hkv, D] on the "slice" path
    table_base: Any  # req * M: the request's row of the page table
    max_pages: int
    page_size: int
    two_hkv: int
    k_row: Any  # 2h: the head's K row at a position; its V row is the next
    block_n: int
    d_idx: Any  # [1, Dp] column indices
    full_rows: Callable  # [X, 1] row mask -> [X, Dp]
    path: str  # `choose_kv_path`

    def load(self, n0, n, n_ok, hi):
        """K and V [BN, Dp] of positions ``n = n0 + arange(BN)`` (``n0`` a multiple of
        BN), zeros where not ``n_ok``."""
        s, kv_mask = self.page_size, self.full_rows(n_ok[:, None])
        if self.path == "slice":  # one page holds the block: a slice of cache slots
            page = self.page_table_ref[self.table_base + jnp.minimum(n0 // s, self.max_pages - 1)]
            slots = pl.ds(page * s + n0 % s, self.block_n)  # kv_ref is [P * S, 2Hkv, D] here
            cols = pl.ds(0, self.d_idx.shape[1])
            k = plgpu.load(self.kv_ref.at[slots, self.k_row, cols], mask=kv_mask, other=0.0)
            v = plgpu.load(self.kv_ref.at[slots, self.k_row + 1, cols], mask=kv_mask, other=0.0)
            return k, v
        if self.path == "pages":  # whole pages: BN // S page ids, each page's rows in order
            per = self.block_n // s
            idx = n0 // s + jnp.arange(per, dtype=jnp.int32)  # [BN // S]
            page_ok = idx * s < hi
            idx = self.table_base + jnp.minimum(idx, self.max_pages - 1)
            pages = plgpu.load(self.page_table_ref.at[idx], mask=page_ok, other=0)
            slots = pages[:, None] * s + jnp.arange(s, dtype=jnp.int32)[None, :]  # [BN // S, S]
            row = slots.reshape(self.block_n) * self.two_hkv + self.k_row
        else:  # one page id per position
            page_idx = jnp.minimum(n // s, self.max_pages - 1)
            page = plgpu.load(self.page_table_ref.at[self.table_base + page_idx],
                              mask=n_ok, other=0)  # fmt: skip
            row = (page * s + n % s) * self.two_hkv + self.k_row  # K row; V is row + 1
        k = plgpu.load(self.kv_ref.at[row[:, None], self.d_idx], mask=kv_mask, other=0.0)
        v = plgpu.load(self.kv_ref.at[row[:, None] + 1, self.d_idx], mask=kv_mask, other=0.0)
        return k, v


def _find_request(qsl_ref, num_reqs: int, block_q: int):
    """The request owning this program's q block slot, and the block's first token."""
    slot = pl.program_id(0)
    width = _next_pow2(num_reqs + 1)
    idx = jnp.arange(width, dtype=jnp.int32)
    starts = plgpu.load(qsl_ref.at[jnp.minimum(idx, num_reqs)])  # [width]
    first_slot = starts // block_q + idx  # strictly increasing in the request
    owns = (idx < num_reqs) & (first_slot <= slot)
    # query_start_loc[0] == 0, so request 0 starts at slot 0 and req >= 0
    req = jnp.maximum(jnp.sum(owns.astype(jnp.int32)) - 1, 0)
    q_start = qsl_ref[req]
    q_end = qsl_ref[req + 1]
    start = q_start + (slot - (q_start // block_q + req)) * block_q
    return req, q_start, q_end, start


def _kernel(
    q_ref,  # [T * Hq, D]
    kv_ref,  # [P * S * 2Hkv, D] ([P * S, 2Hkv, D] on the "slice" KV path)
    seq_lens_ref,  # [R]
    page_table_ref,  # [R * M]
    qsl_ref,  # [R + 1]
    num_seqs_ref,  # [1]
    zeros_ref,  # [T * Hq, D], aliased to o_ref
    o_ref,  # [T * Hq, D]
    *,
    num_tokens: int,
    num_q_heads: int,
    group: int,
    head_dim: int,
    two_hkv: int,
    page_size: int,
    max_pages: int,
    block_m: int,
    block_n: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    attention_chunk_size: int | None = None,
    kv_path: str = "gather",
    sinks_ref=None,  # [Hq] float32 (`_kernel_entry`)
    ends_ref=None,  # [T] int32: each token's attend_until (`_kernel_entry`)
):
    del zeros_ref  # the same buffer as o_ref
    num_reqs = seq_lens_ref.shape[0]
    block_q = block_m // group
    h = pl.program_id(1)

    req, q_start, q_end, start = _find_request(qsl_ref, num_reqs, block_q)
    end = jnp.minimum(start + block_q, q_end)
    end = jnp.where(req < num_seqs_ref[0], end, start)  # padding request: nothing
    seq_len = seq_lens_ref[req]
    ctx = seq_len - (q_end - q_start)  # position of the request's first new token

    # rows: (token, query head of this KV head), token-major
    m = jnp.arange(block_m, dtype=jnp.int32)
    tok = start + m // group  # [BM]
    row_ok = (m < block_q * group) & (tok < end)
    q_pos = ctx + tok - q_start  # [BM]
    # distinct rows for distinct m (also the masked ones: interpret mode's masked store
    # writes the old value back, so two rows on one address could undo a write)
    o_row = tok * num_q_heads + h * group + m % group
    q_row = jnp.minimum(o_row, num_tokens * num_q_heads - 1)
    d_pad = _next_pow2(head_dim)
    d = jnp.arange(d_pad, dtype=jnp.int32)[None, :]  # [1, Dp]
    if d_pad == head_dim:  # no clamp and no column mask: the loads stay vectorized
        d_idx = d

        def full_rows(mask):  # [X, 1] -> [X, Dp]
            return jnp.broadcast_to(mask, (mask.shape[0], d_pad))
    else:
        d_idx = jnp.minimum(d, head_dim - 1)

        def full_rows(mask):
            return mask & (d < head_dim)

    q = plgpu.load(
        q_ref.at[q_row[:, None], d_idx], mask=full_rows(row_ok[:, None]), other=0.0
    )  # [BM, Dp]

    hi = ctx + (end - q_start)  # one past the last row's position
    q_end = q_pos  # [BM] each row's last key
    if ends_ref is not None:  # an image's later keys (written by this step) too
        tok_idx = jnp.minimum(tok, num_tokens - 1)
        q_end = jnp.where(row_ok, plgpu.load(ends_ref.at[tok_idx], mask=row_ok, other=-1), -1)
        hi = jnp.maximum(hi, jnp.max(q_end) + 1)
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        lo = jnp.maximum(ctx + (start - q_start) - sliding_window + 1, 0)
    if attention_chunk_size is not None:  # the first row's chunk starts earliest
        first_pos = ctx + (start - q_start)
        lo = jnp.maximum(lo, first_pos - first_pos % attention_chunk_size)
        chunk_lo = q_pos - q_pos % attention_chunk_size  # [BM]; q_pos >= 0
    lo = (lo // block_n) * block_n
    trips = jnp.where(end > start, pl.cdiv(hi - lo, block_n), 0)

    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    col = jnp.arange(block_n, dtype=jnp.int32)

    layout = _KVLayout(page_table_ref, kv_ref, req * max_pages, max_pages, page_size,
                       two_hkv, 2 * h, block_n, d_idx, full_rows, kv_path)  # fmt: skip

    def kv_step(i, carry):
        m_prev, l_prev, acc = carry  # [BM], [BM], [BM, Dp] float32
        n = lo + i * block_n + col  # [BN] KV positions
        n_ok = n < hi
        k, v = layout.load(lo + i * block_n, n, n_ok, hi)  # [BN, Dp] each
        k, v = k.astype(q.dtype), v.astype(q.dtype)  # an 8-bit float cache, widened in SRAM
        s = jax.lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [BM, BN]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= q_end[:, None])
        if sliding_window is not None:
            mask &= q_pos[:, None] - n[None, :] < sliding_window
        if attention_chunk_size is not None:
            mask &= n[None, :] >= chunk_lo[:, None]
        s = jnp.where(mask, s, _MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        pv = jax.lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [BM, Dp]
        return m_next, l_prev * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (
        jnp.full((block_m,), _MASKED, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
        jnp.zeros((block_m, d_pad), jnp.float32),
    )
    m_last, denom, acc = jax.lax.fori_loop(0, trips, kv_step, init)
    if sinks_ref is not None:  # row m's query head is h * G + m % G
        sink = plgpu.load(sinks_ref.at[h * group + m % group])  # [BM]
        denom, acc = reference.join_sinks(m_last, denom, acc, sink)
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]
    plgpu.store(
        o_ref.at[o_row[:, None], d],
        out.astype(o_ref.dtype),
        mask=full_rows(row_ok[:, None]),
    )


def _kernel_entry(*refs, both_ways: bool, with_sinks: bool, **kwargs):
    """`_kernel` with the optional inputs after the aliased zeros: ``attend_until``
    (``both_ways``), then the sinks (``with_sinks``)."""
    inputs, refs = refs[:7], refs[7:]
    ends_ref, refs = (refs[0], refs[1:]) if both_ways else (None, refs)
    sinks_ref, refs = (refs[0], refs[1:]) if with_sinks else (None, refs)
    _kernel(*inputs, refs[0], sinks_ref=sinks_ref, ends_ref=ends_ref, **kwargs)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "attention_chunk_size",
        "block_m",
        "block_n",
        "num_warps",
        "num_stages",
        "contiguous_pages",
        "interpret",
    ),
)
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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    contiguous_pages: bool = False,
    interpret: bool = False,
    causal: bool = True,
    attention_chunk_size: int | None = None,
    sinks: jax.Array | None = None,
    attend_until: jax.Array | None = None,
) -> jax.Array:
    """Attention of each new token over its request's paged KV; returns ``[T, Hq, D]``.

    Semantics of `reference.ragged_paged_attention`: float32 accumulation, ``q``'s dtype
    out, padding tokens exactly zero. ``interpret=True`` runs the kernel on CPU.
    ``attention_chunk_size``: chunked local attention, keys of the token's own chunk.
    ``sinks`` [Hq]: attention sinks, joining each row's denominator after its KV loop.
    ``attend_until`` [T]: each token's last key, at or after its own and before its
    request's ``seq_lens`` (an image's tokens that attend both ways, Gemma 3 and 4);
    a block's KV loop runs to its rows' last. None compiles the plain causal program.
    ``contiguous_pages``: read a KV block's rows page by page where pages and blocks
    nest (module docstring, "KV paths"); the per-position gather elsewhere.
    """
    if not causal:  # an encoder's bidirectional attention: the reference runs it
        return reference.ragged_paged_attention(
            q, kv_cache, seq_lens, page_table, query_start_loc, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, causal=False,
            sinks=sinks, attend_until=attend_until,
        )  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, two_hkv, _ = kv_cache.shape
    num_kv_heads = two_hkv // 2
    group = num_q_heads // num_kv_heads
    num_reqs, max_pages = page_table.shape
    auto = choose_blocks(num_tokens, num_reqs, group, head_dim)
    # Triton's dot needs >= 16 rows; interpret mode takes smaller blocks (for tests)
    minimum = 1 if interpret else 16
    block_m = max(block_m or auto.block_m, _next_pow2(group))
    block_n = block_n or auto.block_n
    _check_block("block_m", block_m, minimum)
    _check_block("block_n", block_n, minimum)
    block_q = block_m // group
    num_slots = num_tokens // block_q + num_reqs  # upper bound of the block slots
    path = choose_kv_path(contiguous_pages, page_size, block_n, head_dim)
    kv_rows = (num_pages * page_size * two_hkv,)  # a free reshape either way
    kv_rows = (num_pages * page_size, two_hkv) if path == "slice" else kv_rows
    kernel = functools.partial(
        _kernel,
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        group=group,
        head_dim=head_dim,
        two_hkv=two_hkv,
        page_size=page_size,
        max_pages=max_pages,
        block_m=block_m,
        block_n=block_n,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        attention_chunk_size=attention_chunk_size,
        kv_path=path,
    )
    flat = jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), q.dtype)
    extra = ()  # after the aliased zeros, so the alias keeps its index
    if attend_until is not None:
        extra = (attend_until.astype(jnp.int32).reshape(num_tokens),)
    if sinks is not None:
        extra += (sinks.astype(jnp.float32).reshape(num_q_heads),)
    if extra:
        optional = dict(both_ways=attend_until is not None, with_sinks=sinks is not None)
        kernel = functools.partial(_kernel_entry, **optional, **kernel.keywords)
    out = pl.pallas_call(
        kernel,
        out_shape=flat,
        grid=(num_slots, num_kv_heads),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or _num_warps(block_m, head_dim),
            num_stages=num_stages or NUM_STAGES,
        ),
        cost_estimate=attention_cost(q.shape, kv_cache.shape, page_table.shape, q.dtype),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        q.reshape(flat.shape),
        kv_cache.reshape(*kv_rows, head_dim),
        seq_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        query_start_loc.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
        jnp.zeros(flat.shape, q.dtype),
        *extra,
    )
    return out.reshape(q.shape)
