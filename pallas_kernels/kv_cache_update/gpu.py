"""The KV-cache write as a Pallas GPU kernel (Triton lowering): one program per token.

Same signature and semantics as `reference.update_kv_cache`. The cache is aliased to
the output (donate it and the write is in place). Each program loads its token's
``2 * Hkv * D`` values (K and V interleaved in the wrapper: a copy of only the new
tokens) and stores them at its slot of the cache viewed as ``[P * S, 2 * Hkv * D]``,
with a masked store: a slot outside ``[0, P * S)`` writes nothing, and no other byte
of the cache is touched. The row is processed in power-of-two chunks of at most
``CHUNK`` values (Triton's block shapes are powers of two). `write_rows` is the kernel
on rows already in the cache's order; the MLA write (`pallas_kernels.mla.gpu`) uses it
for its latent rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_cache_update.reference import interleave

CHUNK = 2048


def _kernel(slots_ref, new_ref, cache_ref, out_ref, *, row: int, chunk: int):
    del cache_ref  # the same buffer as out_ref (aliased)
    t = pl.program_id(0)
    slot = slots_ref[t]
    keep = (slot >= 0) & (slot < out_ref.shape[0])
    target = jnp.where(keep, slot, out_ref.shape[0])  # past the end when dropped
    for start in range(0, row, chunk):
        cols = start + jnp.arange(chunk, dtype=jnp.int32)
        ok = cols < row
        # no fill value: a masked lane is never stored (and Triton's lowering casts no
        # integer fill to an 8-bit float: an fp8 cache failed to compile on a GPU)
        values = plgpu.load(new_ref.at[t, jnp.minimum(cols, row - 1)], mask=ok)
        # unclamped columns: interpret mode's masked store writes the old value back, so
        # a masked lane must not share an address with a kept one (past the row: dropped)
        plgpu.store(out_ref.at[target, cols], values, mask=ok & keep)


@functools.partial(jax.jit, static_argnames=("interpret",))
def update_kv_cache(
    kv_cache: jax.Array,  # [P, S, 2*Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32
    *,
    interpret: bool = False,
) -> jax.Array:
    """Writes each token's K and V into its slot; returns the cache.

    In place when the caller's jit donates ``kv_cache`` (the engine's step does).
    """
    new = interleave(k, v, kv_cache.dtype, *kv_cache.shape[2:])
    return write_rows(kv_cache, new, slot_mapping, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_rows(
    kv_cache: jax.Array,  # [P, S, *row]
    new: jax.Array,  # [T, *row], in the cache's dtype
    slot_mapping: jax.Array,  # [T] int32
    *,
    interpret: bool = False,
) -> jax.Array:
    """Writes ``new[t]`` (one slot's worth, in the cache's order: K and V interleaved,
    or an MLA latent row, `pallas_kernels.mla.gpu`) into slot ``slot_mapping[t]``;
    returns the cache, aliased to it."""
    num_pages, page_size = kv_cache.shape[:2]
    num_tokens = new.shape[0]
    row = math.prod(kv_cache.shape[2:])
    new = new.reshape(num_tokens, row)
    chunk = min(CHUNK, 1 << (row - 1).bit_length())
    out = pl.pallas_call(
        functools.partial(_kernel, row=row, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct((num_pages * page_size, row), kv_cache.dtype),
        grid=(num_tokens,),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=2 * new.size * new.dtype.itemsize
        ),
        interpret=interpret,
    )(slot_mapping.astype(jnp.int32), new, kv_cache.reshape(num_pages * page_size, row))
    return out.reshape(kv_cache.shape)
