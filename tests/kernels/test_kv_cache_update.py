"""The KV-cache write, every implementation: exactly the named slots change.

The cache is poisoned with a sentinel; after the write, each kept token's K and V sit
at its slot (K of head h at 2h, V at 2h + 1), dropped slots (past the end, negative)
change nothing, and every other byte still holds the sentinel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache_update import reference, tpu

IMPLEMENTATIONS = {
    "reference": reference.update_kv_cache,
    "tpu-interpret": functools.partial(tpu.update_kv_cache, interpret=True),
}
SENTINEL = 7.0


def _write(update, dtype, num_pages, page_size, hkv, head_dim, slots, seed=0):
    rng = np.random.default_rng(seed)
    num_tokens = len(slots)
    cache = jnp.full((num_pages, page_size, 2 * hkv, head_dim), SENTINEL, dtype)
    k = jnp.asarray(rng.standard_normal((num_tokens, hkv, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, hkv, head_dim)), dtype)
    out = update(cache, k, v, jnp.asarray(slots, jnp.int32))
    assert out.shape == cache.shape and out.dtype == cache.dtype
    return np.asarray(out.astype(jnp.float32)), np.asarray(k, np.float32), np.asarray(v, np.float32)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_tokens", [3, 70])  # 70: more than one block of tokens
def test_writes_exactly_its_slots(name, dtype, num_tokens):
    num_pages, page_size, hkv, head_dim = 9, 8, 2, 64
    num_slots = num_pages * page_size
    rng = np.random.default_rng(num_tokens)
    slots = rng.permutation(np.arange(page_size, num_slots + 40))[:num_tokens]  # some past end
    slots[1] = -3  # negative: dropped, no wrap-around
    out, k, v = _write(IMPLEMENTATIONS[name], dtype, num_pages, page_size, hkv, head_dim, slots)
    flat = out.reshape(num_slots, 2 * hkv, head_dim)
    kept = [(t, s) for t, s in enumerate(slots) if 0 <= s < num_slots]
    assert len(kept) < num_tokens
    for t, s in kept:
        np.testing.assert_array_equal(flat[s, 0::2], k[t])
        np.testing.assert_array_equal(flat[s, 1::2], v[t])
    untouched = np.delete(flat, [s for _, s in kept], axis=0)
    np.testing.assert_array_equal(untouched, SENTINEL)


def test_tpu_kernel_lowers_for_tpu():
    """The kernel lowers to a Mosaic custom call for TPU (Llama-3-8B layout, bf16)."""
    cache = jax.ShapeDtypeStruct((2048, 16, 16, 128), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((512,), jnp.int32)
    exported = jax.export.export(jax.jit(tpu.update_kv_cache), platforms=["tpu"])(
        cache, new, new, slots
    )
    assert "tpu_custom_call" in exported.mlir_module()
