"""The gated delta rule over a ragged batch as a Pallas TPU (Mosaic) kernel.

Same signature and semantics as `reference.gated_delta_rule` (its reference; see
there for the math, the ragged layout and the padding rules); the chunk step is
`chunk.chunk_step`, tested against `reference.chunk_step`.

Work split. The grid is ``(key-head blocks, requests)``: a program owns
``key_heads_per_block`` key heads and the ``hb`` value heads that read them (``Hv //
Hk`` each) for one request, walks the request's new tokens a chunk of ``chunk_size``
at a time, and keeps the heads' states ``[hb, Dk, Dv]`` in float32 VMEM scratch
between chunks. One kernel takes any mix: a decode is one chunk of one real row, a
prefill chunk of the scheduler several chunks, the last one partial. The heads of a
block are a static loop (a head's rows of a slab are a strided load at a static
offset; Mosaic cannot prove a dynamic one aligned).

States in place. The state comes in and goes out by BlockSpec, ``[1, hb, Dk, Dv]``
of the pool ``[S, Hv, Dk, Dv]`` (aliased input to output: donate it) at the
request's row, a scalar-prefetched table (`_row_table`), so Pallas fetches the next
request's row while this one computes and writes each row back where it was read:
one read and one write of each live request's state, no gather or scatter. A fresh
request reads its row but starts from zeros. A request that owns no row (padding,
`reference.live_requests`) takes the row of the live request before it (of the
first one, before any; row 0 when none is live): consecutive grid steps on the same
block neither fetch it again nor write it back in between, so it leaves that block
as the live request made it; at the first step of a head block, which has no
result in the block yet, it copies the row through unchanged. No row is written but
the live requests' (and that copy of a row onto itself).

Token data. ``q``, ``k`` and ``v`` stay in HBM in the engine's token-major layout
``[T, H, D]`` (padded by one chunk of zeros at the end, so a chunk's copy never
runs off the array), ``g`` and ``beta`` side by side as ``[T, 1, 2 * Hv]`` (token
axis major: HBM tiles the last two axes, and a copy's offset there must be tile-
aligned, which a request's first token is not). A chunk comes in as one copy per
array of its ``C`` token rows and the block's slab of heads (whole, or a multiple of
8 heads: tile-aligned); a head's ``g`` and ``beta`` are lane-masked sums of the row.
The chunks of a request after its first go to a two-slot ring (chunk ``c + 1`` in
flight while ``c`` computes), and the first chunk of request ``r + 1`` to its own
pair of slots, started while request ``r`` computes. Rows of a chunk past its
request's end hold other requests' tokens (or padding, NaN included): they are
masked to zero, which changes nothing in the rule, before the chunk step.

Outputs leave by DMA too, a chunk of ``C`` rows of the head slab from a two-slot
ring. The last chunk's rows past the request's end carry zeros over the next
requests' rows; those requests run later on the same core and write their own rows,
and a program waits for all its output copies before it ends, so the last write to
every row is its own request's (interpret mode's race detector checks this). Rows no
request writes (the padding tokens past the last chunk) are zeroed by the wrapper.

Blocks (`choose_blocks`), from the shapes, overridable by keyword:

======================  =======================================================
``chunk_size``          the dtype's sublane packing (8 float32, 16 bfloat16)
                        when the batch has at most two tokens per request
                        (decode-like: a chunk is read whole, whatever its real
                        rows), else 64
``key_heads_per_block`` every key head, halved (to multiples of 8) while the
                        VMEM estimate exceeds ``vmem_limit_bytes`` (default
                        16 MiB, the scoped VMEM of v5e)
======================  =======================================================

Matmuls run at ``precision`` (default HIGHEST: float32 through the MXU's multi-pass
mode, the reference's numbers; DEFAULT takes one bfloat16 pass). Nothing here asks
the device for its limits, so the kernel runs under TPU interpret mode on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gated_delta import reference
from pallas_kernels.gated_delta.chunk import chunk_step, cost_estimate, normalize

DEFAULT_VMEM_LIMIT = 16 * 1024 * 1024
PREFILL_CHUNK = 64
HEAD_ALIGN = 8  # a slab of heads is whole or a multiple of 8 (the HBM tile's rows)
LIVE, FRESH, NOT_LIVE = 0, 1, 2  # a request's state: from its row, from zeros, none


@dataclasses.dataclass(frozen=True)
class Blocks:
    chunk_size: int
    key_heads_per_block: int  # value heads per block: this times Hv // Hk


def _sublanes(dtype) -> int:
    return 8 * max(1, 4 // np.dtype(dtype).itemsize)


def vmem_bytes(blocks: Blocks, ratio: int, k_dim: int, v_dim: int, dtype, state_dtype) -> int:
    """VMEM one grid step needs: token buffers, output ring, state blocks and scratch,
    and the chunk step's float32 temporaries."""
    item, state_item = np.dtype(dtype).itemsize, np.dtype(state_dtype).itemsize
    c, hbk = blocks.chunk_size, blocks.key_heads_per_block
    hb = hbk * ratio
    tokens = 4 * c * (2 * hbk * k_dim + hb * v_dim) * item + 4 * c * 128 * 4
    out = 2 * hb * c * v_dim * item
    state = 2 * 2 * hb * k_dim * v_dim * state_item + hb * k_dim * v_dim * 4
    temporaries = 4 * (8 * c * max(c, 128) + 8 * c * max(k_dim, v_dim) + 2 * k_dim * v_dim)
    return tokens + out + state + temporaries


