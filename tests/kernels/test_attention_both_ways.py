"""``attend_until`` in the Pallas attention kernels (TPU: Mosaic, GPU: Triton).

Gemma 3 and 4 let an image's tokens attend to each other both ways: a token sees the
keys up to its ``attend_until`` (the image's last position, written to the cache by
this step's KV update), the window still counting from the token
(`reference.ragged_paged_attention`, the spec). On CPU the kernels run in interpret
mode against the reference on ragged batches: prefill chunks holding image spans
that cross q blocks, one that starts a chunk, ones whose last token is the chunk's
last (the scheduler never ends a chunk before an image's end, so no token's
``attend_until`` passes its request's ``seq_lens``), decodes between them and
padding, with GQA and with a window shorter than the spans; then the kernels lower
for their devices at Gemma 3's and Gemma 4's heads, and the TPU kernel compiles with
libtpu for v6e at Gemma 4's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention import gpu, tpu
from tests.kernels.ragged_batches import (
    TOLERANCE,
    Batch,
    Shape,
    build,
    image_spans,
    jitted,
    jitted_reference,
    lowers_for,
    random_sinks,
    relative_error,
    shapes,
    spans_attend_until,
)

KERNELS = {"tpu": tpu.ragged_paged_attention, "gpu": gpu.ragged_paged_attention}
# q blocks of 8 tokens (TPU: several requests in one; GPU: 4 rows, so 2 tokens of a
# request at group 2) and KV blocks of 16 positions: spans cross many of both
SMALL_BLOCKS = {
    "tpu": dict(block_q=8, pages_per_block=1, heads_per_block=1),
    "gpu": dict(block_m=4, block_n=16),
}

# requests: a long chunk, a decode, a chunk from position 0, a decode, a chunk over
# cached context; one padding request and 3 padding tokens
IMAGES = Shape(8, 2, 2, 64, (37, 1, 12, 1, 20), (5, 30, 0, 17, 9), 1, 3, None, None)
# each request's image spans: (first, last) new-token offsets, both inclusive
SPANS = {0: [(2, 30)], 2: [(3, 11)], 4: [(0, 4), (9, 19)]}


with_spans = spans_attend_until


def check(
    platform: str, batch: Batch, ends: np.ndarray, dtype_name="float32", sinks=None, **kwargs
) -> None:
    """The kernel against the reference with ``attend_until`` (and ``sinks`` when
    given): close on the real tokens, exact zeros on the padding, and the spans must
    change the output."""
    dtype, real = jnp.dtype(dtype_name), batch.num_real_tokens
    args = batch.args(dtype)
    extra = {"attend_until": jnp.asarray(ends)}
    if sinks is not None:
        extra["sinks"] = jnp.asarray(sinks)
    reference = jitted_reference(**batch.kwargs())
    want = np.asarray(reference(*args, **extra), np.float32)
    got = jitted(KERNELS[platform], **batch.kwargs(), interpret=True, **kwargs)(*args, **extra)
    assert got.shape == batch.q.shape and got.dtype == dtype
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all(), "NaN or inf in the output"
    np.testing.assert_array_equal(got[real:], 0.0, err_msg="padding tokens must be zero")
    err = relative_error(got[:real], want[:real])
    assert err < TOLERANCE[dtype_name], f"relative error {err:.2e} ({dtype_name})"
    if batch.num_seqs and (ends[:real] != _positions(batch)[:real]).any():
        causal = {k: v for k, v in extra.items() if k != "attend_until"}
        plain = np.asarray(reference(*args, **causal), np.float32)
        assert relative_error(want[:real], plain[:real]) > 1e-2, "the spans change nothing"


def _positions(batch: Batch) -> np.ndarray:
    return with_spans(batch, {})


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("blocks", ["default", "small"])
@pytest.mark.parametrize(
    "group, window", [(2, None), (4, 6)], ids=["gqa2", "gqa4-window"]
)  # fmt: skip
def test_image_spans_match_reference(platform, blocks, group, window):
    """Both ways inside each span; causal elsewhere; the window (6, shorter than the
    spans) counts from each token, so a span's first tokens see its last but not the
    context before them."""
    batch = build(dataclasses.replace(IMAGES, group=group, sliding_window=window), 5)
    ends = with_spans(batch, SPANS)
    kwargs = SMALL_BLOCKS[platform] if blocks == "small" else {}
    check(platform, batch, ends, **kwargs)


@pytest.mark.parametrize("platform", sorted(KERNELS))
@settings(max_examples=2, deadline=None)
@given(shape=shapes(head_dims=(64,)), seed=st.integers(0, 2**31 - 1))
def test_random_spans_match_reference(platform, shape, seed):
    """Random ragged batches (windows, soft caps and chunked attention included), one
    span per request of two or more new tokens (`image_spans`)."""
    batch = build(shape, seed)
    check(platform, batch, image_spans(batch, seed))


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_spans_with_sinks_and_bfloat16(platform):
    """``attend_until`` beside attention sinks (both optional inputs, in order), small
    blocks; and in bfloat16 with the default blocks."""
    batch = build(dataclasses.replace(IMAGES, sliding_window=9), 6)
    ends = with_spans(batch, SPANS)
    sinks = random_sinks(batch, 6)
    check(platform, batch, ends, sinks=sinks, **SMALL_BLOCKS[platform])
    check(platform, batch, ends, "bfloat16")


def _abstract(tokens, requests, hq, hkv, head_dim, sharding=None):
    def shape(dims, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)

    return (
        shape((tokens, hq, head_dim), jnp.bfloat16),
        shape((2048, 16, 2 * hkv, head_dim), jnp.bfloat16),
        shape((requests,)),
        shape((requests, 512)),
        shape((requests + 1,)),
        shape(()),
        shape((tokens,)),  # attend_until
    )


# Gemma 3 27B: 32 query heads over 16 KV heads of 128; Gemma 4 31B's sliding layers:
# 32 over 16 of 256, padded to the cache's 512 (the full layers' head width)
GEMMA = {"gemma3": (32, 16, 128), "gemma4": (32, 16, 512)}


def _both_ways(kernel):
    fn = functools.partial(kernel, sm_scale=0.0625, sliding_window=1024)
    return lambda *a: fn(*a[:-1], attend_until=a[-1])


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("model", sorted(GEMMA))
def test_lowers_for_its_device(platform, model):
    kernel = KERNELS["tpu" if platform == "tpu" else "gpu"]
    assert lowers_for(_both_ways(kernel), platform, *_abstract(512, 16, *GEMMA[model]))


def test_compiles_for_v6e_at_gemma4_heads():
    """libtpu's Mosaic compiler takes the kernel with ``attend_until`` (and the 1024
    window) for a 512-token prefill at Gemma 4's sliding layers' heads, sized for v6e's
    scoped VMEM, in MiBs of temporaries (the reference's step needed 32 GB: its scores
    over the whole cache). Skipped where libtpu (the tpu extra) is absent."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxengine.hardware import chip_named, slice_of
    from jaxengine.tpu_check.check import tpu_devices

    mesh = Mesh(tpu_devices(slice_of("v6e-1"))[:1], ("x",))
    args = _abstract(512, 16, *GEMMA["gemma4"], sharding=NamedSharding(mesh, PartitionSpec()))
    vmem = chip_named("v6e").vmem_limit_bytes
    kernel = functools.partial(tpu.ragged_paged_attention, vmem_limit_bytes=vmem)
    compiled = jax.jit(_both_ways(kernel)).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < 64 << 20  # 16.5 MiB here
