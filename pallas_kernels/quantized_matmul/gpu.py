"""The weight-only int8 / fp8 matmul for skinny activations (decode) as a Pallas GPU
kernel (Triton lowering), the 8-bit weight converted in registers.

Same semantics as `reference.quantized_matmul` on ``x [M, K]`` (2-D, ``M <=
MAX_ROWS``): ``w [N, K]`` int8 or float8_e4m3fn in the engine's ``[out, in]`` layout,
``scale [N]`` float32. XLA on GPU does not fuse the conversion into its dot's memory
stream (int8 and fp8 models decoded one request only 1.18x faster than bfloat16 on an
H200); here each weight byte is read once and widened only in registers, so a decode
step reads half the bytes of bfloat16's.

Work split. The grid is ``(N / block_n, splits)``: program ``(j, s)`` owns output
columns ``[j * block_n, (j + 1) * block_n)`` and the ``s``-th of ``splits`` equal runs
of the input columns. It walks its run ``block_k`` columns at a time (a fori loop,
pipelined ``num_stages`` deep by Triton): loads ``x``'s ``[Mp, block_k]`` tile and the
weight's ``[block_n, block_k]`` 8-bit tile, converts the weight tile to ``x``'s dtype
(exact: int8 and e4m3 values fit bfloat16), and accumulates ``x @ w.T`` in float32
``[Mp, block_n]``. ``x`` is padded with zero rows to ``Mp``, a power of two of at least
16 (``tl.dot``'s smallest M; the padding costs nothing in a memory-bound kernel). With
one split the per-row scale multiplies the float32 sums and the tile is stored in
``x``'s dtype; with several, each split stores float32 partial sums ``[splits, Mp,
N]`` and XLA adds them and scales after (a few hundred KB at decode shapes, next to
tens of MB of weights).

Block sizes, from the shapes, overridable by keyword:

==============  ===============================================================
``block_n``     64 output columns (the largest of 64, 32, 16 dividing ``N``):
                a ``[64, 256]`` 8-bit tile is 16 KiB, 128 values a thread at 4
                warps once widened
``block_k``     256 input columns (the largest power of two <= 256, >= 16,
                dividing ``K``): with 3 stages, 3 x (16 + 8) KiB of shared memory
                (weight and bfloat16 ``x`` tiles), two programs an SM
``splits``      the largest power of two (<= 16) that keeps ``N / block_n *
                splits`` within `TARGET_PROGRAMS` and divides ``K / block_k``: a
                ``[4096, 14336]`` down projection has 64 column tiles, 4 splits
``num_warps``   4; ``num_stages`` 3
==============  ===============================================================

A shape these blocks cannot tile (``N`` or ``K`` not a multiple of 16, ``M`` over
`MAX_ROWS`) is a ValueError naming it (`unsupported`: the engine's check before it
picks the kernel). float32 ``x`` runs an IEEE float32 dot (precision HIGHEST), not TF32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quantized_matmul.reference import check_shapes

MAX_ROWS = 64
"""The most rows of ``x`` the kernel takes: its whole (padded) M block is one tile."""
BLOCK_N = 64
BLOCK_K = 256
MIN_BLOCK = 16  # tl.dot's smallest tile side
MAX_SPLITS = 16
TARGET_PROGRAMS = 256
"""About two programs for each of an H100/H200's 132 SMs: enough weight loads in
flight to keep HBM busy, few enough that split-K partials stay small."""
NUM_WARPS = 4
NUM_STAGES = 3


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One call's tiling (module docstring)."""

    rows: int  # Mp: x's rows padded
    block_n: int
    block_k: int
    splits: int


def unsupported(m: int, k: int, n: int) -> str | None:
    """Why ``x [m, k] @ w[n, k].T`` cannot run in this kernel, or None when it can."""
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows of x: the kernel takes 1 to {MAX_ROWS}"
    for name, size in (("K", k), ("N", n)):
        if size % MIN_BLOCK:
            return f"{name} = {size} is not a multiple of {MIN_BLOCK} (Triton's dot tile)"
    return None


def _largest_block(size: int, most: int) -> int:
    """The largest power of two in ``[MIN_BLOCK, most]`` dividing ``size``."""
    block = most
    while size % block:
        block //= 2
    return block


