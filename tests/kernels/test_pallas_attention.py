"""The Pallas attention kernels (TPU: Mosaic, GPU: Triton) against the reference.

On CPU both run in interpret mode: the TPU kernel under TPU interpret mode (its DMAs,
semaphores and double-buffered page copies simulated), the GPU kernel with
``interpret=True``; these tests check the kernels' logic on random ragged batches.
The lowering tests check that Pallas turns each into its device's custom call (a
Mosaic kernel for TPU, a Triton kernel for CUDA) without the device. On a GPU or TPU
machine the `gpu` / `tpu` tests run the real kernels.
"""

from __future__ import annotations

import dataclasses
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
    jitted,
    jitted_reference,
    lowers_for,
    poison_unowned,
    random_sinks,
    relative_error,
    shapes,
)

KERNELS = {"tpu": tpu.ragged_paged_attention, "gpu": gpu.ragged_paged_attention}

DECODE = Shape(16, 2, 4, 128, (1,) * 5, (3, 17, 40, 64, 0), 2, 3, None, None)
LONG_CHUNK = Shape(8, 1, 3, 64, (1, 2, 24), (9, 30, 70), 0, 0, None, 30.0)
WINDOWED = Shape(16, 2, 2, 256, (7, 1), (33, 50), 1, 0, 5, 2.0)
ALL_PADDING = Shape(8, 1, 1, 64, (0,), (0,), 3, 4, None, None)
# chunked local attention (Llama 4): prefills crossing chunk boundaries, decodes at a
# chunk's first and last position; chunks smaller and larger than a KV block
CHUNKED = Shape(8, 2, 2, 64, (21, 1, 1, 9), (3, 16, 31, 40), 1, 2, None, None, 16)
CHUNKED_WINDOW = Shape(4, 1, 4, 64, (30, 1, 7), (5, 23, 0), 0, 3, 5, None, 8)


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=4, deadline=None)  # 4 random batches beside the 4 fixed ones
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1))
@example(shape=DECODE, seed=0)
@example(shape=LONG_CHUNK, seed=1)
@example(shape=WINDOWED, seed=2)
@example(shape=ALL_PADDING, seed=3)
@example(shape=CHUNKED, seed=4)
@example(shape=CHUNKED_WINDOW, seed=5)
def test_matches_reference(platform, dtype, shape, seed):
    check_kernel(KERNELS[platform], build(shape, seed), dtype, interpret=True)


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("shape", [DECODE, LONG_CHUNK, WINDOWED], ids=["decode", "chunk", "window"])
def test_fp8_cache_matches_reference(platform, cache_dtype, shape):
    """``--kv-cache-dtype fp8``: the kernels widen the 8-bit pages after loading them."""
    check_kernel(KERNELS[platform], build(shape, 7), "float32", cache_dtype, interpret=True)


@pytest.mark.parametrize("platform", sorted(KERNELS))
@settings(max_examples=2, deadline=None)  # 2 random batches beside the 4 fixed ones
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1))
@example(shape=DECODE, seed=30)
@example(shape=LONG_CHUNK, seed=31)
@example(shape=WINDOWED, seed=32)
@example(shape=CHUNKED, seed=33)
def test_sinks_match_reference(platform, shape, seed):
    """Attention sinks (gpt-oss): each score row's sink joins its denominator at the end."""
    batch = build(shape, seed)
    sinks = random_sinks(batch, seed)
    check_kernel(KERNELS[platform], batch, "float32", sinks=sinks, interpret=True)


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_sinks_of_minus_infinity_are_no_sinks(platform):
    """A sink of -inf is no sink; finite sinks change the output (bfloat16 too)."""
    batch = build(LONG_CHUNK, 31)
    kernel = functools.partial(KERNELS[platform], **batch.kwargs(), interpret=True)
    plain = np.asarray(kernel(*batch.args()))
    hq, real = batch.q.shape[1], batch.num_real_tokens
    minus_inf = kernel(*batch.args(), sinks=jnp.full((hq,), -jnp.inf))
    np.testing.assert_allclose(np.asarray(minus_inf), plain, rtol=1e-6, atol=1e-6)
    finite = np.asarray(kernel(*batch.args(), sinks=jnp.asarray(random_sinks(batch, 31))))
    assert relative_error(finite[:real], plain[:real]) > 1e-3
    check_kernel(
        KERNELS[platform], batch, "bfloat16", sinks=random_sinks(batch, 32), interpret=True
    )


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
def test_small_blocks_cross_attention_chunks(platform):
    """Chunked attention with several KV blocks per chunk and q blocks spanning chunk
    boundaries: the first page block a row needs starts mid-request."""
    batch = build(Shape(8, 2, 2, 64, (19, 1, 11, 1), (12, 40, 3, 31), 1, 2, None, None, 24), 8)
    check_kernel(KERNELS[platform], batch, "float32", interpret=True, **SMALL_BLOCKS[platform])


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_small_blocks_with_sinks(platform):
    """Sinks with q blocks spanning requests (TPU: score rows of several requests in
    one block, each with its head's sink) and one KV head per block."""
    batch = build(Shape(8, 2, 2, 64, (5, 1, 11, 1), (12, 30, 3, 0), 1, 2, 10, None), 33)
    sinks = random_sinks(batch, 33)
    check_kernel(
        KERNELS[platform], batch, "float32", sinks=sinks, interpret=True, **SMALL_BLOCKS[platform]
    )


