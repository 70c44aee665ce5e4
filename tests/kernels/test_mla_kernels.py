"""The Pallas MLA kernels (`pallas_kernels.mla.tpu`: Mosaic, `.gpu`: Triton) against
the reference (`pallas_kernels.mla.reference`): in interpret mode on CPU on ragged
batches (decodes, prefill chunks after cached context, both mixed, padding tokens and
requests, pages scattered, several page sizes and head counts), float32 and bfloat16,
an 8-bit cache, small blocks, NaN in every slot no request owns; the GPU cache write
against the reference's; then the TPU kernel compiled by libtpu for v5e and v6e and
the GPU kernel lowered for CUDA at DeepSeek-V3's dimensions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache_update.reference import to_cache_dtype
from pallas_kernels.mla import gpu, reference, tpu
from tests.kernels.ragged_batches import TOLERANCE, jitted, lowers_for, relative_error

KERNELS = {"tpu": tpu.ragged_paged_mla, "gpu": gpu.ragged_paged_mla}
LAT, ROPE = 32, 8  # latent (the value part) and rope key: a row of 40 features


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]  # cached tokens before this step's
    page_size: int
    heads: int = 4
    pad_tokens: int = 3
    pad_reqs: int = 1


CASES = {
    "decode": Case((1, 1, 1, 1), (0, 13, 30, 7), 4),
    "decode-6-heads": Case((1, 1, 1), (5, 40, 16), 8, heads=6),
    "prefill-chunks": Case((9, 5), (0, 17), 8),
    "mixed": Case((1, 7, 1, 12), (21, 3, 0, 9), 4),
    "mixed-16-heads": Case((3, 1, 20), (30, 44, 0), 16, heads=16, pad_tokens=0, pad_reqs=0),
    "all-padding": Case((0,), (0,), 4, pad_tokens=4, pad_reqs=2),
}


@dataclasses.dataclass(frozen=True)
class Batch:
    """One MLA call's arguments (numpy), in the kernels' order."""

    q: np.ndarray  # [T, Hq, LAT + ROPE]: absorbed queries
    kv_cache: np.ndarray  # [P, S, 1, LAT + ROPE], junk where no request owns a slot
    seq_lens: np.ndarray
    page_table: np.ndarray
    query_start_loc: np.ndarray
    num_seqs: int
    owned: np.ndarray  # [P, S]: the slots some request's keys occupy

    def args(self, dtype=jnp.float32, cache_dtype=None) -> tuple:
        return (
            jnp.asarray(self.q, dtype),
            to_cache_dtype(jnp.asarray(self.kv_cache), cache_dtype or dtype),
            jnp.asarray(self.seq_lens),
            jnp.asarray(self.page_table),
            jnp.asarray(self.query_start_loc),
            jnp.asarray(self.num_seqs, jnp.int32),
        )

    @property
    def num_real_tokens(self) -> int:
        return int(self.query_start_loc[self.num_seqs])


def build(case: Case, seed: int = 0) -> Batch:
    """Random queries and rows; each request's pages distinct and scattered (page 0
    the null page), page-table rows one column wider than the longest request."""
    rng = np.random.default_rng(seed)
    s = case.page_size
    seq_lens = [q + c for q, c in zip(case.q_lens, case.ctx_lens, strict=True)]
    pages = [-(-n // s) for n in seq_lens]
    num_pages = sum(pages) + 3
    ids = rng.permutation(np.arange(1, num_pages))
    num_reqs = len(seq_lens) + case.pad_reqs
    page_table = np.zeros((num_reqs, max(pages) + 1), np.int32)
    owned = np.zeros((num_pages, s), bool)
    used = 0
    for r, n in enumerate(pages):
        page_table[r, :n] = ids[used : used + n]
        used += n
        for pos in range(seq_lens[r]):
            owned[page_table[r, pos // s], pos % s] = True
    qsl = np.concatenate([[0], np.cumsum(case.q_lens), [sum(case.q_lens)] * case.pad_reqs])
    num_tokens = sum(case.q_lens) + case.pad_tokens
    width = LAT + ROPE
    return Batch(
        q=rng.standard_normal((num_tokens, case.heads, width)).astype(np.float32),
        kv_cache=rng.standard_normal((num_pages, s, 1, width)).astype(np.float32),
        seq_lens=np.array(seq_lens + [0] * case.pad_reqs, np.int32),
        page_table=page_table,
        query_start_loc=qsl.astype(np.int32),
        num_seqs=len(seq_lens),
        owned=owned,
    )


STATIC = dict(sm_scale=0.2, value_dim=LAT)


def check(platform: str, batch: Batch, dtype="float32", cache_dtype=None, **kwargs) -> None:
    """Kernel and reference on the same inputs (rounded to ``dtype``, the cache to
    ``cache_dtype``): close on the real tokens, exact zeros on the padding ones."""
    args = batch.args(jnp.dtype(dtype), cache_dtype)
    want = np.asarray(jitted(reference.ragged_paged_mla, **STATIC)(*args), np.float32)
    got = jitted(KERNELS[platform], **STATIC, interpret=True, **kwargs)(*args)
    assert got.shape == (*batch.q.shape[:2], LAT) and got.dtype == jnp.dtype(dtype)
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all(), "NaN or inf in the output"
    real = batch.num_real_tokens
    np.testing.assert_array_equal(got[real:], 0.0, err_msg="padding tokens must be zero")
    if real:
        err = relative_error(got[:real], want[:real])
        assert err < TOLERANCE[dtype], f"relative error {err:.2e} ({dtype})"


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(platform, case):
    check(platform, build(CASES[case], seed=len(case)))


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_matches_reference_in_bfloat16(platform, case):
    check(platform, build(CASES[case], seed=7), "bfloat16")


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_fp8_cache_matches_reference(platform):
    """``--kv-cache-dtype fp8``: the kernels widen the 8-bit rows after loading them."""
    check(platform, build(CASES["mixed"], seed=8), "float32", "float8_e4m3fn")


# Small blocks: q blocks span requests, requests span many KV blocks, several head
# blocks (TPU: 12 heads padded to 16, blocks of 8; GPU: 2 of the 6 heads a program)
SMALL_BLOCKS = {
    "tpu": dict(block_q=2, pages_per_block=1, heads_per_block=8),
    "gpu": dict(block_m=4, block_n=4, heads_per_block=2),
}


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_small_blocks_cross_request_page_and_head_boundaries(platform):
    heads = 12 if platform == "tpu" else 6
    case = Case((5, 1, 11, 1), (12, 30, 3, 0), 4, heads=heads)
    check(platform, build(case, seed=9), **SMALL_BLOCKS[platform])


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_never_reads_unused_cache_slots(platform):
    """NaN in every slot no request owns (null page, spare pages, tails of last
    pages): the same outputs, all finite."""
    batch = build(Case((1, 6, 1), (9, 20, 0), 4), seed=11)
    want = np.asarray(jitted(reference.ragged_paged_mla, **STATIC)(*batch.args()))
    cache = batch.kv_cache.copy()
    cache[~batch.owned] = np.nan
    args = list(batch.args())
    args[1] = jnp.asarray(cache)
    got = np.asarray(jitted(KERNELS[platform], **STATIC, interpret=True)(*args))
    assert np.isfinite(got).all()
    real = batch.num_real_tokens
    assert relative_error(got[:real], want[:real]) < TOLERANCE["float32"]
    np.testing.assert_array_equal(got[real:], 0.0)


def test_tpu_kernel_has_no_races():
    """TPU interpret mode's race detector with eager copies and the grid split over
    two cores (both grid axes are parallel): no copy meets an unordered access."""
    # private: where interpret mode keeps what its race detector found (jax 0.10)
    simulator = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    params = pltpu.InterpretParams(
        detect_races=True, dma_execution_mode="eager", num_cores_or_threads=2
    )
    batch = build(Case((5, 1, 11, 1), (12, 30, 3, 0), 4, heads=12), seed=12)
    got = tpu.ragged_paged_mla(
        *batch.args(), **STATIC, block_q=2, pages_per_block=1, heads_per_block=8,
        interpret=params,
    )  # fmt: skip
    assert not simulator.races.races_found
    want = jitted(reference.ragged_paged_mla, **STATIC)(*batch.args())
    assert relative_error(np.asarray(got), np.asarray(want)) < TOLERANCE["float32"]


def test_gpu_cache_write_matches_reference():
    """The Triton write of rows ``[latent; k_rope]``: the reference's cache, slots
    outside the cache (padding tokens) dropped; in an 8-bit cache too."""
    rng = np.random.default_rng(13)
    cache = rng.standard_normal((6, 4, 1, LAT + ROPE)).astype(np.float32)
    latent = rng.standard_normal((7, 1, LAT)).astype(np.float32)
    k_rope = rng.standard_normal((7, 1, ROPE)).astype(np.float32)
    slots = np.array([5, 0, 23, 9, -1, 24, 11], np.int32)  # -1 and 24: outside
    for dtype in (jnp.float32, jnp.float8_e4m3fn):
        args = (to_cache_dtype(jnp.asarray(cache), dtype), latent, k_rope, slots)
        want = reference.update_mla_cache(*args)
        got = gpu.update_mla_cache(*args, interpret=True)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_row_padded_to_tpu_lanes_attends_as_the_unpadded_row():
    """On TPU the cache row is padded with zeros to a multiple of 128 lanes and the
    queries with as many: the write puts zeros after ``[latent; k_rope]`` and the
    kernel's output equals the reference's on the unpadded row."""
    batch = build(CASES["prefill-chunks"])
    args = batch.args()
    want = np.asarray(jitted(reference.ragged_paged_mla, **STATIC)(*args))
    width = 128
    pad = ((0, 0),) * 2 + ((0, width - LAT - ROPE),)
    q, cache = jnp.pad(args[0], pad), jnp.pad(args[1], ((0, 0),) + pad)
    got = jitted(tpu.ragged_paged_mla, **STATIC, interpret=True)(q, cache, *args[2:])
    real = batch.num_real_tokens
    assert relative_error(np.asarray(got)[:real], want[:real]) < TOLERANCE["float32"]
    rng = np.random.default_rng(3)
    latent, k_rope = rng.standard_normal((2, 3, 1, LAT)), rng.standard_normal((3, 1, ROPE))
    written = reference.update_mla_cache(cache, latent[0], k_rope, jnp.array([0, 5, 9]))
    rows = np.asarray(written).reshape(-1, width)[[0, 5, 9]]
    np.testing.assert_allclose(rows[:, :LAT], latent[0][:, 0], rtol=1e-6)
    np.testing.assert_array_equal(rows[:, LAT + ROPE :], 0.0)


def test_block_tables_and_checks():
    decode = tpu.choose_blocks(64, 64, 16, 16, 512, 576, 512, jnp.bfloat16)
    assert decode == tpu.Blocks(block_q=8, pages_per_block=16, heads_per_block=16)
    tp1 = tpu.choose_blocks(64, 64, 128, 64, 128, 576, 512, jnp.bfloat16)
    assert tp1 == tpu.Blocks(block_q=1, pages_per_block=4, heads_per_block=128)
    prefill = tpu.choose_blocks(512, 16, 16, 64, 128, 576, 512, jnp.bfloat16)
    assert prefill == tpu.Blocks(block_q=64, pages_per_block=4, heads_per_block=16)
    assert tpu.choose_blocks(64, 64, 4, 16, 512, 576, 512, jnp.float32).heads_per_block == 8
    small = tpu.choose_blocks(512, 16, 128, 64, 128, 576, 512, jnp.float32, None, 4 << 20)
    assert tpu.vmem_bytes(small, 64, 576, 512, jnp.float32, jnp.float32) <= 4 << 20
    assert gpu.choose_blocks(64, 64, 128, 576, 512) == gpu.Blocks(16, 32, 16)
    assert gpu.choose_blocks(512, 16, 16, 576, 512) == gpu.Blocks(32, 32, 16)
    assert gpu.choose_blocks(64, 64, 20, 576, 512).heads_per_block == 10  # of 16 rows
    assert gpu.choose_blocks(64, 64, 4, 40, 32) == gpu.Blocks(16, 64, 4)
    batch = build(CASES["decode"])
    with pytest.raises(ValueError, match="heads_per_block"):
        tpu.ragged_paged_mla(*batch.args(), **STATIC, heads_per_block=4, interpret=True)
    with pytest.raises(ValueError, match=">= 16"):  # tl.dot needs 16 rows on the GPU
        gpu.ragged_paged_mla(*batch.args(), **STATIC, block_m=8)
    with pytest.raises(ValueError, match="one row per token"):
        gpu.ragged_paged_mla(*batch.args(), sm_scale=0.2, value_dim=LAT + ROPE + 1)


# ---- DeepSeek-V3's dimensions: compiled for TPUs by libtpu, lowered for CUDA ----

# 128 query heads (TP 1) or the 16 of a TP-8 device; a row of 512 latent + 64 rope
V3 = dict(lat=512, rope=64)


def abstract_args(tokens, requests, heads, page_size, width=576, placed=None, dtype=jnp.bfloat16):
    def shape(dims, dt=jnp.int32):
        return jax.ShapeDtypeStruct(dims, dt, sharding=placed)

    max_pages = 8192 // page_size  # 8K tokens of context a request
    return (
        shape((tokens, heads, width), dtype),
        shape((4096, page_size, 1, width), dtype),
        shape((requests,)),
        shape((requests, max_pages)),
        shape((requests + 1,)),
        shape(()),
    )


TPU_SHAPES = {  # id: (tokens, requests, heads, page size)
    "decode-tp8-page16": (64, 64, 16, 16),
    "prefill-tp8-page64": (512, 16, 16, 64),
    "decode-tp1-page64": (64, 64, 128, 64),
}


def _compiled_for(generation: str, args_of):
    """The TPU kernel compiled for ``generation`` with its scoped VMEM."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxengine.hardware import chip_named, slice_of
    from jaxengine.tpu_check.check import tpu_devices

    devices = tpu_devices(slice_of({"v5e": "v5e-4", "v6e": "v6e-1"}[generation]))
    placed = NamedSharding(Mesh(devices[:1], ("x",)), PartitionSpec())
    kernel = functools.partial(
        tpu.ragged_paged_mla, sm_scale=0.1, value_dim=V3["lat"],
        vmem_limit_bytes=chip_named(generation).vmem_limit_bytes,
    )  # fmt: skip
    return jax.jit(kernel).lower(*args_of(placed)).compile()


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("shape", sorted(TPU_SHAPES))
def test_tpu_kernel_compiles(generation, shape):
    """libtpu's Mosaic compiler takes the kernel at DeepSeek-V3's dimensions, sized for
    the generation's scoped VMEM (skipped where libtpu, the tpu extra, is absent)."""
    tokens, requests, heads, page_size = TPU_SHAPES[shape]
    compiled = _compiled_for(
        generation, lambda placed: abstract_args(tokens, requests, heads, page_size, placed=placed)
    )
    assert "tpu_custom_call" in compiled.as_text()


