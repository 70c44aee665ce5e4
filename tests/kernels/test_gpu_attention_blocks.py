"""The Pallas GPU attention kernel's prefill tile options and KV paths against the reference.

`bench.device`'s kernels sweep times ``block_m`` 128/256, ``block_n`` 128,
``num_stages`` 3 and ``contiguous_pages`` (the "slice" and "pages" KV paths,
`gpu.choose_kv_path`) on a GPU; here each runs in interpret mode on ragged batches
(prefill chunks beside decodes, grouped query heads, padding, a sliding window) and
is lowered for CUDA at Llama-3-8B's heads, so a GPU window only has to time them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import gpu, reference
from tests.kernels.ragged_batches import (
    TOLERANCE,
    Shape,
    build,
    check_kernel,
    lowered_module,
    lowers_for,
    poison_unowned,
    relative_error,
)


def ragged(page_size: int, window: int | None = None, soft_cap: float | None = None) -> Shape:
    """Two prefill chunks (one over cached context) among three decodes, 2 KV heads of
    4 query heads each, a padding request and padding tokens."""
    return Shape(page_size, 2, 4, 64, (70, 1, 45, 1, 1), (30, 100, 0, 63, 7), 1, 3,
                 window, soft_cap)  # fmt: skip


CASES = {  # id: (shape, kernel keywords, the KV path they take)
    "m128-n128-gather": (ragged(16), dict(block_m=128, block_n=128), "gather"),
    "m128-n128-pages": (ragged(16), dict(block_m=128, block_n=128), "pages"),
    "m64-n32-pages-window": (ragged(8, 20, 30.0), dict(block_m=64, block_n=32), "pages"),
    "m128-n64-slice": (ragged(64), dict(block_m=128, block_n=64), "slice"),
    "m256-n32-slice-window": (ragged(32, 37), dict(block_m=256, block_n=32), "slice"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_large_tiles_and_kv_paths_match_reference(case):
    shape, blocks, path = CASES[case]
    contiguous = path != "gather"
    assert gpu.choose_kv_path(contiguous, shape.page_size, blocks["block_n"], 64) == path
    check_kernel(gpu.ragged_paged_attention, build(shape, 5), "float32", interpret=True,
                 num_stages=3, contiguous_pages=contiguous, **blocks)  # fmt: skip


def test_bfloat16_on_the_slice_path():
    check_kernel(gpu.ragged_paged_attention, build(ragged(32, 50), 6), "bfloat16",
                 interpret=True, block_m=128, block_n=32, contiguous_pages=True)  # fmt: skip


@pytest.mark.parametrize("page_size, block_n", [(32, 16), (8, 32)], ids=["slice", "pages"])
def test_contiguous_paths_never_read_unused_cache_slots(page_size, block_n):
    """NaN in every slot no request owns: a page's slice or a block's pages reach past a
    request's last key, and those rows must stay masked."""
    batch = build(ragged(page_size, 24), 9)
    cache = poison_unowned(batch)
    args = list(batch.args())
    want = np.asarray(reference.ragged_paged_attention(*args, **batch.kwargs()))
    args[1] = jnp.asarray(cache)
    got = gpu.ragged_paged_attention(*args, **batch.kwargs(), block_m=32, block_n=block_n,
                                     contiguous_pages=True, interpret=True)  # fmt: skip
    got, real = np.asarray(got), batch.num_real_tokens
    assert np.isfinite(got).all()
    assert relative_error(got[:real], want[:real]) < TOLERANCE["float32"]
    np.testing.assert_array_equal(got[real:], 0.0)


def test_kv_path_table():
    assert gpu.choose_kv_path(False, 16, 64, 128) == "gather"  # off: the default
    assert gpu.choose_kv_path(True, 16, 64, 128) == "pages"  # 4 pages a block
    assert gpu.choose_kv_path(True, 128, 64, 128) == "slice"  # 2 blocks a page
    assert gpu.choose_kv_path(True, 64, 64, 128) == "slice"
    assert gpu.choose_kv_path(True, 48, 32, 128) == "gather"  # neither nests
    assert gpu.choose_kv_path(True, 16, 64, 96) == "gather"  # padded head dim


def _llama3_8b(page_size: int, tokens: int = 8192, reqs: int = 4) -> tuple:
    """Abstract arguments: 4 x 2,048-token prefill chunks, 32 query / 8 KV heads of 128."""
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((65536 // page_size, page_size, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((reqs,), i32),
        jax.ShapeDtypeStruct((reqs, 4096 // page_size), i32),
        jax.ShapeDtypeStruct((reqs + 1,), i32),
        jax.ShapeDtypeStruct((), i32),
    )


PREFILL_TILES = dict(block_m=128, block_n=128, num_stages=3)
LOWERED = {  # id: (page size, kernel keywords)
    "m128-n128-s3-gather": (16, PREFILL_TILES),
    "m128-n128-s3-pages": (16, dict(PREFILL_TILES, contiguous_pages=True)),
    "m128-n128-s3-slice": (128, dict(PREFILL_TILES, contiguous_pages=True)),
    "m256-n64-w8-slice": (128, dict(block_m=256, block_n=64, num_warps=8, contiguous_pages=True)),
}


@pytest.mark.parametrize("case", sorted(LOWERED))
def test_prefill_tiles_lower_for_cuda(case):
    page_size, blocks = LOWERED[case]
    kernel = functools.partial(gpu.ragged_paged_attention, sm_scale=128**-0.5, **blocks)
    assert lowers_for(kernel, "cuda", *_llama3_8b(page_size))


def test_contiguous_pages_change_the_cuda_kernel():
    """The flag reaches the Triton kernel (not ignored): its module differs from the
    gather's, and on the same pages of 16 both lower."""
    args = _llama3_8b(16)
    modules = [
        lowered_module(functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, block_m=128,
                                         block_n=128, contiguous_pages=flag), "cuda", *args)
        for flag in (False, True)
    ]  # fmt: skip
    assert modules[0] != modules[1]
