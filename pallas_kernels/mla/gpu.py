"""Ragged paged multi-head latent attention as a Pallas GPU kernel (Triton lowering).

Implements `pallas_kernels.mla.reference`: `ragged_paged_mla` (same signature and
semantics: absorbed queries ``[T, Hq, W]`` over the cache of one latent row a token,
``[P, S, 1, W]``, output ``[T, Hq, value_dim]``) and `update_mla_cache`, the write
(the GQA write's Triton kernel, `kv_cache_update.gpu.write_rows`, on the row
``[latent; k_rope]``). See the reference for the layout and padding rules.

Why Triton: as for the GQA kernel (`ragged_paged_attention.gpu`), every key row is
fetched through the page table, a gather of rows scattered over the cache, which
Triton expresses as a masked load of a tensor of pointers.

Work split. A program owns one q block of one head block: ``block_q`` consecutive
tokens of ONE request times ``heads_per_block`` query heads, stacked token-major into
``block_m`` score rows (row ``m``: token ``start + m // hb``, head ``h0 + m % hb``), so
every row of a block sees the same keys and each key row loaded serves them all. The
grid is ``(q block slots, Hq // heads_per_block)``; requests find their slots as in the
GQA kernel (`ragged_paged_attention.gpu._find_request`, shared): a slot past its
request's tokens runs no KV step and stores nothing, and padding tokens come out as
the zeros the output starts from (an aliased buffer).

KV loop. Keys ``[0, hi)``, ``hi`` one past the block's last position, in steps of
``block_n`` positions: their page ids, then their rows from the cache viewed as
``[P * S, W]`` (a free reshape), as two masked loads: the value part (the first
``value_dim`` features, the latent) and the rest (the rope key), each padded to a
power of two of at least 16 (Triton's blocks, ``tl.dot``'s K). Scores ``q_v . c +
q_r . k_r`` are two dots with float32 accumulation (IEEE for float32 inputs, tensor
cores for bfloat16), then the causal mask and an online softmax in float32; the value
sum is one more dot with the same latent block, so each row is read once for scores
and values.

Block sizes (`choose_blocks`), from the shapes, overridable by keyword:

===================  ==========================================================
``block_m``          16 score rows when the batch has at most two tokens per
                     request (a decode: 16 heads of one token), else 32 when the
                     value part is wider than 256 features (the float32
                     accumulator ``[block_m, value_dim]`` lives in registers),
                     else 64. A power of two >= 16 (``tl.dot``; interpret mode
                     takes any power of two, for tests).
``heads_per_block``  the largest divisor of Hq that is at most ``block_m``;
                     ``block_q = block_m // heads_per_block`` tokens
``block_n``          32 KV positions for rows wider than 256 features, else 64
``num_warps``        4; 8 when ``block_m * value_dim`` > 8192
``num_stages``       2: the gathers of step ``i + 1`` overlap the math of ``i``
===================  ==========================================================
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_cache_update.gpu import write_rows
from pallas_kernels.kv_cache_update.reference import to_cache_dtype
from pallas_kernels.mla import reference
from pallas_kernels.mla.cost import mla_cost
from pallas_kernels.ragged_paged_attention.gpu import (
    _check_block,
    _find_request,  # the GQA kernel's program -> request map, shared
    _next_pow2,
)

_MASKED = -1e30  # finite: an all-masked row gives exp(0) * 0, never NaN
NUM_STAGES = 2


class Blocks(NamedTuple):
    block_m: int  # score rows per program: tokens x heads of one request
    block_n: int  # KV positions per loop step
    heads_per_block: int


def choose_blocks(
    num_tokens: int, num_reqs: int, num_heads: int, width: int, value_dim: int
) -> Blocks:
    """The documented block table (module docstring)."""
    if num_tokens <= 2 * num_reqs:
        block_m = 16
    else:
        block_m = 32 if _padded(value_dim) > 256 else 64
    heads = max(d for d in range(1, min(num_heads, block_m) + 1) if num_heads % d == 0)
    return Blocks(block_m, 32 if width > 256 else 64, heads)


def _num_warps(block_m: int, value_dim: int) -> int:
    return 8 if block_m * _padded(value_dim) > 8192 else 4


def _padded(size: int) -> int:
    """A part's width in the kernel: a power of two, at least 16 (``tl.dot``'s K)."""
    return max(16, _next_pow2(size))


def _columns(start: int, size: int):
    """Column indices ``start + [0, _padded(size))`` clamped into the part, and the
    mask of the real ones (None when the part needs no padding: no mask, and the
    loads stay vectorized)."""
    padded = _padded(size)
    d = jnp.arange(padded, dtype=jnp.int32)[None, :]  # [1, Dp]
    if padded == size:
        return start + d, None
    return start + jnp.minimum(d, size - 1), d < size


def _load(ref, rows, cols, row_ok):
    """``ref[rows, cols]`` ``[X, Dp]`` where ``row_ok`` ``[X, 1]`` and the column is
    real; zeros elsewhere."""
    idx, col_ok = cols
    mask = jnp.broadcast_to(row_ok, (row_ok.shape[0], idx.shape[1]))
    if col_ok is not None:
        mask = mask & col_ok
    return plgpu.load(ref.at[rows, idx], mask=mask, other=0.0)


def _dot(a, b, contract_b: int):
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def _kernel(
    q_ref,  # [T * Hq, W]
    kv_ref,  # [P * S, W]
    seq_lens_ref,  # [R]
    page_table_ref,  # [R * M]
    qsl_ref,  # [R + 1]
    num_seqs_ref,  # [1]
    zeros_ref,  # [T * Hq, value_dim], aliased to o_ref
    o_ref,  # [T * Hq, value_dim]
    *,
    num_heads: int,
    heads_per_block: int,
    value_dim: int,
    page_size: int,
    max_pages: int,
    block_m: int,
    block_n: int,
    sm_scale: float,
):
    del zeros_ref  # the same buffer as o_ref
    num_reqs = seq_lens_ref.shape[0]
    width = q_ref.shape[1]
    hb = heads_per_block
    block_q = block_m // hb
    h0 = pl.program_id(1) * hb

    req, q_start, q_end, start = _find_request(qsl_ref, num_reqs, block_q)
    end = jnp.minimum(start + block_q, q_end)
    end = jnp.where(req < num_seqs_ref[0], end, start)  # padding request: nothing
    ctx = seq_lens_ref[req] - (q_end - q_start)  # position of the request's first new token

    # rows: (token, head of this block), token-major; distinct rows for distinct m
    # (also the masked ones: interpret mode's masked store writes the old value back)
    m = jnp.arange(block_m, dtype=jnp.int32)
    tok = start + m // hb  # [BM]
    row_ok = ((m < block_q * hb) & (tok < end))[:, None]  # [BM, 1]
    q_pos = (ctx + tok - q_start)[:, None]  # [BM, 1]
    o_row = tok * num_heads + h0 + m % hb
    q_row = jnp.minimum(o_row, q_ref.shape[0] - 1)[:, None]
    value_cols = _columns(0, value_dim)
    rest = width - value_dim  # the rope key's features, scored but not summed
    rest_cols = _columns(value_dim, rest) if rest else None
    q_v = _load(q_ref, q_row, value_cols, row_ok)  # [BM, Vp]
    q_r = _load(q_ref, q_row, rest_cols, row_ok) if rest else None  # [BM, Rp]

    hi = ctx + (end - q_start)  # one past the last row's position
    trips = jnp.where(end > start, pl.cdiv(hi, block_n), 0)
    col = jnp.arange(block_n, dtype=jnp.int32)

    def kv_step(i, carry):
        m_prev, l_prev, acc = carry  # [BM], [BM], [BM, Vp] float32
        n = i * block_n + col  # [BN] KV positions
        n_ok = n < hi
        page_idx = jnp.minimum(n // page_size, max_pages - 1)
        page = plgpu.load(page_table_ref.at[req * max_pages + page_idx], mask=n_ok, other=0)
        kv_row = (page * page_size + n % page_size)[:, None]  # [BN, 1]
        # an 8-bit float cache is widened in SRAM
        c = _load(kv_ref, kv_row, value_cols, n_ok[:, None]).astype(q_v.dtype)  # [BN, Vp]
        s = _dot(q_v, c, 1)  # [BM, BN]
        if rest:
            k_r = _load(kv_ref, kv_row, rest_cols, n_ok[:, None]).astype(q_v.dtype)
            s = s + _dot(q_r, k_r, 1)
        s = s * sm_scale
        mask = row_ok & n_ok[None, :] & (n[None, :] <= q_pos)
        s = jnp.where(mask, s, _MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        pv = _dot(p.astype(c.dtype), c, 0)  # [BM, Vp]
        return m_next, l_prev * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (
        jnp.full((block_m,), _MASKED, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
        jnp.zeros((block_m, _padded(value_dim)), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, trips, kv_step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]
    # unclamped columns: a masked lane past the row is dropped, never another row's
    d = jnp.arange(_padded(value_dim), dtype=jnp.int32)[None, :]
    plgpu.store(o_ref.at[o_row[:, None], d], out.astype(o_ref.dtype), mask=row_ok & (d < value_dim))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "value_dim",
        "pages_per_chunk",
        "block_m",
        "block_n",
        "heads_per_block",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
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
    pages_per_chunk: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    heads_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Each new token's attention over its request's latent rows; returns ``[T, Hq,
    value_dim]`` (`reference.ragged_paged_mla`): float32 accumulation, ``q``'s dtype
    out, padding tokens exactly zero. ``pages_per_chunk`` (the reference's loop step)
    is accepted and unused. ``interpret=True`` runs the kernel on CPU."""
    del pages_per_chunk
    reference.check_shapes(q, kv_cache, value_dim)
    num_tokens, num_heads, width = q.shape
    num_pages, page_size, _, _ = kv_cache.shape
    num_reqs, max_pages = page_table.shape
    auto = choose_blocks(num_tokens, num_reqs, num_heads, width, value_dim)
    minimum = 1 if interpret else 16  # Triton's dot needs >= 16 rows
    block_m = block_m or auto.block_m
    block_n = block_n or auto.block_n
    hb = heads_per_block or auto.heads_per_block
    _check_block("block_m", block_m, minimum)
    _check_block("block_n", block_n, minimum)
    if num_heads % hb or hb > block_m:
        raise ValueError(f"heads_per_block {hb}: a divisor of {num_heads} heads, <= block_m")
    block_q = block_m // hb
    kernel = functools.partial(
        _kernel,
        num_heads=num_heads,
        heads_per_block=hb,
        value_dim=value_dim,
        page_size=page_size,
        max_pages=max_pages,
        block_m=block_m,
        block_n=block_n,
        sm_scale=sm_scale,
    )
    out = jax.ShapeDtypeStruct((num_tokens * num_heads, value_dim), q.dtype)
    result = pl.pallas_call(
        kernel,
        out_shape=out,
        grid=(num_tokens // block_q + num_reqs, num_heads // hb),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or _num_warps(block_m, value_dim),
            num_stages=num_stages or NUM_STAGES,
        ),
        cost_estimate=mla_cost(q.shape, kv_cache.shape, page_table.shape, value_dim, q.dtype),
        interpret=interpret,
        name="ragged_paged_mla",
    )(
        q.reshape(num_tokens * num_heads, width),
        kv_cache.reshape(num_pages * page_size, width),
        seq_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        query_start_loc.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
        jnp.zeros(out.shape, q.dtype),
    )
    return result.reshape(num_tokens, num_heads, value_dim)


@functools.partial(jax.jit, static_argnames=("interpret",))
def update_mla_cache(
    kv_cache: jax.Array,  # [P, S, 1, L + R]
    latent: jax.Array,  # [T, 1, L]
    k_rope: jax.Array,  # [T, 1, R]
    slot_mapping: jax.Array,  # [T] int32
    *,
    interpret: bool = False,
) -> jax.Array:
    """Writes each token's row ``[latent; k_rope]`` into its slot; returns the cache
    (`reference.update_mla_cache`; in place when the caller's jit donates it)."""
    row = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)  # [T, 1, W]
    if row.shape[1:] != kv_cache.shape[2:]:
        raise ValueError(f"MLA cache {kv_cache.shape} cannot hold rows {row.shape}")
    return write_rows(
        kv_cache, to_cache_dtype(row, kv_cache.dtype), slot_mapping, interpret=interpret
    )
