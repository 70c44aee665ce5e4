"""The MXFP4 grouped matmul as a Pallas TPU (Mosaic) kernel, the experts dequantized
in VMEM.

Same signature and semantics as `reference.mxfp4_ragged_dot`, whose XLA form widens
every local expert to bfloat16 in HBM each step (gpt-oss-120b at TP 8: about 25 GB of
HBM traffic a layer for 0.3 GB of 4-bit weights). Here each expert's packed bytes and
exponents are read once a step, only for the experts some row routes to, and
dequantized in VMEM.

Work split. The sorted rows are cut into row tiles of ``block_rows``; a grid step is
one (expert, row tile) pair that holds rows of the expert (at most ``R / block_rows +
G`` of them; the list, computed in the wrapper, comes in by scalar prefetch, and
steps past its end repeat its last pair and do nothing). The first step of an expert
decodes its weight into two VMEM buffers (even and odd input columns, bfloat16: the
low and high nibbles need no interleaving, as ``x`` comes split the same way), in
chunks of 128 byte rows; every step of the expert then runs ``x_even @ low + x_odd @
high`` on its row tile (float32 accumulation) and writes the rows of its expert,
leaving the tile's other rows as a previous expert wrote them (a row tile shared by
two experts is visited twice in a row, its output block kept in VMEM). Row tiles no
expert holds are never written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mxfp4_gmm.reference import BLOCK, e2m1, e8m0

CHUNK = 128
"""Byte rows (256 input columns, 8 exponents) decoded at a time."""
DEFAULT_VMEM_LIMIT = 64 * 1024 * 1024


def tiles(group_sizes: jax.Array, num_rows: int, block_rows: int) -> tuple:
    """``(group, row tile, live, first of its row tile, first of its group)`` per grid
    step, int32 ``[R / block_rows + G]`` each, for rows sorted by group."""
    g = group_sizes.shape[0]
    num = num_rows // block_rows + g
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // block_rows
    count = jnp.where(group_sizes > 0, (jnp.maximum(ends, 1) - 1) // block_rows - first + 1, 0)
    before = jnp.cumsum(count) - count
    live_count = jnp.sum(count)
    t = jnp.minimum(jnp.arange(num), jnp.maximum(live_count - 1, 0))
    group = jnp.clip(jnp.searchsorted(jnp.cumsum(count), t, side="right"), 0, g - 1)
    row = first[group] + t - before[group]
    live = jnp.arange(num) < live_count
    prev_row = jnp.concatenate([jnp.full((1,), -1), row[:-1]])
    prev_group = jnp.concatenate([jnp.full((1,), -1), group[:-1]])
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return i32(group), i32(row), i32(live), i32(row != prev_row), i32(group != prev_group)


def _decode(w_ref, s_ref, lo_buf, hi_buf) -> None:
    """The expert's packed bytes -> bfloat16 even (low nibble) and odd input columns."""
    half = w_ref.shape[1]
    factors = e8m0(s_ref[0].astype(jnp.int32))  # two [K / 32, N] float32
    n = lo_buf.shape[-1]
    per = BLOCK // 2  # byte rows a factor covers
    for start in range(0, half, CHUNK):
        stop = min(start + CHUNK, half)
        codes = w_ref[0, start:stop, :].astype(jnp.int32)  # [rows, N]
        low, high = (
            jnp.broadcast_to(
                f[start // per : stop // per, None, :], ((stop - start) // per, per, n)
            ).reshape(stop - start, n)
            for f in factors
        )
        lo_buf[start:stop, :] = (e2m1(codes & 15) * low * high).astype(lo_buf.dtype)
        hi_buf[start:stop, :] = (e2m1(codes >> 4) * low * high).astype(hi_buf.dtype)


def _kernel(group_ref, row_ref, live_ref, new_row_ref, new_group_ref, ends_ref,
            xe_ref, xo_ref, w_ref, s_ref, o_ref, lo_buf, hi_buf):  # fmt: skip
    t = pl.program_id(0)

    @pl.when((live_ref[t] == 1) & (new_group_ref[t] == 1))
    def _():
        _decode(w_ref, s_ref, lo_buf, hi_buf)

    @pl.when(live_ref[t] == 1)
    def _():
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
        acc = dot(xe_ref[...], lo_buf[...]) + dot(xo_ref[...], hi_buf[...])  # [tm, N]
        g, tm = group_ref[t], o_ref.shape[0]
        end = ends_ref[g]
        start = jnp.where(g == 0, 0, ends_ref[jnp.maximum(g - 1, 0)])
        rows = row_ref[t] * tm + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
        mine = (rows >= start) & (rows < end)
        previous = jnp.where(new_row_ref[t] == 1, 0.0, o_ref[...].astype(jnp.float32))
        o_ref[...] = jnp.where(mine, acc, previous).astype(o_ref.dtype)


def block_rows_for(num_rows: int, num_groups: int) -> int:
    """Row tile: 16 (bfloat16's sublane packing) for decode-sized batches, up to 256."""
    per_group = -(-num_rows // max(num_groups, 1))
    return min(256, max(16, 1 << (per_group - 1).bit_length()))


@functools.partial(jax.jit, static_argnames=("block_rows", "vmem_limit_bytes", "interpret"))
def mxfp4_ragged_dot(
    x: jax.Array,  # [R, K]
    packed: jax.Array,  # [G, K / 2, N] uint8
    scales: jax.Array,  # [G, K / 32, N] uint8
    group_sizes: jax.Array,  # [G] int32
    *,
    block_rows: int | None = None,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
    interpret: bool = False,
) -> jax.Array:
    """`reference.mxfp4_ragged_dot` with the experts dequantized in VMEM; rows of no
    group come out unspecified."""
    (num_rows, k), (num_groups, half, n) = x.shape, packed.shape
    if half * 2 != k or scales.shape != (num_groups, k // BLOCK, n) or k % BLOCK:
        raise ValueError(f"x {x.shape}, packed {packed.shape}, scales {scales.shape}")
    tm = block_rows or block_rows_for(num_rows, num_groups)
    padded = -(-num_rows // tm) * tm
    x = jnp.pad(x, ((0, padded - num_rows), (0, 0)))
    meta = (*tiles(group_sizes, padded, tm), jnp.cumsum(group_sizes).astype(jnp.int32))
    by_row = pl.BlockSpec((tm, half), lambda t, g, r, *_: (r[t], 0))
    by_group = functools.partial(pl.BlockSpec, index_map=lambda t, g, *_: (g[t], 0, 0))
    out = pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(meta),
            grid=(meta[0].shape[0],),
            in_specs=[by_row, by_row, by_group((1, half, n)), by_group((1, k // BLOCK, n))],
            out_specs=pl.BlockSpec((tm, n), lambda t, g, r, *_: (r[t], 0)),
            scratch_shapes=[pltpu.VMEM((half, n), x.dtype), pltpu.VMEM((half, n), x.dtype)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * padded * k * n,
            transcendentals=0,
            bytes_accessed=packed.size + scales.size + (padded * (k + n)) * x.dtype.itemsize,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(*meta, x[:, 0::2], x[:, 1::2], packed, scales)
    return out[:num_rows]
