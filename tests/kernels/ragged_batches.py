"""Random ragged batches for the attention kernels' tests, and the comparison they share.

A batch mixes decodes (1 new token), prefill chunks (several new tokens over cached
context) and padding: requests past ``num_seqs`` with 0 new tokens, and tokens past
the last real one. Pages are scattered over the cache (page 0 is the null page) and
KV lengths cross page boundaries.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from pallas_kernels.kv_cache_update.reference import to_cache_dtype
from pallas_kernels.ragged_paged_attention import reference

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What hypothesis draws; `build` turns it into arrays."""

    page_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    q_lens: tuple[int, ...]  # real requests' new tokens
    ctx_lens: tuple[int, ...]  # real requests' cached tokens
    pad_reqs: int  # padding request rows (q_len 0)
    pad_tokens: int  # padding tokens after the last real one
    sliding_window: int | None
    soft_cap: float | None
    attention_chunk_size: int | None = None  # chunked local attention (Llama 4)


@st.composite
def shapes(draw, head_dims=(64, 128, 256), page_sizes=(8, 16, 32)) -> Shape:
    num_real = draw(st.integers(1, 5))
    kind = st.sampled_from(["decode", "chunk"])
    q_lens = tuple(
        1 if draw(kind) == "decode" else draw(st.integers(1, 24)) for _ in range(num_real)
    )
    return Shape(
        page_size=draw(st.sampled_from(page_sizes)),
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 3, 4, 8])),
        head_dim=draw(st.sampled_from(head_dims)),
        q_lens=q_lens,
        ctx_lens=tuple(draw(st.integers(0, 80)) for _ in range(num_real)),
        pad_reqs=draw(st.integers(0, 2)),
        pad_tokens=draw(st.integers(0, 5)),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 48))),
        soft_cap=draw(st.one_of(st.none(), st.just(2.0), st.just(30.0))),
        attention_chunk_size=draw(st.one_of(st.none(), st.sampled_from([3, 8, 16, 32]))),
    )


@dataclasses.dataclass(frozen=True)
class Batch:
    """Arguments of one attention call (numpy), in the kernels' order."""

    q: np.ndarray  # [T, Hq, D]
    kv_cache: np.ndarray  # [P, S, 2Hkv, D]
    seq_lens: np.ndarray  # [R]
    page_table: np.ndarray  # [R, M]
    query_start_loc: np.ndarray  # [R + 1]
    num_seqs: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    attention_chunk_size: int | None = None

    def args(self, dtype=jnp.float32, cache_dtype=None) -> tuple:
        """The arguments in ``dtype`` (the cache in ``cache_dtype`` when given: an
        8-bit float cache, stored as the engine stores it, saturating)."""
        return (
            jnp.asarray(self.q, dtype),
            to_cache_dtype(jnp.asarray(self.kv_cache), cache_dtype or dtype),
            jnp.asarray(self.seq_lens),
            jnp.asarray(self.page_table),
            jnp.asarray(self.query_start_loc),
            jnp.asarray(self.num_seqs, jnp.int32),
        )

    def kwargs(self) -> dict:
        chunked = {}
        if self.attention_chunk_size is not None:
            chunked["attention_chunk_size"] = self.attention_chunk_size
        return dict(
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
            **chunked,
        )

    @property
    def num_real_tokens(self) -> int:
        return int(self.query_start_loc[self.num_seqs])