@pytest.mark.parametrize("kernel_kwargs", [{}, {"heads_per_block": 1}], ids=["whole", "split"])
@pytest.mark.parametrize("shape", [DECODE, LONG_CHUNK], ids=["decode", "chunk"])
def test_padded_cache_reads_only_its_real_heads(kernel_kwargs, shape):
    """A TPU cache's head axis padded past ``2 * Hkv`` (Phi-4 at TP 2: 5 heads' 10 rows
    to 16, `layers.attention.kv_cache_shape`), NaN in the padding: the TPU kernel and
    the reference, told ``num_kv_heads``, equal the reference on the unpadded cache
    (a block of every head copies the padding to VMEM; a block of one head does not)."""
    batch = build(dataclasses.replace(shape, num_kv_heads=5, group=2), 13)
    want = np.asarray(jitted_reference(**batch.kwargs())(*batch.args()))
    args = list(batch.args())
    pad = ((0, 0), (0, 0), (0, 16 - args[1].shape[2]), (0, 0))
    args[1] = jnp.pad(args[1], pad, constant_values=jnp.nan)
    real = batch.num_real_tokens
    kernel = functools.partial(tpu.ragged_paged_attention, interpret=True, **kernel_kwargs)
    for fn in (kernel, reference.ragged_paged_attention):
        got = np.asarray(jitted(fn, **batch.kwargs(), num_kv_heads=5)(*args))
        assert np.isfinite(got).all()
        assert relative_error(got[:real], want[:real]) < TOLERANCE["float32"]
        np.testing.assert_array_equal(got[real:], 0.0)


@pytest.mark.parametrize("kernel_kwargs", [{}, {"heads_per_block": 1}], ids=["whole", "split"])
def test_a_row_padded_to_128_lanes_reads_its_head_dim(kernel_kwargs):
    """A TPU cache's 64-value rows padded with zeros to 128 lanes (gpt-oss,
    `layers.attention.kv_cache_shape`; the writes put the zeros there): the TPU kernel
    (``q`` padded to the row, the output cut back) and the reference equal the
    reference on the unpadded cache, for decodes and prefill chunks with sinks."""
    batch = build(dataclasses.replace(LONG_CHUNK, num_kv_heads=2, group=2), 21)
    sinks = jnp.asarray(random_sinks(batch, 21))
    want = np.asarray(jitted_reference(**batch.kwargs())(*batch.args(), sinks=sinks))
    args = list(batch.args())
    args[1] = jnp.pad(args[1], ((0, 0), (0, 0), (0, 0), (0, 128 - args[1].shape[3])))
    real = batch.num_real_tokens
    kernel = functools.partial(tpu.ragged_paged_attention, interpret=True, **kernel_kwargs)
    for fn in (kernel, reference.ragged_paged_attention):
        got = np.asarray(jitted(fn, **batch.kwargs())(*args, sinks=sinks))
        assert got.shape == want.shape
        assert relative_error(got[:real], want[:real]) < TOLERANCE["float32"]
        np.testing.assert_array_equal(got[real:], 0.0)


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_never_reads_unused_cache_slots(platform):
    """NaN in every slot no request owns (null page, spare pages, tails of last pages)."""
    batch = build(Shape(8, 2, 2, 64, (1, 6, 1), (9, 20, 0), 1, 2, None, None), 11)
    want = reference.ragged_paged_attention(*batch.args(), **batch.kwargs())
    cache = poison_unowned(batch)
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
        (_abstract(512, 16, 128), dict(attention_chunk_size=8192)),  # Llama 4 local layers
        (_abstract(512, 16, 128), dict(attention_chunk_size=48, sliding_window=100)),
    ],
)
def test_lowers_for_its_device(platform, args, options):
    kernel = KERNELS["tpu" if platform == "tpu" else "gpu"]
    assert lowers_for(functools.partial(kernel, sm_scale=0.1, **options), platform, *args)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize(
    "args", [_abstract(64, 64, 128, hq=64, hkv=8, head_dim=64), _abstract(512, 16, 128)],
    ids=["decode-gpt-oss-heads", "prefill"],
)  # fmt: skip
def test_lowers_with_sinks(platform, args):
    """gpt-oss's layers: sinks [Hq] beside a sliding window lower to one kernel call."""
    kernel = KERNELS["tpu" if platform == "tpu" else "gpu"]
    sinks = jax.ShapeDtypeStruct((args[0].shape[1],), jnp.float32)
    fn = functools.partial(kernel, sm_scale=0.125, sliding_window=128)
    assert lowers_for(lambda *a: fn(*a[:-1], sinks=a[-1]), platform, *args, sinks)


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


@pytest.mark.parametrize("tokens, requests", [(64, 64), (512, 16)], ids=["decode", "prefill"])
def test_sinks_compile_for_v6e(tokens, requests):
    """libtpu's Mosaic compiler takes the TPU kernel with sinks (and a window) at
    gpt-oss's heads: 64 query heads of 64 features over 8 KV heads, bfloat16, sized
    for v6e's scoped VMEM. Skipped where libtpu (the tpu extra) is absent."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxengine.hardware import chip_named, slice_of
    from jaxengine.tpu_check.check import tpu_devices

    mesh = Mesh(tpu_devices(slice_of("v6e-1"))[:1], ("x",))
    placed = NamedSharding(mesh, PartitionSpec())

    def shape(dims, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=placed)

    args = (
        shape((tokens, 64, 64), jnp.bfloat16),
        shape((4096, 16, 16, 64), jnp.bfloat16),
        shape((requests,)),
        shape((requests, 512)),
        shape((requests + 1,)),
        shape(()),
        shape((64,), jnp.float32),
    )
    attention = functools.partial(
        tpu.ragged_paged_attention, sm_scale=0.125, sliding_window=128,
        vmem_limit_bytes=chip_named("v6e").vmem_limit_bytes,
    )  # fmt: skip
    compiled = jax.jit(lambda *a: attention(*a[:-1], sinks=a[-1])).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