def test_tpu_kernel_reads_a_lane_aligned_cache_where_it_lies():
    """With the row padded to 640 lanes (512 + 64 rounded up to 128) the bfloat16
    cache goes to the kernel as TPU lays it out: no copy of it in the program. (At
    576 lanes TPU's default layout puts the pages on lanes and XLA copies the cache,
    around the reference's gather as around this kernel: the module docstring.)"""
    compiled = _compiled_for(
        "v6e", lambda placed: abstract_args(64, 64, 16, 16, width=640, placed=placed)
    )
    copies = [line for line in compiled.as_text().splitlines() if " copy(" in line]
    assert not [line for line in copies if "[4096,16,1,640]" in line or "[4096,16,640]" in line]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize(
    "tokens, requests, heads, page_size, cache",
    [
        (64, 64, 16, 16, jnp.bfloat16),
        (512, 16, 128, 64, jnp.bfloat16),
        (64, 64, 16, 16, jnp.float8_e4m3fn),  # --kv-cache-dtype fp8
    ],
    ids=["decode-tp8", "prefill-tp1", "decode-fp8"],
)
def test_lowers_for_its_device(platform, tokens, requests, heads, page_size, cache):
    """Pallas turns each kernel into its device's custom call (a Mosaic kernel, a
    Triton kernel) at DeepSeek-V3's dimensions, without the device."""
    kernel = KERNELS["tpu" if platform == "tpu" else "gpu"]
    args = list(abstract_args(tokens, requests, heads, page_size))
    args[1] = jax.ShapeDtypeStruct(args[1].shape, cache)
    fn = functools.partial(kernel, sm_scale=0.1, value_dim=V3["lat"])
    assert lowers_for(fn, platform, *args)


