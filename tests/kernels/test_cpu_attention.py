"""The CPU attention (request-major, `ragged_paged_attention.cpu`) against the reference.

Random ragged batches (`ragged_batches.shapes`: decodes, prefill chunks over cached
context, GQA groups, sliding windows, soft caps, padding requests and tokens), jitted
as the engine runs it, with the default blocks and with small ones, so that prefill
chunks span several query tiles and every request several KV chunks.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention import cpu
from tests.kernels.ragged_batches import (
    Shape,
    build,
    check_kernel,
    image_spans,
    jitted,
    jitted_reference,
    random_sinks,
    relative_error,
    shapes,
)

DECODE = Shape(16, 2, 4, 128, (1,) * 5, (3, 17, 40, 64, 0), 2, 3, None, None)
LONG_CHUNK = Shape(8, 1, 3, 64, (1, 2, 24), (9, 30, 70), 0, 0, None, 30.0)
WINDOWED = Shape(16, 2, 2, 256, (7, 1), (33, 50), 1, 0, 5, 2.0)
ALL_PADDING = Shape(8, 1, 1, 64, (0,), (0,), 3, 4, None, None)
# SmolLM2's heads: 9 query heads over 3 KV heads
SMOLLM2_MIXED = Shape(16, 3, 3, 64, (1, 1, 20, 1), (40, 0, 35, 17), 1, 2, None, None)
# chunked local attention (Llama 4): prefill chunks crossing chunk boundaries, decodes
# at a chunk's first and last position, a window inside the chunks
CHUNKED = Shape(8, 2, 2, 64, (21, 1, 1, 9), (3, 16, 31, 40), 1, 2, None, None, 16)
CHUNKED_WINDOW = Shape(4, 1, 4, 64, (30, 1, 7), (5, 23, 0), 0, 3, 5, None, 8)

BLOCKS = {"default": {}, "small": dict(kv_chunk=8, block_q=4)}


KERNELS = {name: functools.partial(cpu.ragged_paged_attention, **b) for name, b in BLOCKS.items()}


@settings(max_examples=5, deadline=None)
@given(
    shape=shapes(),
    seed=st.integers(0, 2**31 - 1),
    blocks=st.sampled_from(sorted(BLOCKS)),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
@example(shape=DECODE, seed=0, blocks="default", dtype="bfloat16")
@example(shape=LONG_CHUNK, seed=1, blocks="small", dtype="float32")
@example(shape=WINDOWED, seed=2, blocks="small", dtype="bfloat16")
@example(shape=ALL_PADDING, seed=3, blocks="default", dtype="float32")
@example(shape=SMOLLM2_MIXED, seed=4, blocks="small", dtype="float32")
@example(shape=SMOLLM2_MIXED, seed=5, blocks="default", dtype="bfloat16")
@example(shape=CHUNKED, seed=12, blocks="small", dtype="float32")
@example(shape=CHUNKED, seed=13, blocks="default", dtype="float32")
@example(shape=CHUNKED_WINDOW, seed=14, blocks="small", dtype="float32")
def test_matches_reference(shape, seed, blocks, dtype):
    check_kernel(KERNELS[blocks], build(shape, seed), dtype)


@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("shape", [DECODE, SMOLLM2_MIXED], ids=["decode", "mixed"])
def test_fp8_cache_matches_reference(shape, cache_dtype):
    """``--kv-cache-dtype fp8``: 8-bit pages gathered as bytes, widened after."""
    check_kernel(KERNELS["small"], build(shape, 11), "float32", cache_dtype)


def test_one_compile_serves_every_batch_of_a_shape():
    """Tile and chunk counts are loop bounds, not shapes: a decode batch and a prefill
    batch with the same (T, R, M) share one executable."""
    fn = jax.jit(functools.partial(cpu.ragged_paged_attention, sm_scale=0.125))
    decode = Shape(8, 1, 2, 64, (1,) * 4, (5, 9, 30, 2), 0, 12, None, None)
    decode = build(decode, 0, extra_pages=7)  # 16 pages, as the prefill's
    prefill = build(Shape(8, 1, 2, 64, (13, 1, 1, 1), (20, 3, 0, 34), 0, 0, None, None), 1)
    assert decode.q.shape == prefill.q.shape
    assert decode.kv_cache.shape == prefill.kv_cache.shape
    outs = []
    for batch in (decode, prefill):
        args = list(batch.args())
        pad = 8 - args[3].shape[1]  # the same page-table width for both
        args[3] = jax.numpy.pad(args[3], ((0, 0), (0, pad)))
        outs.append(np.asarray(fn(*args)))
    assert fn._cache_size() == 1
    assert all(np.isfinite(out).all() for out in outs)


@settings(max_examples=3, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1))
@example(shape=SMOLLM2_MIXED, seed=6)
def test_bidirectional_matches_reference(shape, seed):
    """``causal=False`` (an encoder's attention over its request's keys)."""
    batch = build(shape, seed)
    args = batch.args(jax.numpy.float32, None)
    want = jitted_reference(causal=False, **batch.kwargs())(*args)
    got = jitted(cpu.ragged_paged_attention, causal=False, **batch.kwargs())(*args)
    real = batch.num_real_tokens
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got)[real:], 0.0)


@settings(max_examples=3, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1), blocks=st.sampled_from(sorted(BLOCKS)))
@example(shape=LONG_CHUNK, seed=7, blocks="small")
@example(shape=WINDOWED, seed=8, blocks="default")
def test_image_spans_match_reference(shape, seed, blocks):
    """``attend_until``: a run of each request's new tokens sees up to its last."""
    batch = build(shape, seed)
    ends = jax.numpy.asarray(image_spans(batch, seed))
    args = batch.args(jax.numpy.float32, None)
    want = jitted_reference(**batch.kwargs())(*args, attend_until=ends)
    got = jitted(KERNELS[blocks], **batch.kwargs())(*args, attend_until=ends)
    real = batch.num_real_tokens
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got)[real:], 0.0)


@settings(max_examples=4, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**31 - 1), blocks=st.sampled_from(sorted(BLOCKS)))
@example(shape=SMOLLM2_MIXED, seed=20, blocks="small")
@example(shape=WINDOWED, seed=21, blocks="default")
@example(shape=CHUNKED, seed=22, blocks="small")
@example(shape=ALL_PADDING, seed=23, blocks="default")
def test_sinks_match_reference(shape, seed, blocks):
    """Attention sinks (gpt-oss) in both passes (last tokens and prefill tiles)."""
    batch = build(shape, seed)
    check_kernel(KERNELS[blocks], batch, "float32", sinks=random_sinks(batch, seed))


def test_sinks_of_minus_infinity_are_no_sinks():
    batch = build(SMOLLM2_MIXED, 24)
    kernel = jitted(KERNELS["small"], **batch.kwargs())
    plain = np.asarray(kernel(*batch.args()))
    hq, real = batch.q.shape[1], batch.num_real_tokens
    np.testing.assert_array_equal(
        np.asarray(kernel(*batch.args(), sinks=np.full(hq, -np.inf, np.float32))), plain
    )
    finite = np.asarray(kernel(*batch.args(), sinks=random_sinks(batch, 24)))
    assert relative_error(finite[:real], plain[:real]) > 1e-3
