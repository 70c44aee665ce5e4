"""The quantized grouped matmuls as one Pallas TPU (Mosaic) kernel, each expert
dequantized in VMEM; MXFP4 and block fp8 differ only in their decoding.

Same signatures and semantics as `reference.mxfp4_ragged_dot` and
`reference.fp8_ragged_dot`, whose XLA forms widen every local expert to bfloat16 in
HBM each step (gpt-oss-120b at TP 8: about 25 GB of HBM traffic a layer for 0.3 GB of
4-bit weights; DeepSeek-V3 at TP 16 with expert parallelism: 16 experts of 7168 x
2048 a projection, 470 MB of bfloat16 written and read for 235 MB of fp8). Here each
expert's stored bytes are read once a step (per output tile), only for the experts
some row routes to, and dequantized in VMEM.

Work split. The output columns are cut into tiles of ``block_cols`` (the outer grid
axis, ``parallel``: the two TensorCores of a v5p chip take half each; all of ``N``
when it is not a multiple of 128, as gpt-oss's 2880). The sorted rows are cut into
row tiles of ``block_rows``; an inner grid step is one (expert, row tile) pair that
holds rows of the expert (at most ``R / block_rows + G`` of them; the list, computed
in the wrapper, comes in by scalar prefetch, and steps past its end repeat its last
pair and do nothing). The first step of an expert decodes its weight's column tile
into VMEM buffers (bfloat16) in chunks of rows; every step of the expert then runs
``sum_i x_i @ buffer_i`` on its row tile (float32 accumulation) and writes the rows
of its expert, leaving the tile's other rows as a previous expert wrote them (a row
tile shared by two experts is visited twice in a row, its output block kept in VMEM).
Row tiles no expert holds are never written.

Decodings: MXFP4 into two buffers, even and odd input columns (the low and high
nibbles need no interleaving, as ``x`` comes split the same way), 128 byte rows at a
time; fp8 into one, ``values * scale`` with each group's scale broadcast over its
rows, a whole number of groups at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quantized_gmm.reference import BLOCK, e2m1, e8m0

CHUNK = 128
"""MXFP4: byte rows (256 input columns, 8 exponents) decoded at a time."""
FP8_CHUNK = 256
"""fp8: input rows decoded at a time (its least common multiple with the group size)."""
DEFAULT_BLOCK_COLS = 512
"""Output columns a grid step computes: an fp8 expert of DeepSeek-V3 (7168 inputs)
takes 7 MB of bfloat16 in VMEM per tile (29 MB whole)."""
DEFAULT_VMEM_LIMIT = 64 * 1024 * 1024
STATIC = ("block_rows", "block_cols", "vmem_limit_bytes", "interpret")


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


def _broadcast_rows(scale: jax.Array, per: int) -> jax.Array:
    """``[n, C]`` -> ``[n * per, C]``, each row repeated ``per`` times."""
    n, cols = scale.shape
    return jnp.broadcast_to(scale[:, None, :], (n, per, cols)).reshape(n * per, cols)


def _decode_mxfp4(packed_ref, scales_ref, lo_buf, hi_buf) -> None:
    """The expert's packed bytes -> bfloat16 even (low nibble) and odd input columns."""
    half = packed_ref.shape[1]
    factors = e8m0(scales_ref[0].astype(jnp.int32))  # two [K / 32, tn] float32
    per = BLOCK // 2  # byte rows a factor covers
    for start in range(0, half, CHUNK):
        stop = min(start + CHUNK, half)
        codes = packed_ref[0, start:stop, :].astype(jnp.int32)  # [rows, tn]
        low, high = (_broadcast_rows(f[start // per : stop // per], per) for f in factors)
        lo_buf[start:stop, :] = (e2m1(codes & 15) * low * high).astype(lo_buf.dtype)
        hi_buf[start:stop, :] = (e2m1(codes >> 4) * low * high).astype(hi_buf.dtype)


def _decode_fp8(values_ref, scales_ref, buf) -> None:
    """The expert's fp8 values times their group's scale -> ``x``'s dtype."""
    k = values_ref.shape[1]
    group = k // scales_ref.shape[1]
    chunk = math.lcm(group, FP8_CHUNK)  # whole groups, at aligned rows
    for start in range(0, k, chunk):
        stop = min(start + chunk, k)
        values = values_ref[0, start:stop, :].astype(jnp.float32)  # [rows, tn]
        scale = _broadcast_rows(scales_ref[0, start // group : stop // group, :], group)
        buf[start:stop, :] = (values * scale).astype(buf.dtype)


def _kernel(decode, num_x, group_ref, row_ref, live_ref, new_row_ref, new_group_ref, ends_ref,
            *refs):  # fmt: skip
    """refs: the ``num_x`` row tiles of ``x``, the expert's stored arrays (a column
    tile of each), the output tile, the ``num_x`` decoded buffers."""
    x_refs, bufs = refs[:num_x], refs[-num_x:]
    w_refs, o_ref = refs[num_x : -num_x - 1], refs[-num_x - 1]
    t = pl.program_id(1)

    @pl.when((live_ref[t] == 1) & (new_group_ref[t] == 1))
    def _():
        decode(*w_refs, *bufs)

    @pl.when(live_ref[t] == 1)
    def _():
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
        acc = sum(dot(x[...], b[...]) for x, b in zip(x_refs, bufs, strict=True))  # [tm, tn]
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


def block_cols_for(n: int, block_cols: int) -> int:
    """Column tile: the largest multiple of 128 dividing ``n``, at most ``block_cols``
    (at least 128); all ``n`` when none does."""
    fits = [c for c in range(128, max(block_cols, 128) + 1, 128) if n % c == 0]
    return fits[-1] if fits else n


def _grouped_matmul(
    xs: tuple[jax.Array, ...],  # [R, K_i] each, one per decoded buffer
    ws: tuple[jax.Array, ...],  # [G, rows_j, N] each: the stored experts
    group_sizes: jax.Array,  # [G] int32
    decode: Callable,  # (*weight column tiles, *buffers [K_i, tn]) -> None
    *,
    block_rows: int | None,
    block_cols: int,
    vmem_limit_bytes: int,
    interpret: bool,
) -> jax.Array:
    """The shared kernel: ``[R, N]``, row ``r`` of group ``g`` ``sum_i xs[i][r] @
    buffer_i`` of expert ``g`` (module docstring)."""
    (num_rows, _), (num_groups, _, n) = xs[0].shape, ws[0].shape
    tm = block_rows or block_rows_for(num_rows, num_groups)
    tn = block_cols_for(n, block_cols)
    padded = -(-num_rows // tm) * tm
    xs = tuple(jnp.pad(x, ((0, padded - num_rows), (0, 0))) for x in xs)
    meta = (*tiles(group_sizes, padded, tm), jnp.cumsum(group_sizes).astype(jnp.int32))
    dtype, passes = xs[0].dtype, n // tn
    by_row = [pl.BlockSpec((tm, x.shape[1]), lambda j, t, g, r, *_: (r[t], 0)) for x in xs]
    by_group = [pl.BlockSpec((1, w.shape[1], tn), lambda j, t, g, *_: (g[t], 0, j)) for w in ws]
    out = pl.pallas_call(
        functools.partial(_kernel, decode, len(xs)),
        out_shape=jax.ShapeDtypeStruct((padded, n), dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(meta),
            grid=(passes, meta[0].shape[0]),
            in_specs=by_row + by_group,
            out_specs=pl.BlockSpec((tm, tn), lambda j, t, g, r, *_: (r[t], j)),
            scratch_shapes=[pltpu.VMEM((x.shape[1], tn), dtype) for x in xs],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * padded * sum(x.shape[1] for x in xs) * n,
            transcendentals=0,
            bytes_accessed=sum(w.size * w.dtype.itemsize for w in ws)
            + (sum(x.size for x in xs) * passes + padded * n) * dtype.itemsize,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(*meta, *xs, *ws)
    return out[:num_rows]


@functools.partial(jax.jit, static_argnames=STATIC)
def mxfp4_ragged_dot(
    x: jax.Array,  # [R, K]
    packed: jax.Array,  # [G, K / 2, N] uint8
    scales: jax.Array,  # [G, K / 32, N] uint8
    group_sizes: jax.Array,  # [G] int32
    *,
    block_rows: int | None = None,
    block_cols: int = DEFAULT_BLOCK_COLS,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
    interpret: bool = False,
) -> jax.Array:
    """`reference.mxfp4_ragged_dot` with the experts dequantized in VMEM; rows of no
    group come out unspecified."""
    (_, k), (num_groups, half, n) = x.shape, packed.shape
    if half * 2 != k or scales.shape != (num_groups, k // BLOCK, n) or k % BLOCK:
        raise ValueError(f"x {x.shape}, packed {packed.shape}, scales {scales.shape}")
    return _grouped_matmul(
        (x[:, 0::2], x[:, 1::2]), (packed, scales), group_sizes, _decode_mxfp4,
        block_rows=block_rows, block_cols=block_cols, vmem_limit_bytes=vmem_limit_bytes,
        interpret=interpret,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=STATIC)
def fp8_ragged_dot(
    x: jax.Array,  # [R, K]
    values: jax.Array,  # [G, K, N] float8_e4m3fn
    scales: jax.Array,  # [G, K / g, N] float32
    group_sizes: jax.Array,  # [G] int32
    *,
    block_rows: int | None = None,
    block_cols: int = DEFAULT_BLOCK_COLS,
    vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT,
    interpret: bool = False,
) -> jax.Array:
    """`reference.fp8_ragged_dot` with the experts dequantized in VMEM; rows of no
    group come out unspecified."""
    (_, k), (num_groups, rows, n) = x.shape, values.shape
    groups = scales.shape[1]
    if rows != k or scales.shape != (num_groups, groups, n) or k % groups:
        raise ValueError(f"x {x.shape}, values {values.shape}, scales {scales.shape}")
    return _grouped_matmul(
        (x,), (values, scales.astype(jnp.float32)), group_sizes, _decode_fp8,
        block_rows=block_rows, block_cols=block_cols, vmem_limit_bytes=vmem_limit_bytes,
        interpret=interpret,
    )  # fmt: skip
