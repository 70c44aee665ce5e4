"""Ragged paged multi-head latent attention as a Pallas TPU (Mosaic) kernel.

Implements `pallas_kernels.mla.reference.ragged_paged_mla`: same signature and
semantics (absorbed queries ``[T, Hq, W]`` over the cache of one latent row a token,
``[P, S, 1, W]``; output ``[T, Hq, value_dim]``); see there for the layout and padding
rules. The cache write, `update_mla_cache`, is the reference's (XLA's scatter, in
place): Mosaic's DMAs cannot write one row into the middle of an HBM tile of a
bfloat16 cache laid out as below (libtpu refuses the unaligned offset).

Work split. The flat token axis is cut into q blocks of ``block_q`` tokens and the
query heads into blocks of ``heads_per_block``; the grid is ``(q blocks, head
blocks)``, both parallel (every step starts its softmax state afresh), so a
megacore chip (v4, v5p) splits the q blocks between its cores. A q block's score rows
are its tokens times its heads, token-major: ``[block_q * heads, W]``, one MXU matmul
against a block of latent rows, heads as the M dimension; every head block holds all
the heads unless VMEM is short, so a request's latent rows are read once for every
head. As in the GQA kernel (`ragged_paged_attention.tpu`), a q block walks the
requests that overlap it (their range by scalar prefetch) and, for each, the pages
its tokens can see in blocks of ``pages_per_block``, copied HBM -> VMEM one DMA per
page into one of two buffers: the next block (the request's next, or the next
request's first) is in flight while one is computed, so a block of decodes waits for
no DMA between requests. The value is the row's first ``value_dim`` lanes of the same
VMEM block, so the row is read once for scores and values. Rows outside the request
or past a token's position are masked; rows no request owns (padding tokens) come out
as zeros.

Layout. The queries keep their ``[T, Hq, W]`` order (heads on sublanes), padded in the
wrapper to a multiple of the sublane count (8 float32, 16 bfloat16) so a block
``[block_q, heads, W]`` flattens to score rows for free. The cache is read where it
lies: a 32-bit cache as ``[P, S, 1, W]`` (a page copy squeezes the unit axis), a
narrower one viewed as ``[P, S, W]``: the views that are free (no copy) for TPU's own
HBM layout of these shapes when ``W`` is a multiple of 128 (a bfloat16 cache of 640
lanes, checked by compiling a step with libtpu: no copy of the cache). With ``W =
576`` (DeepSeek-V3's 512 + 64) TPU's default layout puts the pages on lanes, which no
Mosaic kernel takes, so XLA copies the whole cache around the call, as it does around
the reference's gather and scatter: the cure is a row padded to a multiple of 128
lanes in the cache, not a different kernel.

Block sizes (`choose_blocks`), from the shapes, overridable by keyword:

===================  ==========================================================
``block_q``          enough tokens for ``DECODE_ROWS`` (128) score rows when the
                     batch has at most two tokens per request (decodes: with 16
                     heads, 8 requests a block, whose pages stream back to back;
                     16 rows would leave the MXU mostly idle anyway), at least 1;
                     else for ``PREFILL_ROWS`` (1024; fewer re-reads of a
                     request's pages by its prefill chunk)
``pages_per_block``  enough pages for 256 KV positions, at most a page-table row
``heads_per_block``  every (padded) head, halved while the VMEM estimate exceeds
                     ``vmem_limit_bytes`` (default 16 MiB) and the half is still a
                     multiple of the sublane count; then ``block_q`` halves
===================  ==========================================================

Nothing here calls `pltpu.get_tpu_info()`: the limits come in as arguments, so the
kernel runs under TPU interpret mode on CPU (``interpret=True``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mla import reference
from pallas_kernels.mla.cost import mla_cost
from pallas_kernels.ragged_paged_attention.tpu import (
    _online_softmax_step,  # the GQA kernel's online-softmax update, shared
    _request_ranges,  # the GQA kernel's q block -> requests map, shared
)

_MASKED = -1e30  # finite: an all-masked row gives exp(0) * 0, never NaN
DEFAULT_VMEM_LIMIT = 16 * 1024 * 1024
KV_POSITIONS_PER_BLOCK = 256
DECODE_ROWS = 128  # score rows of a decode q block: one MXU pass of rows
PREFILL_ROWS = 1024  # score rows of a prefill q block: tokens x heads


@dataclasses.dataclass(frozen=True)
class Blocks:
    block_q: int
    pages_per_block: int
    heads_per_block: int


def _sublanes(dtype) -> int:
    return 8 * max(1, 4 // np.dtype(dtype).itemsize)


def _lanes(n: int) -> int:
    return -(-n // 128) * 128  # VMEM tiles pad the lane axis to 128


def vmem_bytes(
    blocks: Blocks, page_size: int, width: int, value_dim: int, dtype, cache_dtype
) -> int:
    """VMEM one grid step needs: two page buffers, double-buffered q and out blocks,
    the softmax state and the score temporaries."""
    rows = blocks.block_q * blocks.heads_per_block
    block_kv = blocks.pages_per_block * page_size
    kv = 2 * block_kv * _lanes(width) * np.dtype(cache_dtype).itemsize
    q_out = 2 * rows * (_lanes(width) + _lanes(value_dim)) * np.dtype(dtype).itemsize
    state = rows * (_lanes(value_dim) + 2 * 128) * 4
    # scores, probabilities, their exponent, mask, alpha: libtpu's own count at
    # DeepSeek-V3's dimensions was within 40% above the total without this margin
    scores = 5 * rows * _lanes(block_kv) * 4
    return kv + q_out + state + scores


def choose_blocks(
    num_tokens: int,
    num_reqs: int,
    num_heads: int,
    page_size: int,
    max_pages: int,
    width: int,
    value_dim: int,
    dtype,
    cache_dtype=None,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
) -> Blocks:
    """The documented block table (module docstring); ``num_heads`` unpadded."""
    sub = _sublanes(dtype)
    heads = -(-num_heads // sub) * sub
    if num_tokens <= 2 * num_reqs:
        block_q = max(1, DECODE_ROWS // heads)
    else:
        block_q = max(1, PREFILL_ROWS // heads)
    pages = max(1, min(max_pages, KV_POSITIONS_PER_BLOCK // page_size))
    size = functools.partial(
        vmem_bytes, page_size=page_size, width=width, value_dim=value_dim, dtype=dtype,
        cache_dtype=cache_dtype or dtype,
    )  # fmt: skip
    blocks = Blocks(block_q, pages, heads)
    while size(blocks) > vmem_limit_bytes:
        hb = blocks.heads_per_block
        if hb % (2 * sub) == 0:
            blocks = dataclasses.replace(blocks, heads_per_block=hb // 2)
        elif blocks.block_q > 1:
            blocks = dataclasses.replace(blocks, block_q=blocks.block_q // 2)
        else:
            break
    return blocks


def _kernel(
    # scalar prefetch (SMEM)
    seq_lens_ref,  # [R]
    page_table_ref,  # [R * M]
    qsl_ref,  # [R + 1]
    first_ref,  # [NB]
    last_ref,  # [NB]
    # inputs
    q_ref,  # [bq, hb, W] VMEM
    kv_hbm,  # [P, S, W] or [P, S, 1, W] HBM
    # output
    o_ref,  # [bq, hb, value_dim] VMEM
    # scratch
    kv_buf,  # [2, ppb, S, W] VMEM
    sems,  # DMA semaphores [2]
    m_sc,  # [rows, 128] f32, lanes equal
    l_sc,  # [rows, 128] f32, lanes equal
    acc_sc,  # [rows, value_dim] f32
    *,
    sm_scale: float,
    max_pages: int,
):
    bq, hb, width = q_ref.shape
    _, ppb, page_size, _ = kv_buf.shape
    value_dim = o_ref.shape[-1]
    rows = bq * hb
    block_kv = ppb * page_size
    blk_start = pl.program_id(0) * bq

    m_sc[...] = jnp.full(m_sc.shape, _MASKED, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    # score rows are (token, head) token-major: row r is token blk_start + r // hb
    # (built 3-D and flattened: hb is a multiple of 8, so no division is needed)
    row_tok = blk_start + jax.lax.broadcasted_iota(jnp.int32, (bq, hb, block_kv), 0)
    row_tok = row_tok.reshape(rows, block_kv)
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
    v_row = jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
    q = q_ref[...].reshape(rows, width)

    def page_copies(req, b, slot):
        """The copies of request ``req``'s page block ``b`` into ``slot``."""
        copies = []
        for p in range(ppb):
            idx = jnp.minimum(b * ppb + p, max_pages - 1)
            page = page_table_ref[req * max_pages + idx]
            src = kv_hbm.at[page] if kv_hbm.ndim == 3 else kv_hbm.at[page, :, 0]
            copies.append(pltpu.make_async_copy(src, kv_buf.at[slot, p], sems.at[slot]))
        return copies

    def start(req, b, slot):
        for copy in page_copies(req, b, slot):
            copy.start()

    first, last = first_ref[pl.program_id(0)], last_ref[pl.program_id(0)]

    def one_request(req, count):
        q_start, q_end = qsl_ref[req], qsl_ref[req + 1]
        ctx = seq_lens_ref[req] - (q_end - q_start)  # position of its first new token
        t_last = jnp.minimum(q_end, blk_start + bq) - 1
        kv_hi = ctx + (t_last - q_start) + 1  # keys [0, kv_hi) are visible to some row
        num_kv_blocks = pl.cdiv(pl.cdiv(kv_hi, page_size), ppb)  # >= 1: a token is here
        in_req = (row_tok >= q_start) & (row_tok < q_end)
        q_pos = ctx + row_tok - q_start

        def kv_block(b, count):  # count: page blocks of this grid step so far
            slot = jax.lax.rem(count, 2)

            # the next block in flight while this one is computed: this request's
            # next, or the next request's first (no DMA latency between requests)
            @pl.when(b + 1 < num_kv_blocks)
            def _prefetch():
                start(req, b + 1, 1 - slot)

            @pl.when((b + 1 == num_kv_blocks) & (req < last))
            def _prefetch_next_request():
                start(req + 1, 0, 1 - slot)

            for copy in page_copies(req, b, slot):
                copy.wait()
            first_pos = b * block_kv
            mask = in_req & (first_pos + col <= q_pos)
            kv = kv_buf[slot].reshape(block_kv, width)  # [Lb, W]: keys, values their head
            # slots past the request's keys may hold anything (NaN included): 0 * NaN in
            # the value sum would leak, so those rows of the values are zeroed
            values = jnp.where(first_pos + v_row < kv_hi, kv[:, :value_dim], 0)
            _online_softmax_step(
                q, kv, values, mask, m_sc, l_sc, acc_sc, sm_scale=sm_scale, soft_cap=None
            )
            return count + 1

        return jax.lax.fori_loop(0, num_kv_blocks, kv_block, count)

    @pl.when(first <= last)
    def _first_block():
        start(first, 0, 0)

    jax.lax.fori_loop(first, last + 1, one_request, 0)

    denom = l_sc[:, :1]
    out = jnp.where(denom > 0, acc_sc[...] / jnp.where(denom > 0, denom, 1.0), 0.0)
    o_ref[...] = out.reshape(bq, hb, value_dim).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "value_dim",
        "pages_per_chunk",
        "block_q",
        "pages_per_block",
        "heads_per_block",
        "vmem_limit_bytes",
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
    block_q: int | None = None,
    pages_per_block: int | None = None,
    heads_per_block: int | None = None,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Each new token's attention over its request's latent rows; returns ``[T, Hq,
    value_dim]`` (`reference.ragged_paged_mla`). ``pages_per_chunk`` (the reference's
    loop step) is accepted and unused: ``pages_per_block`` sizes this kernel's."""
    del pages_per_chunk
    reference.check_shapes(q, kv_cache, value_dim)
    num_tokens, num_heads, width = q.shape
    page_size = kv_cache.shape[1]
    num_reqs, max_pages = page_table.shape
    auto = choose_blocks(
        num_tokens, num_reqs, num_heads, page_size, max_pages, width, value_dim,
        q.dtype, kv_cache.dtype, vmem_limit_bytes,
    )  # fmt: skip
    bq = block_q or auto.block_q
    ppb = pages_per_block or auto.pages_per_block
    heads = -(-num_heads // _sublanes(q.dtype)) * _sublanes(q.dtype)
    hb = heads_per_block or auto.heads_per_block
    if heads % hb or hb % _sublanes(q.dtype):
        raise ValueError(
            f"heads_per_block {hb}: a multiple of {_sublanes(q.dtype)} dividing the "
            f"{heads} padded query heads"
        )
    num_blocks = pl.cdiv(num_tokens, bq)
    q3 = jnp.pad(q, ((0, num_blocks * bq - num_tokens), (0, heads - num_heads), (0, 0)))
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    first, last = _request_ranges(query_start_loc, num_seqs, num_blocks, bq)
    # the free view of TPU's HBM layout (module docstring): 32-bit rows as they are,
    # narrower ones without the unit axis
    cache = kv_cache if kv_cache.dtype.itemsize == 4 else kv_cache.reshape(-1, page_size, width)

    rows = bq * hb
    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, max_pages=max_pages),
        out_shape=jax.ShapeDtypeStruct((num_blocks * bq, heads, value_dim), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_blocks, heads // hb),
            in_specs=[
                pl.BlockSpec((bq, hb, width), lambda i, h, *_: (i, h, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((bq, hb, value_dim), lambda i, h, *_: (i, h, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, ppb, page_size, width), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, value_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        cost_estimate=mla_cost(q.shape, kv_cache.shape, page_table.shape, value_dim, q.dtype),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
    )(
        seq_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        query_start_loc.astype(jnp.int32),
        first,
        last,
        q3,
        cache,
    )
    return out[:num_tokens, :num_heads]


def update_mla_cache(
    kv_cache: jax.Array,  # [P, S, 1, L + R]
    latent: jax.Array,  # [T, 1, L]
    k_rope: jax.Array,  # [T, 1, R]
    slot_mapping: jax.Array,  # [T] int32
    *,
    interpret: bool = False,
) -> jax.Array:
    """`reference.update_mla_cache` (module docstring); ``interpret`` is accepted, as
    the GPU write's, and changes nothing."""
    del interpret
    return reference.update_mla_cache(kv_cache, latent, k_rope, slot_mapping)
