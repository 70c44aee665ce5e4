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

from pallas_kernels.kv_cache_update import gpu, reference, tpu
from tests.kernels.ragged_batches import lowers_for

IMPLEMENTATIONS = {
    "reference": reference.update_kv_cache,
    "tpu-interpret": functools.partial(tpu.update_kv_cache, interpret=True),
    "gpu-interpret": functools.partial(gpu.update_kv_cache, interpret=True),
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
@pytest.mark.parametrize("hkv, head_dim", [(2, 64), (3, 40)])  # 240 values: not a power of 2
def test_writes_exactly_its_slots(name, dtype, num_tokens, hkv, head_dim):
    num_pages, page_size = 9, 8
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


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_an_fp8_cache_stores_rounded_saturated_values(name, cache_dtype):
    _check_fp8_write(IMPLEMENTATIONS[name], cache_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_an_fp8_cache_on_gpu(cache_dtype):
    _check_fp8_write(gpu.update_kv_cache, cache_dtype)


def _check_fp8_write(update, cache_dtype) -> None:
    dtype = jnp.dtype(cache_dtype)
    largest = float(jnp.finfo(dtype).max)
    cache = jnp.zeros((4, 8, 4, 16), dtype)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32)
    v = rng.standard_normal((3, 2, 16)).astype(np.float32)
    k[0, 0, :4] = [1e6, -1e6, 2 * largest, 500.0]  # past the format's range: saturate
    out = update(cache, jnp.asarray(k), jnp.asarray(v), jnp.array([9, 17, 30]))
    flat = np.asarray(out.astype(jnp.float32)).reshape(32, 4, 16)
    want_k = np.clip(k, -largest, largest).astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(flat[[9, 17, 30], 0::2], want_k)
    np.testing.assert_array_equal(flat[[9, 17, 30], 1::2], v.astype(dtype).astype(np.float32))
    assert np.isfinite(flat).all()


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_kernel_lowers_for_its_device(platform, cache_dtype):
    """Each kernel lowers to its custom call (Mosaic / Triton), Llama-3-8B layout, bf16
    values into a bf16 or an fp8 cache (``--kv-cache-dtype fp8``)."""
    cache = jax.ShapeDtypeStruct((2048, 16, 16, 128), cache_dtype)
    new = jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((512,), jnp.int32)
    fn = tpu.update_kv_cache if platform == "tpu" else gpu.update_kv_cache
    assert lowers_for(fn, platform, cache, new, new, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kernel_on_gpu(dtype):
    out, k, v = _write(gpu.update_kv_cache, dtype, 9, 8, 2, 64, [5, 71, 80, -1, 30])
    flat = out.reshape(72, 4, 64)
    for t, s in [(0, 5), (1, 71), (4, 30)]:
        np.testing.assert_array_equal(flat[s, 0::2], k[t])
        np.testing.assert_array_equal(flat[s, 1::2], v[t])
    np.testing.assert_array_equal(np.delete(flat, [5, 71, 30], axis=0), SENTINEL)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_a_padded_cache_gets_zeros_after_the_real_rows(name):
    """A TPU cache's head axis padded past ``2 * Hkv`` (5 heads' 10 rows to 16,
    `layers.attention.kv_cache_shape`): K and V go to rows ``2h`` and ``2h + 1`` as
    ever, the rows after them of each written slot become zeros, no other slot changes."""
    num_pages, page_size, hkv, head_dim, rows = 4, 8, 5, 128, 16
    rng = np.random.default_rng(5)
    cache = jnp.full((num_pages, page_size, rows, head_dim), SENTINEL, jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((3, hkv, head_dim)), jnp.float32) for _ in "kv")
    slots = np.array([9, -1, 30], np.int32)
    out = IMPLEMENTATIONS[name](cache, k, v, jnp.asarray(slots))
    flat = np.asarray(out).reshape(num_pages * page_size, rows, head_dim)
    for t in (0, 2):
        np.testing.assert_array_equal(flat[slots[t], 0 : 2 * hkv : 2], k[t])
        np.testing.assert_array_equal(flat[slots[t], 1 : 2 * hkv : 2], v[t])
        np.testing.assert_array_equal(flat[slots[t], 2 * hkv :], 0.0)
    np.testing.assert_array_equal(np.delete(flat, [9, 30], axis=0), SENTINEL)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_a_row_padded_to_128_lanes_gets_zeros_after_its_values(name):
    """A TPU cache's 64-value rows padded to 128 lanes (gpt-oss,
    `layers.attention.kv_cache_shape`): each written row holds K or V in its first 64
    lanes and zeros after them (the attention kernel multiplies them by ``q``'s zero
    padding), no other slot changes."""
    num_pages, page_size, hkv, head_dim = 4, 8, 1, 64
    rng = np.random.default_rng(6)
    cache = jnp.full((num_pages, page_size, 2 * hkv, 128), SENTINEL, jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((3, hkv, head_dim)), jnp.float32) for _ in "kv")
    slots = np.array([9, -1, 30], np.int32)
    out = IMPLEMENTATIONS[name](cache, k, v, jnp.asarray(slots))
    flat = np.asarray(out).reshape(num_pages * page_size, 2 * hkv, 128)
    for t in (0, 2):
        np.testing.assert_array_equal(flat[slots[t], 0::2, :head_dim], k[t])
        np.testing.assert_array_equal(flat[slots[t], 1::2, :head_dim], v[t])
        np.testing.assert_array_equal(flat[slots[t], :, head_dim:], 0.0)
    np.testing.assert_array_equal(np.delete(flat, [9, 30], axis=0), SENTINEL)
