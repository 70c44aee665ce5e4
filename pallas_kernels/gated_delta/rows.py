"""Writing requests' rows of a state pool in place as a Pallas TPU kernel: one HBM ->
HBM DMA a row.

Its reference is `reference.write_rows`: ``pool[rows[r]] = states[r]`` where
``keep[r]``, every other row as it was. The Gated DeltaNet layer writes the causal
convolution's windows (``[S, conv_dim * (K - 1)]``) back with it on TPU: as an XLA
scatter, the pool (9 MiB a chip for Qwen3.5 at TP 4 and 256 requests) is small
enough for XLA to stage it whole in VMEM around the scatter and copy it back to HBM
every step (a whole-pool copy, which the audit of `jaxengine.tpu_check` reports);
this kernel's DMAs touch the pool only at the rows written. The pool is aliased to
the output (donate it). All copies start, then all are waited for (one semaphore;
every copy is one row, the same size).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(rows_ref, keep_ref, states_hbm, pool_hbm, out_hbm, sem):
    del pool_hbm  # aliased to out_hbm

    def copy(r):
        return pltpu.make_async_copy(states_hbm.at[r], out_hbm.at[rows_ref[r]], sem)

    def start(r, carry):
        @pl.when(keep_ref[r] != 0)
        def _():
            copy(r).start()

        return carry

    def wait(r, carry):
        @pl.when(keep_ref[r] != 0)
        def _():
            copy(r).wait()

        return carry

    jax.lax.fori_loop(0, rows_ref.shape[0], start, 0)
    jax.lax.fori_loop(0, rows_ref.shape[0], wait, 0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_rows(
    pool: jax.Array,  # [S, ...]
    rows: jax.Array,  # [R] int32
    keep: jax.Array,  # [R] bool
    states: jax.Array,  # [R, ...]
    *,
    interpret: bool = False,
) -> jax.Array:
    """`reference.write_rows` in place: ``pool`` with ``states[r]`` in row ``rows[r]``
    where ``keep[r]`` (the rows kept are distinct)."""
    if states.shape[1:] != pool.shape[1:] or not rows.shape == keep.shape == states.shape[:1]:
        raise ValueError(f"pool {pool.shape}, rows {rows.shape}, states {states.shape}")
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    row_bytes = states.size // max(states.shape[0], 1) * pool.dtype.itemsize
    call = pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            in_specs=[hbm, hbm],
            out_specs=hbm,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={3: 0},
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=2 * rows.shape[0] * row_bytes
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    rows = jnp.where(keep, rows, 0).astype(jnp.int32)  # a row not written: any valid index
    if not interpret:  # XLA stages a small pool in VMEM around a custom call too
        pool = pltpu.with_memory_space_constraint(pool, pltpu.HBM)
    return call(rows, keep.astype(jnp.int32), states.astype(pool.dtype), pool)