def choose_blocks(
    m: int, k: int, n: int, block_n: int | None = None, block_k: int | None = None,
    splits: int | None = None,
) -> Blocks:  # fmt: skip
    """The tiling of ``[m, k] @ [n, k].T`` (module docstring); ValueError where none fits."""
    if (why := unsupported(m, k, n)) is not None:
        raise ValueError(f"quantized_matmul kernel: {why}")
    block_n = block_n or _largest_block(n, BLOCK_N)
    block_k = block_k or _largest_block(k, BLOCK_K)
    for name, block, size in (("block_n", block_n, n), ("block_k", block_k, k)):
        if block < MIN_BLOCK or block & (block - 1) or size % block:
            raise ValueError(f"{name} {block} must be a power of two >= {MIN_BLOCK} "
                             f"dividing {size}")  # fmt: skip
    if splits is None:
        splits = 1
        while (
            2 * splits <= MAX_SPLITS
            and n // block_n * 2 * splits <= TARGET_PROGRAMS
            and (k // block_k) % (2 * splits) == 0
        ):
            splits *= 2
    if splits < 1 or (k // block_k) % splits:
        raise ValueError(f"{splits} splits do not divide {k // block_k} blocks of {block_k}")
    return Blocks(max(MIN_BLOCK, 1 << (m - 1).bit_length()), block_n, block_k, splits)


def _kernel(x_ref, w_ref, scale_ref, out_ref, *, blocks: Blocks, steps: int, precision):
    """Program ``(j, s)``: output columns tile ``j``, input run ``s`` (module docstring).
    ``x_ref [Mp, K]``, ``w_ref [N, K]`` 8-bit, ``scale_ref [N]`` float32; ``out_ref
    [Mp, N]`` in x's dtype (one split) or ``[splits, Mp, N]`` float32."""
    bn, bk = blocks.block_n, blocks.block_k
    j, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)

    def step(i, acc):  # acc: [Mp, bn] float32
        ks = pl.ds(pl.multiple_of((s * steps + i) * bk, bk), bk)
        x = x_ref[:, ks]  # [Mp, bk]
        w = w_ref[cols, ks].astype(x.dtype)  # [bn, bk]: widened in registers
        dims = (((1,), (1,)), ((), ()))
        return acc + jax.lax.dot_general(
            x, w, dims, precision=precision, preferred_element_type=jnp.float32
        )

    acc = jnp.zeros((blocks.rows, bn), jnp.float32)
    acc = jax.lax.fori_loop(0, steps, step, acc)
    if blocks.splits == 1:
        out_ref[:, cols] = (acc * scale_ref[cols][None, :]).astype(out_ref.dtype)
    else:
        out_ref[s, :, cols] = acc


@functools.partial(
    jax.jit,
    static_argnames=("block_n", "block_k", "splits", "num_warps", "num_stages", "interpret"),
)
def quantized_matmul(
    x: jax.Array,  # [M, K] bfloat16, float16 or float32
    w: jax.Array,  # [N, K] int8 or float8_e4m3fn
    scale: jax.Array,  # [N] float32
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x @ (w * scale[:, None]).T`` -> ``[M, N]`` in ``x``'s dtype, float32 sums
    (`reference.quantized_matmul`'s semantics; blocks in the module docstring)."""
    check_shapes(x, w, scale)
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K]: got {x.shape}")
    (m, k), n = x.shape, w.shape[0]
    blocks = choose_blocks(m, k, n, block_n, block_k, splits)
    x_pad = jnp.pad(x, ((0, blocks.rows - m), (0, 0)))  # [Mp, K]
    f32 = jnp.dtype(x.dtype) == jnp.float32
    kernel = functools.partial(
        _kernel,
        blocks=blocks,
        steps=k // blocks.block_k // blocks.splits,
        precision=jax.lax.Precision.HIGHEST if f32 else None,
    )
    split = blocks.splits > 1
    out_shape = jax.ShapeDtypeStruct(
        (blocks.splits, blocks.rows, n) if split else (blocks.rows, n),
        jnp.float32 if split else x.dtype,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n // blocks.block_n, blocks.splits),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES
        ),
        cost_estimate=cost_estimate(m, k, n, x.dtype, w.dtype),
        interpret=interpret,
        name="quantized_matmul",
    )(x_pad, w, scale.astype(jnp.float32))
    if split:  # [splits, Mp, N] float32 partial sums
        return (out[:, :m].sum(0) * scale.astype(jnp.float32)).astype(x.dtype)
    return out[:m]


def cost_estimate(m: int, k: int, n: int, x_dtype, w_dtype) -> pl.CostEstimate:
    """Flops and HBM bytes of one call: the weight read once, ``x`` and the output."""
    x_bytes = jnp.dtype(x_dtype).itemsize
    return pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=n * k * jnp.dtype(w_dtype).itemsize + 4 * n + x_bytes * (m * k + m * n),
    )
