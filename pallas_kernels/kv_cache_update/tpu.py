"""The KV-cache write as a Pallas TPU kernel: one HBM -> HBM DMA per token.

Same signature and semantics as `reference.update_kv_cache`. The cache never leaves
HBM: it is aliased to the output (donate it and the write is in place), and each new
token's ``[2 * Hkv, D]`` row of K and V (interleaved in the wrapper, a copy of only
the new tokens; zeros to fill a padded cache's rows and lanes) is copied straight to
its slot. Slot ids come in by scalar prefetch; a slot outside ``[0, num_pages *
page_size)`` is skipped, so padding tokens cost nothing and no other byte of the cache
is touched.

The grid walks the tokens in blocks of ``tokens_per_block``: each step starts one DMA
per token of its block, then waits for all of them, which bounds the DMAs in flight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache_update.reference import interleave

TOKENS_PER_BLOCK = 64


def _kernel(slots_ref, new_hbm, cache_hbm, out_hbm, sem, *, num_tokens, tb, page_size):
    del cache_hbm  # the same buffer as out_hbm (aliased)
    base = pl.program_id(0) * tb
    num_slots = out_hbm.shape[0] * page_size

    def copy(i):
        t = jnp.minimum(base + i, num_tokens - 1)
        slot = slots_ref[t]
        keep = (base + i < num_tokens) & (slot >= 0) & (slot < num_slots)
        slot = jnp.where(keep, slot, 0)
        page = jax.lax.div(slot, page_size)
        offset = jax.lax.rem(slot, page_size)
        return keep, pltpu.make_async_copy(new_hbm.at[t], out_hbm.at[page, offset], sem)

    def start(i, carry):
        keep, dma = copy(i)
        pl.when(keep)(dma.start)
        return carry

    def wait(i, carry):
        keep, dma = copy(i)
        pl.when(keep)(dma.wait)
        return carry

    jax.lax.fori_loop(0, tb, start, 0)
    jax.lax.fori_loop(0, tb, wait, 0)


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
    page_size, rows, width = kv_cache.shape[1:]
    num_tokens = k.shape[0]
    new = interleave(k, v, kv_cache.dtype, rows, width)  # [T, rows, W]: a padded cache's zeros
    tb = min(TOKENS_PER_BLOCK, num_tokens)
    kernel = functools.partial(_kernel, num_tokens=num_tokens, tb=tb, page_size=page_size)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(num_tokens, tb),),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={2: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), has_side_effects=True
        ),
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=2 * new.size * new.dtype.itemsize
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(slot_mapping.astype(jnp.int32), new, kv_cache)