def test_gpu_cache_write_lowers_for_cuda():
    i32, bf16 = jnp.int32, jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((4096, 16, 1, 576), bf16),
        jax.ShapeDtypeStruct((64, 1, V3["lat"]), bf16),
        jax.ShapeDtypeStruct((64, 1, V3["rope"]), bf16),
        jax.ShapeDtypeStruct((64,), i32),
    )
    assert lowers_for(gpu.update_mla_cache, "cuda", *args)


@pytest.mark.tpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_on_tpu(case):
    batch = build(CASES[case], seed=20)
    args = batch.args(jnp.bfloat16)
    want = jitted(reference.ragged_paged_mla, **STATIC)(*args)
    got = jitted(tpu.ragged_paged_mla, **STATIC)(*args)
    real = batch.num_real_tokens
    assert relative_error(np.asarray(got[:real]), np.asarray(want[:real])) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_on_gpu(dtype, case):
    batch = build(CASES[case], seed=21)
    args = batch.args(jnp.dtype(dtype))
    want = jitted(reference.ragged_paged_mla, **STATIC)(*args)
    got = jitted(gpu.ragged_paged_mla, **STATIC)(*args)
    real = batch.num_real_tokens
    assert relative_error(np.asarray(got[:real]), np.asarray(want[:real])) < TOLERANCE[dtype]
