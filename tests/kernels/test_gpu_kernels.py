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
from tests.kernels.ragged_batches import Shape, build, lowered_module

DECODE = Shape(16, 2, 4, 128, (1,) * 6, (0, 3, 15, 16, 40, 79), 2, 2, None, None)


def test_block_sizes_are_checked():
    batch = build(DECODE, 0)
    with pytest.raises(ValueError, match="power of two"):
        gpu.ragged_paged_attention(*batch.args(), **batch.kwargs(), block_m=24, interpret=True)
    with pytest.raises(ValueError, match=">= 16"):  # tl.dot needs 16 rows on the GPU
        gpu.ragged_paged_attention(*batch.args(), **batch.kwargs(), block_n=8)


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
