"""What only the GPU kernel has: block-size rules that Triton imposes, enforced by the
wrapper, and proof that the CUDA lowering test catches a bad block.

The GPU kernels' correctness tests are shared with the TPU kernels
(`test_pallas_attention.py`, `test_kv_cache_update.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention import gpu
from tests.kernels.ragged_batches import TRITON_CALLS, Shape, build, lowered_module

DECODE = Shape(16, 2, 4, 128, (1,) * 6, (0, 3, 15, 16, 40, 79), 2, 2, None, None)


def test_block_sizes_are_checked():
    batch = build(DECODE, 0)
    with pytest.raises(ValueError, match="power of two"):
        gpu.ragged_paged_attention(*batch.args(), **batch.kwargs(), block_m=24, interpret=True)
    with pytest.raises(ValueError, match=">= 16"):  # tl.dot needs 16 rows on the GPU
        gpu.ragged_paged_attention(*batch.args(), **batch.kwargs(), block_n=8)


@pytest.mark.parametrize("chunk", [16, 8192])
def test_chunked_attention_lowers_for_cuda(chunk):
    """``attention_chunk_size`` (Llama 4's local layers) lowers to one Triton kernel,
    prefill and decode block sizes alike."""
    i32 = jnp.int32
    for tokens, reqs in ((512, 16), (64, 64)):
        args = (
            jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096, 16, 16, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((reqs,), i32),
            jax.ShapeDtypeStruct((reqs, 128), i32),
            jax.ShapeDtypeStruct((reqs + 1,), i32),
            jax.ShapeDtypeStruct((), i32),
        )
        fn = functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, attention_chunk_size=chunk)
        assert any(call in lowered_module(fn, "cuda", *args) for call in TRITON_CALLS)


def test_lowering_test_rejects_bad_blocks(monkeypatch):
    """The lowering check has teeth: a 24-row block (not a power of two) fails it."""
    monkeypatch.setattr(gpu, "_check_block", lambda *_: None)
    fn = functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, block_m=24)
    i32 = jnp.int32
    args = (
        jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4096, 16, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((64,), i32),
        jax.ShapeDtypeStruct((64, 128), i32),
        jax.ShapeDtypeStruct((65,), i32),
        jax.ShapeDtypeStruct((), i32),
    )
    with pytest.raises(ValueError, match="power of 2"):
        lowered_module(fn, "cuda", *args)


@pytest.mark.parametrize("group", [3, 8])
def test_sinks_lower_for_cuda(group):
    """Attention sinks [Hq] (gpt-oss) lower to one Triton kernel: the sinks are gathered
    per score row (head ``h * G + m % G``), for a group that is not a power of two too."""
    i32 = jnp.int32
    hq = 8 * group
    args = (
        jax.ShapeDtypeStruct((64, hq, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((4096, 16, 16, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((64,), i32),
        jax.ShapeDtypeStruct((64, 128), i32),
        jax.ShapeDtypeStruct((65,), i32),
        jax.ShapeDtypeStruct((), i32),
        jax.ShapeDtypeStruct((hq,), jnp.float32),
    )
    attention = functools.partial(gpu.ragged_paged_attention, sm_scale=0.125, sliding_window=128)
    module = lowered_module(lambda *a: attention(*a[:-1], sinks=a[-1]), "cuda", *args)
    assert any(call in module for call in TRITON_CALLS)
