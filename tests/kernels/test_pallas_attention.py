"""The Pallas attention kernels (TPU: Mosaic, GPU: Triton) against the reference.

On CPU both run in interpret mode: the TPU kernel under TPU interpret mode (its DMAs,
semaphores and double-buffered page copies simulated), the GPU kernel with
``interpret=True``; these tests check the kernels' logic on random ragged batches.
The lowering tests check that Pallas turns each into its device's custom call (a
Mosaic kernel for TPU, a Triton kernel for CUDA) without the device. On a GPU or TPU
machine the `gpu` / `tpu` tests run the real kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention import gpu, reference, tpu
from tests.kernels.ragged_batches import (
    TOLERANCE,
    Shape,
    build,
    check_kernel,
    lowers_for,
    relative_error,
    shapes,
)

KERNELS = {"tpu": tpu.ragged_paged_attention, "gpu": gpu.ragged_paged_attention}

DECODE = Shape(16, 2, 4, 128, (1,) * 5, (3, 17, 40, 64, 0), 2, 3, None, None)
LONG_CHUNK = Shape(8, 1, 3, 64, (1, 2, 24), (9, 30, 70), 0, 0, None, 30.0)
WINDOWED = Shape(16, 2, 2, 256, (7, 1), (33, 50), 1, 0, 5, 2.0)
ALL_PADDING = Shape(8, 1, 1, 64, (0,), (0,), 3, 4, None, None)


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=4, deadline=None)  # 4 random batches beside the 4 fixed ones
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1))
@example(shape=DECODE, seed=0)
@example(shape=LONG_CHUNK, seed=1)
@example(shape=WINDOWED, seed=2)
@example(shape=ALL_PADDING, seed=3)
def test_matches_reference(platform, dtype, shape, seed):
    check_kernel(KERNELS[platform], build(shape, seed), dtype, interpret=True)


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("shape", [DECODE, LONG_CHUNK, WINDOWED], ids=["decode", "chunk", "window"])
def test_fp8_cache_matches_reference(platform, cache_dtype, shape):
    """``--kv-cache-dtype fp8``: the kernels widen the 8-bit pages after loading them."""
    check_kernel(KERNELS[platform], build(shape, 7), "float32", cache_dtype, interpret=True)


# Small blocks: q blocks span requests, requests span many KV blocks.
SMALL_BLOCKS = {
    "tpu": dict(block_q=8, pages_per_block=1, heads_per_block=1),
    "gpu": dict(block_m=4, block_n=16),
}


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_small_blocks_cross_request_and_page_boundaries(platform):
    batch = build(Shape(8, 2, 2, 64, (5, 1, 11, 1), (12, 30, 3, 0), 1, 2, 10, None), 7)
    check_kernel(KERNELS[platform], batch, "float32", interpret=True, **SMALL_BLOCKS[platform])


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_never_reads_unused_cache_slots(platform):
    """NaN in every slot no request owns (null page, spare pages, tails of last pages)."""
    batch = build(Shape(8, 2, 2, 64, (1, 6, 1), (9, 20, 0), 1, 2, None, None), 11)
    want = reference.ragged_paged_attention(*batch.args(), **batch.kwargs())
    cache = batch.kv_cache.copy()
    page_size = cache.shape[1]
    owned = np.zeros(cache.shape[:2], bool)
    for r in range(batch.num_seqs):
        for pos in range(int(batch.seq_lens[r])):
            owned[batch.page_table[r, pos // page_size], pos % page_size] = True
    cache[~owned] = np.nan
    args = list(batch.args())
    args[1] = jnp.asarray(cache)
    got = np.asarray(KERNELS[platform](*args, **batch.kwargs(), interpret=True))
    assert np.isfinite(got).all()
    real = batch.num_real_tokens
    assert relative_error(got[:real], np.asarray(want)[:real]) < TOLERANCE["float32"]
    np.testing.assert_array_equal(got[real:], 0.0)


def test_block_tables():
    decode = tpu.choose_blocks(64, 64, 8, 4, 16, 128, 128, jnp.bfloat16)
    assert decode == tpu.Blocks(block_q=16, pages_per_block=16, heads_per_block=8)
    prefill = tpu.choose_blocks(512, 8, 8, 4, 16, 128, 128, jnp.float32)
    assert prefill.block_q == 64
    small_vmem = tpu.choose_blocks(512, 8, 8, 4, 16, 128, 256, jnp.float32, 4 << 20)
    assert small_vmem.heads_per_block < 8
    assert tpu.vmem_bytes(small_vmem, 4, 16, 256, jnp.float32) <= 4 << 20
    assert gpu.choose_blocks(64, 64, 4, 128) == (16, 64)  # decode-like
    assert gpu.choose_blocks(512, 16, 4, 128) == (64, 64)  # prefill chunks
    assert gpu.choose_blocks(512, 16, 4, 256) == (64, 32)  # head_dim 256: fewer keys
    assert gpu.choose_blocks(64, 64, 32, 128).block_m == 32  # one token's 32 heads


def _abstract(
    num_tokens, num_reqs, max_pages, hq=32, hkv=8, head_dim=128, dtype=jnp.bfloat16, cache=None
):
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((num_tokens, hq, head_dim), dtype),
        jax.ShapeDtypeStruct((4096, 16, 2 * hkv, head_dim), cache or dtype),
        jax.ShapeDtypeStruct((num_reqs,), i32),
        jax.ShapeDtypeStruct((num_reqs, max_pages), i32),
        jax.ShapeDtypeStruct((num_reqs + 1,), i32),
        jax.ShapeDtypeStruct((), i32),
    )


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize(
    "args, options",
    [
        (_abstract(64, 64, 128), {}),  # decode batch, Llama-3-8B layout
        (_abstract(512, 16, 128), dict(sliding_window=256, soft_cap=50.0)),  # mixed
        (_abstract(64, 8, 32, hq=8, hkv=1, head_dim=256, dtype=jnp.float32), {}),
        (_abstract(64, 64, 128, cache=jnp.float8_e4m3fn), {}),  # --kv-cache-dtype fp8
    ],
)
def test_lowers_for_its_device(platform, args, options):
    kernel = KERNELS["tpu" if platform == "tpu" else "gpu"]
    assert lowers_for(functools.partial(kernel, sm_scale=0.1, **options), platform, *args)


@pytest.mark.tpu
@settings(max_examples=20, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1))
def test_matches_reference_on_tpu(shape, seed):
    check_kernel(tpu.ragged_paged_attention, build(shape, seed), "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=20, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1))
def test_matches_reference_on_gpu(dtype, shape, seed):
    check_kernel(gpu.ragged_paged_attention, build(shape, seed), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("shape", [DECODE, LONG_CHUNK, WINDOWED], ids=["decode", "chunk", "window"])
def test_fp8_cache_matches_reference_on_gpu(cache_dtype, shape):
    check_kernel(gpu.ragged_paged_attention, build(shape, 7), "bfloat16", cache_dtype)