def build(shape: Shape, seed: int, extra_pages: int = 3) -> Batch:
    """Arrays for `shape`: scattered pages, random q and cache, padding rows."""
    rng = np.random.default_rng(seed)
    s = shape.page_size
    seq_lens = [c + q for c, q in zip(shape.ctx_lens, shape.q_lens, strict=True)]
    pages_per_req = [-(-n // s) for n in seq_lens]
    max_pages = max(pages_per_req) + 1  # a spare column: tables are wider than needed
    num_pages = 1 + sum(pages_per_req) + extra_pages
    perm = rng.permutation(np.arange(1, num_pages))  # page 0 is the null page
    num_reqs = len(seq_lens) + shape.pad_reqs
    page_table = np.zeros((num_reqs, max_pages), np.int32)
    used = 0
    for r, n in enumerate(pages_per_req):
        page_table[r, :n] = perm[used : used + n]
        used += n
    qsl = np.zeros(num_reqs + 1, np.int32)
    qsl[1 : len(seq_lens) + 1] = np.cumsum(shape.q_lens)
    qsl[len(seq_lens) + 1 :] = qsl[len(seq_lens)]
    num_tokens = int(qsl[-1]) + shape.pad_tokens
    hq = shape.num_kv_heads * shape.group
    d = shape.head_dim
    return Batch(
        q=rng.standard_normal((num_tokens, hq, d)).astype(np.float32),
        kv_cache=rng.standard_normal((num_pages, s, 2 * shape.num_kv_heads, d)).astype(np.float32),
        seq_lens=np.array(seq_lens + [0] * shape.pad_reqs, np.int32),
        page_table=page_table,
        query_start_loc=qsl,
        num_seqs=len(seq_lens),
        sm_scale=d**-0.5,
        sliding_window=shape.sliding_window,
        soft_cap=shape.soft_cap,
        attention_chunk_size=shape.attention_chunk_size,
    )


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| over the real tokens."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@functools.cache
def jitted(fn: Callable, **static) -> Callable:
    """``fn`` jitted with its static keyword arguments, as the engine runs it: one
    compile per batch shape, where running it op by op compiles each of its operations."""
    return jax.jit(functools.partial(fn, **static))


def jitted_reference(**kwargs) -> Callable:
    """The reference jitted for one set of static arguments (`jitted`)."""
    return jitted(reference.ragged_paged_attention, **kwargs)


def random_sinks(batch: Batch, seed: int, scale: float = 3.0) -> np.ndarray:
    """``[Hq]`` float32 attention sinks for ``batch``: normal draws times ``scale``
    (large enough to take much of a row's probability mass)."""
    num_q_heads = batch.q.shape[1]
    return (scale * np.random.default_rng(seed).standard_normal(num_q_heads)).astype(np.float32)


def check_kernel(
    kernel,
    batch: Batch,
    dtype_name: str,
    cache_dtype: str | None = None,
    sinks: np.ndarray | None = None,
    **kernel_kwargs,
) -> float:
    """Runs `kernel` and the reference on `batch`; asserts closeness; returns the error.

    Both see the same inputs (rounded to the dtype; the cache to ``cache_dtype`` when
    given; ``sinks`` [Hq], attention sinks, when given); the reference accumulates in
    float32 like the kernels. Padding tokens must come out as exact zeros.
    """
    dtype = jnp.dtype(dtype_name)
    args = batch.args(dtype, cache_dtype)
    extra = {} if sinks is None else {"sinks": jnp.asarray(sinks)}
    want = np.asarray(jitted_reference(**batch.kwargs())(*args, **extra), np.float32)
    got = jitted(kernel, **batch.kwargs(), **kernel_kwargs)(*args, **extra)
    assert got.shape == batch.q.shape and got.dtype == dtype
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all(), "NaN or inf in the output"
    real = batch.num_real_tokens
    np.testing.assert_array_equal(got[real:], 0.0, err_msg="padding tokens must be zero")
    if real == 0:
        return 0.0
    err = relative_error(got[:real], want[:real])
    assert err < TOLERANCE[dtype_name], f"relative error {err:.2e} ({dtype_name})"
    return err


# jaxlib <= 0.10.2 emits the Triton IR in "__gpu$xla.gpu.triton"; later versions compile
# it while lowering (which needs a CUDA jaxlib) and emit "triton_kernel_call_ffi".
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def can_lower_for_cuda() -> bool:
    from jax._src.lib import triton, version

    return version <= (0, 10, 2) or triton.has_compilation_handler("cuda")


def lowered_module(fn, platform: str, *args) -> str:
    """The StableHLO module of ``fn`` lowered for ``platform`` ("tpu" or "cuda"):
    Pallas's own lowering runs here, without the device. Skips the test where this
    jaxlib cannot lower Triton kernels for CUDA."""
    checks = []
    if platform == "cuda":
        if not can_lower_for_cuda():
            pytest.skip("this jaxlib compiles Triton kernels only with CUDA support")
        checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in TRITON_CALLS]
    export = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)
    return export(*args).mlir_module()


def lowers_for(fn, platform: str, *args) -> bool:
    """Whether ``fn`` lowers for ``platform`` to its kernel's custom call."""
    module = lowered_module(fn, platform, *args)
    targets = ("tpu_custom_call",) if platform == "tpu" else TRITON_CALLS
    return any(target in module for target in targets)


def image_spans(batch: Batch, seed: int) -> np.ndarray:
    """``attend_until`` [T] for ``batch`` (`spans_attend_until`) with one random span
    of new tokens per request that has at least two (an image that attends both ways)."""
    rng = np.random.default_rng(seed)
    spans = {}
    for r in range(batch.num_seqs):
        q_len = int(batch.query_start_loc[r + 1] - batch.query_start_loc[r])
        if q_len >= 2:
            a = int(rng.integers(0, q_len - 1))
            spans[r] = [(a, int(rng.integers(a + 1, q_len)))]
    return spans_attend_until(batch, spans)


def spans_attend_until(batch: Batch, spans: dict[int, list[tuple[int, int]]]) -> np.ndarray:
    """``attend_until`` [T]: each token's own position, except that every token of a
    span (request -> (first, last) new-token offsets, both inclusive) sees up to the
    span's last; padding tokens get 0."""
    qsl, seq_lens = batch.query_start_loc, batch.seq_lens
    ends = np.zeros(batch.q.shape[0], np.int32)
    for r in range(batch.num_seqs):
        q_len = int(qsl[r + 1] - qsl[r])
        pos = np.arange(seq_lens[r] - q_len, seq_lens[r], dtype=np.int32)
        ends[qsl[r] : qsl[r + 1]] = pos
        for a, b in spans.get(r, []):
            ends[qsl[r] + a : qsl[r] + b + 1] = pos[b]
    return ends


def poison_unowned(batch: Batch) -> np.ndarray:
    """``batch``'s cache with NaN in every slot no request's keys occupy (the null
    page, spare pages, the tails of last pages): a kernel must never let them in."""
    cache = batch.kv_cache.copy()
    page_size = cache.shape[1]
    owned = np.zeros(cache.shape[:2], bool)
    for r in range(batch.num_seqs):
        for pos in range(int(batch.seq_lens[r])):
            owned[batch.page_table[r, pos // page_size], pos % page_size] = True
    cache[~owned] = np.nan
    return cache
