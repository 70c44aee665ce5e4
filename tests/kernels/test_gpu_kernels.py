"""The Pallas GPU (Triton lowering) kernels: attention and the KV-cache write.

On CPU the kernels run with ``interpret=True`` (their logic: request lookup, paged
gathers, masks, online softmax, masked stores) against the reference on random ragged
batches, and their Triton lowering is exported for CUDA without a GPU (block shapes
the lowering accepts). On a GPU machine the `gpu` tests run the compiled kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels.kv_cache_update import gpu as kv_gpu
from pallas_kernels.ragged_paged_attention import gpu, reference
from tests.kernels.ragged_batches import (
    TOLERANCE,
    Shape,
    build,
    check_kernel,
    relative_error,
    shapes,
)

# Shape(page_size, num_kv_heads, group, head_dim, q_lens, ctx_lens, pad_reqs, pad_tokens,
#       sliding_window, soft_cap)
PURE_DECODE = Shape(16, 2, 4, 128, (1,) * 6, (0, 3, 15, 16, 40, 79), 2, 2, None, None)
LONG_PREFILL_LAST = Shape(8, 1, 2, 64, (1, 3, 24), (12, 5, 70), 1, 3, None, 30.0)
GROUP_OF_3 = Shape(8, 2, 3, 64, (5, 1, 11), (20, 7, 33), 0, 1, 9, None)
HEAD_DIM_256 = Shape(16, 1, 4, 256, (1, 9), (50, 16), 1, 0, 12, 2.0)
ALL_PADDING = Shape(8, 2, 2, 64, (0, 0), (0, 0), 3, 4, None, None)
EDGES = (PURE_DECODE, LONG_PREFILL_LAST, GROUP_OF_3, HEAD_DIM_256, ALL_PADDING)


def _with_edge_cases(test):
    for i, shape in enumerate(EDGES):
        test = example(shape=shape, seed=i)(test)
    return test


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=8, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1))
@_with_edge_cases
def test_attention_matches_reference(dtype, shape, seed):
    check_kernel(gpu.ragged_paged_attention, build(shape, seed), dtype, interpret=True)


def test_small_blocks_split_requests_and_loop_over_kv():
    """16-row q blocks and 16-key steps: prefill chunks span many blocks and steps."""
    shape = Shape(8, 2, 2, 64, (13, 1, 21, 1), (12, 30, 3, 0), 1, 2, 10, None)
    batch = build(shape, 5)
    check_kernel(
        gpu.ragged_paged_attention, batch, "float32", interpret=True, block_m=16, block_n=16
    )


def test_never_reads_unused_cache_slots():
    """NaN in every slot no request owns (null page, spare pages, tails of last pages)."""
    batch = build(Shape(8, 2, 2, 64, (1, 6, 1), (9, 20, 0), 1, 2, None, None), 11)
    want = reference.ragged_paged_attention(*batch.args(), **batch.kwargs())
    cache = batch.kv_cache.copy()
    page_size = cache.shape[1]
    owned = np.zeros(cache.shape[:2], bool)
    for r in range(batch.num_seqs):
        n = int(batch.seq_lens[r])
        for pos in range(n):
            owned[batch.page_table[r, pos // page_size], pos % page_size] = True
    cache[~owned] = np.nan
    args = list(batch.args())
    args[1] = jnp.asarray(cache)
    got = np.asarray(gpu.ragged_paged_attention(*args, **batch.kwargs(), interpret=True))
    assert np.isfinite(got).all()
    real = batch.num_real_tokens
    assert relative_error(got[:real], np.asarray(want)[:real]) < TOLERANCE["float32"]
    np.testing.assert_array_equal(got[real:], 0.0)


def test_block_table():
    assert gpu.choose_blocks(64, 64, 4, 128) == (16, 64)  # decode-like
    assert gpu.choose_blocks(512, 16, 4, 128) == (64, 64)  # prefill chunks
    assert gpu.choose_blocks(512, 16, 4, 256) == (64, 32)  # head_dim 256: fewer keys
    assert gpu.choose_blocks(64, 64, 32, 128).block_m == 32  # one token's 32 heads


def test_block_sizes_are_checked():
    batch = build(PURE_DECODE, 0)
    with pytest.raises(ValueError, match="power of two"):
        gpu.ragged_paged_attention(*batch.args(), **batch.kwargs(), block_m=24, interpret=True)
    with pytest.raises(ValueError, match=">= 16"):  # tl.dot needs 16 rows on the GPU
        gpu.ragged_paged_attention(*batch.args(), **batch.kwargs(), block_n=8)


# --- the KV-cache write ------------------------------------------------------------

SENTINEL = 7.0


def _check_update(update, dtype, num_pages, page_size, hkv, head_dim, slots, seed=0):
    """Writes random K/V at `slots` into a poisoned cache; checks exactly those changed."""
    rng = np.random.default_rng(seed)
    num_slots = num_pages * page_size
    cache = jnp.full((num_pages, page_size, 2 * hkv, head_dim), SENTINEL, dtype)
    k = jnp.asarray(rng.standard_normal((len(slots), hkv, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((len(slots), hkv, head_dim)), dtype)
    out = update(cache, k, v, jnp.asarray(slots, jnp.int32))
    assert out.shape == cache.shape and out.dtype == cache.dtype
    flat = np.asarray(out.astype(jnp.float32)).reshape(num_slots, 2 * hkv, head_dim)
    k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
    kept = {s: t for t, s in enumerate(slots) if 0 <= s < num_slots}
    for s, t in kept.items():
        np.testing.assert_array_equal(flat[s, 0::2], k[t])  # K of head h at 2h
        np.testing.assert_array_equal(flat[s, 1::2], v[t])  # V of head h at 2h + 1
    np.testing.assert_array_equal(np.delete(flat, list(kept), axis=0), SENTINEL)
    return len(kept)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "hkv, head_dim",
    [(2, 64), (3, 40)],  # 3 * 2 * 40 = 240 values a row: not a power of two
)
def test_update_writes_exactly_its_slots(dtype, hkv, head_dim):
    num_pages, page_size = 7, 8
    rng = np.random.default_rng(hkv)
    slots = rng.permutation(np.arange(num_pages * page_size + 30))[:40]  # some >= P*S
    slots[3] = -1  # negative: dropped, no wrap-around
    update = functools.partial(kv_gpu.update_kv_cache, interpret=True)
    kept = _check_update(update, dtype, num_pages, page_size, hkv, head_dim, slots)
    assert 0 < kept < len(slots)


# --- Triton lowering for CUDA, without a GPU ------------------------------------------

# jaxlib <= 0.10.2 emits the Triton IR in "__gpu$xla.gpu.triton"; later versions compile
# it while lowering (a CUDA compilation handler must be registered: a GPU jaxlib) and
# emit "triton_kernel_call_ffi".
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def _can_lower_for_cuda() -> bool:
    from jax._src.lib import triton, version

    return version <= (0, 10, 2) or triton.has_compilation_handler("cuda")


needs_cuda_lowering = pytest.mark.skipif(
    not _can_lower_for_cuda(), reason="this jaxlib compiles Triton only with CUDA support"
)


def _cuda_module(fn, *args) -> str:
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in TRITON_CALLS]
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)
    return exported(*args).mlir_module()


def _llama3_8b_args(num_tokens, num_reqs, max_pages=128, dtype=jnp.bfloat16):
    """Abstract arguments: Hq=32, Hkv=8, D=128, pages of 16 tokens."""
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((num_tokens, 32, 128), dtype),
        jax.ShapeDtypeStruct((4096, 16, 16, 128), dtype),
        jax.ShapeDtypeStruct((num_reqs,), i32),
        jax.ShapeDtypeStruct((num_reqs, max_pages), i32),
        jax.ShapeDtypeStruct((num_reqs + 1,), i32),
        jax.ShapeDtypeStruct((), i32),
    )


@needs_cuda_lowering
@pytest.mark.parametrize(
    "args, options",
    [
        (_llama3_8b_args(64, 64), {}),  # decode batch
        (_llama3_8b_args(512, 16), dict(sliding_window=256, soft_cap=50.0)),  # mixed
    ],
    ids=["decode", "mixed"],
)
def test_attention_lowers_to_triton(args, options):
    fn = functools.partial(gpu.ragged_paged_attention, sm_scale=128**-0.5, **options)
    module = _cuda_module(fn, *args)
    assert any(name in module for name in TRITON_CALLS)


@needs_cuda_lowering
def test_lowering_test_rejects_bad_blocks(monkeypatch):
    """The lowering check has teeth: a 24-row block (not a power of two) fails it."""
    monkeypatch.setattr(gpu, "_check_block", lambda *_: None)
    fn = functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, block_m=24)
    with pytest.raises(ValueError, match="power of 2"):
        _cuda_module(fn, *_llama3_8b_args(64, 64))


@needs_cuda_lowering
def test_update_lowers_to_triton():
    cache = jax.ShapeDtypeStruct((2048, 16, 16, 128), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((512,), jnp.int32)
    module = _cuda_module(kv_gpu.update_kv_cache, cache, new, new, slots)
    assert any(name in module for name in TRITON_CALLS)


# --- on a GPU: the compiled kernels ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=30, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1))
@_with_edge_cases
def test_attention_matches_reference_on_gpu(dtype, shape, seed):
    check_kernel(gpu.ragged_paged_attention, build(shape, seed), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_on_gpu(dtype):
    slots = np.array([5, 71, 80, -1, 30, 2000, 0], np.int32)
    assert _check_update(kv_gpu.update_kv_cache, dtype, 9, 8, 2, 64, slots) == 4