def choose_blocks(
    num_tokens: int,
    num_reqs: int,
    num_k_heads: int,
    ratio: int,
    k_dim: int,
    v_dim: int,
    dtype,
    state_dtype,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
) -> Blocks:
    """The documented block table (module docstring)."""
    chunk = _sublanes(dtype) if num_tokens <= 2 * num_reqs else PREFILL_CHUNK
    blocks = Blocks(chunk, num_k_heads)
    while (
        vmem_bytes(blocks, ratio, k_dim, v_dim, dtype, state_dtype) > vmem_limit_bytes
        and blocks.key_heads_per_block % (2 * HEAD_ALIGN) == 0
    ):
        blocks = Blocks(chunk, blocks.key_heads_per_block // 2)
    return blocks


def _kernel(
    # scalar prefetch (SMEM)
    qsl_ref,  # [R + 1]
    num_seqs_ref,  # [1]
    rows_ref,  # [R]: each request's pool row (the state BlockSpec's)
    mode_ref,  # [R]: LIVE, FRESH or NOT_LIVE
    # inputs
    q_hbm,  # [T + C, Hk, Dk] HBM
    k_hbm,  # [T + C, Hk, Dk] HBM
    v_hbm,  # [T + C, Hv, Dv] HBM
    gb_hbm,  # [T + C, 1, 2 * Hv] f32 HBM: g, then beta
    s_in_ref,  # [1, hb, Dk, Dv] VMEM: the request's pool row
    # outputs
    o_hbm,  # [T + C, Hv, Dv] HBM
    s_out_ref,  # [1, hb, Dk, Dv] VMEM (aliased to the state input)
    # scratch
    q_buf,  # [4, C, hbk, Dk]: slots 0-1 first chunks (by request parity), 2-3 the ring
    k_buf,  # [4, C, hbk, Dk]
    v_buf,  # [4, C, hb, Dv]
    gb_buf,  # [4, C, 1, 2 * Hv] f32
    in_sems,  # DMA [4]
    o_buf,  # [2, C, hb, Dv]
    out_sems,  # DMA [2]
    state_sc,  # [hb, Dk, Dv] f32
    *,
    scale: float,
    use_qk_l2norm: bool,
    precision,
):
    _, chunk, hbk, _ = q_buf.shape
    hb = v_buf.shape[2]
    ratio = hb // hbk
    num_v_heads = gb_buf.shape[3] // 2
    hk0 = pl.program_id(0) * hbk
    h0 = hk0 * ratio
    r = pl.program_id(1)
    num_reqs = pl.num_programs(1)

    def heads(x_hbm, first, size):  # this block's slab of heads
        if size == x_hbm.shape[1]:
            return x_hbm
        return x_hbm.at[:, pl.ds(pl.multiple_of(first, HEAD_ALIGN), size)]

    def length(i):
        return jnp.where(i < num_seqs_ref[0], qsl_ref[i + 1] - qsl_ref[i], 0)

    def in_copies(slot, t0):
        rows = pl.ds(t0, chunk)
        pairs = (
            (heads(q_hbm, hk0, hbk), q_buf),
            (heads(k_hbm, hk0, hbk), k_buf),
            (heads(v_hbm, h0, hb), v_buf),
            (gb_hbm, gb_buf),
        )
        return [
            pltpu.make_async_copy(src.at[rows], buf.at[slot], in_sems.at[slot])
            for src, buf in pairs
        ]

    def out_copies(slot, t0):
        dst = heads(o_hbm, h0, hb).at[pl.ds(t0, chunk)]
        return [pltpu.make_async_copy(o_buf.at[slot], dst, out_sems.at[slot])]

    def start(copies):
        for copy in copies:
            copy.start()

    def wait(copies):
        for copy in copies:
            copy.wait()

    n, t0 = length(r), qsl_ref[r]
    num_chunks = pl.cdiv(n, chunk)
    r_next = jnp.minimum(r + 1, num_reqs - 1)

    @pl.when((r == 0) & (n > 0))
    def _first_request():
        start(in_copies(0, t0))

    @pl.when((r + 1 < num_reqs) & (length(r_next) > 0))
    def _prefetch_next_request():
        start(in_copies(jax.lax.rem(r + 1, 2), qsl_ref[r_next]))

    del rows_ref  # (used by the BlockSpecs)
    mode = mode_ref[r]

    @pl.when(mode == LIVE)
    def _load_state():
        state_sc[...] = s_in_ref[0].astype(jnp.float32)

    @pl.when(mode != LIVE)
    def _zero_state():
        state_sc[...] = jnp.zeros(state_sc.shape, jnp.float32)

    lane = jax.lax.broadcasted_iota(jnp.int32, (chunk, 2 * num_v_heads), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)

    def one_chunk(c, carry):
        slot = jnp.where(c == 0, jax.lax.rem(r, 2), 2 + jax.lax.rem(c + 1, 2))
        o_slot = jax.lax.rem(c, 2)
        c0 = t0 + c * chunk

        @pl.when(c + 1 < num_chunks)
        def _prefetch_next_chunk():
            start(in_copies(2 + jax.lax.rem(c, 2), c0 + chunk))

        wait(in_copies(slot, c0))

        @pl.when(c >= 2)
        def _free_output_slot():
            wait(out_copies(o_slot, c0 - 2 * chunk))

        valid = row < n - c * chunk  # [C, 1]: rows past the request hold other tokens
        gb = jnp.where(valid, gb_buf[slot, :, 0, :], 0.0)  # [C, 2Hv]
        for j in range(hb):  # static: a head's rows of the slab are a strided load
            g = jnp.sum(jnp.where(lane == h0 + j, gb, 0.0), axis=1, keepdims=True)  # [C, 1]
            beta = jnp.sum(jnp.where(lane == num_v_heads + h0 + j, gb, 0.0), axis=1, keepdims=True)
            q = normalize(q_buf[slot, :, j // ratio, :], scale, use_qk_l2norm)
            k = normalize(k_buf[slot, :, j // ratio, :], 1.0, use_qk_l2norm)
            v = v_buf[slot, :, j, :].astype(jnp.float32)
            q, k, v = (jnp.where(valid, x, 0.0) for x in (q, k, v))
            out, state = chunk_step(q, k, v, g, beta, state_sc[j], precision)
            state_sc[j] = state
            o_buf[o_slot, :, j, :] = out.astype(o_buf.dtype)
        start(out_copies(o_slot, c0))
        return carry

    jax.lax.fori_loop(0, num_chunks, one_chunk, 0)

    # the next request's first chunk may write over this one's last rows: finish first
    def drain(back):  # the output copies of chunk num_chunks - back, if there is one
        @pl.when(num_chunks >= back)
        def _():
            c = num_chunks - back
            wait(out_copies(jax.lax.rem(c, 2), t0 + c * chunk))

    drain(1)
    drain(2)

    @pl.when(mode != NOT_LIVE)
    def _store_state():
        s_out_ref[0] = state_sc[...].astype(s_out_ref.dtype)

    @pl.when((mode == NOT_LIVE) & (r == 0))  # the block's first step: keep the row
    def _copy_row_through():
        s_out_ref[0] = s_in_ref[0]


def _check_blocks(blocks: Blocks, num_k_heads: int, ratio: int, dtype, interpret: bool):
    chunk, hbk = blocks.chunk_size, blocks.key_heads_per_block
    if chunk & (chunk - 1) or chunk % _sublanes(dtype):
        raise ValueError(f"chunk_size {chunk}: a power of two, a multiple of the sublanes")
    if num_k_heads % hbk:
        raise ValueError(f"key_heads_per_block {hbk} does not divide {num_k_heads} key heads")
    if not interpret and hbk != num_k_heads and (hbk % HEAD_ALIGN or hbk * ratio % HEAD_ALIGN):
        raise ValueError(f"key_heads_per_block {hbk}: all {num_k_heads}, or a multiple of 8")


@functools.partial(
    jax.jit,
    static_argnames=(
        "chunk_size",
        "use_qk_l2norm",
        "scale",
        "key_heads_per_block",
        "precision",
        "vmem_limit_bytes",
        "interpret",
    ),
)
def gated_delta_rule(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    query_start_loc: jax.Array,  # [R + 1] int32
    num_seqs: jax.Array,  # [] int32
    state_pool: jax.Array,  # [S, Hv, Dk, Dv]
    state_rows: jax.Array,  # [R] int32, -1: padding
    fresh: jax.Array,  # [R] bool
    *,
    chunk_size: int | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    key_heads_per_block: int | None = None,
    precision: jax.lax.Precision = jax.lax.Precision.HIGHEST,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array]:
    """`reference.gated_delta_rule` as one Mosaic kernel; returns ``(out [T, Hv, Dv],
    new pool [S, Hv, Dk, Dv])``, the live requests' rows updated in place (donate the
    pool). ``chunk_size``: a power of two, a multiple of the dtype's sublane packing.
    ``interpret``: True, or TPU interpret mode's parameters (race detection): on CPU."""
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    reference._check(q, k, v, g, beta, state_pool)
    ratio, num_reqs = num_v_heads // num_k_heads, state_rows.shape[0]
    auto = choose_blocks(
        num_tokens, num_reqs, num_k_heads, ratio, k_dim, v_dim, q.dtype, state_pool.dtype,
        vmem_limit_bytes,
    )  # fmt: skip
    blocks = Blocks(chunk_size or auto.chunk_size, key_heads_per_block or auto.key_heads_per_block)
    _check_blocks(blocks, num_k_heads, ratio, q.dtype, interpret is not False)

    def padded(x):  # one chunk of zeros after the last token
        return jnp.pad(x, ((0, blocks.chunk_size),) + ((0, 0),) * (x.ndim - 1))

    gb = jnp.concatenate([g, beta], axis=1).astype(jnp.float32)[:, None, :]  # [T, 1, 2Hv]
    kernel = functools.partial(
        _kernel,
        scale=k_dim**-0.5 if scale is None else scale,
        use_qk_l2norm=use_qk_l2norm,
        precision=precision,
    )
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    state_pool = _in_hbm(state_pool, interpret)
    call = _pallas_call(kernel, blocks, q, v, state_pool, num_reqs, vmem_limit_bytes, interpret)
    out, pool = call(
        query_start_loc.astype(jnp.int32),
        num_seqs.reshape(1),
        *_row_table(state_rows.astype(jnp.int32), fresh, num_seqs),
        padded(q),
        padded(k.astype(q.dtype)),
        padded(v),
        padded(gb),
        state_pool,
    )
    real = jnp.arange(num_tokens) < query_start_loc[num_seqs]
    return jnp.where(real[:, None, None], out[:num_tokens], 0).astype(q.dtype), pool


def _in_hbm(pool: jax.Array, interpret) -> jax.Array:
    """``pool`` kept in HBM by XLA too (compiled): XLA may otherwise stage a small
    pool whole in VMEM around the kernel and copy it back to HBM every step."""
    return pool if interpret is not False else pltpu.with_memory_space_constraint(pool, pltpu.HBM)


def _row_table(state_rows: jax.Array, fresh: jax.Array, num_seqs: jax.Array):
    """``(rows [R], mode [R])`` int32: the pool row each grid step's state block
    takes (a live request's own; else the last live one's before it, the first live
    one's before any, row 0 with none: module docstring) and how it starts."""
    live = reference.live_requests(state_rows, num_seqs)
    index = jnp.arange(state_rows.shape[0])
    last = jax.lax.cummax(jnp.where(live, index, -1))
    source = jnp.where(last >= 0, last, jnp.argmax(live))
    rows = jnp.where(jnp.any(live), state_rows[source], 0).astype(jnp.int32)
    mode = jnp.where(live, jnp.where(fresh, FRESH, LIVE), NOT_LIVE).astype(jnp.int32)
    return rows, mode


def _pallas_call(kernel, blocks: Blocks, q, v, pool, num_reqs, vmem_limit_bytes, interpret):
    """The kernel's ``pallas_call``: grid, specs, scratch (see `_kernel`'s arguments)."""
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    chunk, hbk = blocks.chunk_size, blocks.key_heads_per_block
    hb = hbk * (num_v_heads // num_k_heads)
    state_spec = pl.BlockSpec(
        (1, hb, k_dim, v_dim), lambda h, r, qsl, ns, rows, mode: (rows[r], h, 0, 0)
    )
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    states = jax.ShapeDtypeStruct((num_reqs, *pool.shape[1:]), pool.dtype)  # read and written
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens + chunk, num_v_heads, v_dim), q.dtype),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_k_heads // hbk, num_reqs),
            in_specs=[hbm] * 4 + [state_spec],
            out_specs=[hbm, state_spec],
            scratch_shapes=[
                pltpu.VMEM((4, chunk, hbk, k_dim), q.dtype),
                pltpu.VMEM((4, chunk, hbk, k_dim), q.dtype),
                pltpu.VMEM((4, chunk, hb, v_dim), v.dtype),
                pltpu.VMEM((4, chunk, 1, 2 * num_v_heads), jnp.float32),
                pltpu.SemaphoreType.DMA((4,)),
                pltpu.VMEM((2, chunk, hb, v_dim), q.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((hb, k_dim, v_dim), jnp.float32),
            ],
        ),
        input_output_aliases={8: 1},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        cost_estimate=cost_estimate(q.shape, v.shape, states, chunk, q.dtype),
        interpret=interpret
        if not isinstance(interpret, bool)
        else (pltpu.InterpretParams() if interpret else False),
    )
