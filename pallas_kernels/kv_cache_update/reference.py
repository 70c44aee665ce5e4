"""Pure-jnp reference of the KV-cache write: XLA's scatter, in place when donated.

The cache layout is the attention kernels' (`pallas_kernels.ragged_paged_attention`):
``[num_pages, page_size, 2 * num_kv_heads, head_dim]``, K and V interleaved on axis 2.
Token ``t`` goes to slot ``slot_mapping[t] = page * page_size + offset``. A cache with
more rows than ``2 * num_kv_heads``, or rows wider than ``head_dim`` (both padded on
TPU, `jaxengine.models.layers.attention.kv_cache_shape`), gets zeros in the padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def update_kv_cache(
    kv_cache: jax.Array,  # [P, S, 2*Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32, page * page_size + offset
) -> jax.Array:
    """Writes each token's K and V into its slot; returns the updated cache.

    Slots outside ``[0, num_pages * page_size)`` are dropped (a padding token may use
    one, or point into the reserved null page 0). Donate ``kv_cache`` so XLA updates in place.
    """
    num_pages, page_size, rows, head_dim = kv_cache.shape
    kv = interleave(k, v, kv_cache.dtype, rows, head_dim)  # [T, rows, W]
    flat = kv_cache.reshape(num_pages * page_size, rows, head_dim)
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # no wrap-around
    flat = flat.at[slots].set(kv, mode="drop")
    return flat.reshape(kv_cache.shape)


def interleave(
    k: jax.Array, v: jax.Array, dtype, rows: int | None = None, width: int | None = None
) -> jax.Array:
    """``[T, Hkv, D]`` K and V -> ``[T, 2 * Hkv, D]`` in the cache's order and dtype;
    with ``rows`` (a padded cache's head axis) zeros after them, with ``width`` (a
    padded cache's row) zeros after each row's ``D`` values: ``[T, rows, width]``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    kv = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    pad = 0 if rows is None else rows - 2 * num_kv_heads
    lanes = 0 if width is None else width - head_dim
    if pad < 0 or lanes < 0:
        raise ValueError(
            f"{num_kv_heads} KV heads of {head_dim} do not fit a cache of {rows} rows of {width}"
        )
    kv = jnp.pad(kv, ((0, 0), (0, pad), (0, lanes))) if pad or lanes else kv
    return to_cache_dtype(kv, dtype)


def to_cache_dtype(x: jax.Array, dtype) -> jax.Array:
    """``x`` stored as ``dtype``; into an 8-bit float cache (scale 1.0) values saturate
    at the format's largest instead of becoming NaN (float8_e4m3fn has no infinity)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        largest = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -largest, largest)
    return x.astype(dtype)
