"""The reference ragged paged attention against a dense per-request numpy computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
from tests.kernels.ragged_batches import (
    Batch,
    Shape,
    build,
    image_spans,
    jitted_reference,
    random_sinks,
    shapes,
)


def dense_attention(q, k, v, q_pos, sm_scale, window, soft_cap, q_end=None, chunk=None, sinks=None):
    """One request: q [Q, Hq, D], k/v [L, Hkv, D] -> [Q, Hq, D] in float64; ``q_end``:
    each query's last key (default its position); ``chunk``: chunked local attention,
    keys of the query's own chunk ``[p - p % chunk, p]``; ``sinks`` [Hq]: one more
    logit per head in each softmax, whose probability is dropped (no value)."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,lhd->hql", q, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    kv_pos = np.arange(k.shape[0])
    mask = kv_pos[None, :] <= (q_pos if q_end is None else q_end)[:, None]
    if window is not None:
        mask &= q_pos[:, None] - kv_pos[None, :] < window
    if chunk is not None:
        mask &= kv_pos[None, :] // chunk == q_pos[:, None] // chunk
    s = np.where(mask[None], s, -np.inf)
    if sinks is not None:  # [H, Q, L + 1]: the sink is the last column
        sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], s.shape[:2] + (1,))
        s = np.concatenate([s, sink], axis=-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    return np.einsum("hql,lhd->qhd", p, v)


def dense_per_request(batch: Batch, q_end: np.ndarray | None = None, sinks=None):
    """For each real request of ``batch``: its token rows (a slice), its queries'
    positions and `dense_attention` over its keys and values with the batch's window,
    soft cap and chunk size; ``q_end [T]``: each token's last key; ``sinks [Hq]``."""
    qsl, page = batch.query_start_loc, batch.kv_cache.shape[1]
    for r in range(batch.num_seqs):
        n = int(batch.seq_lens[r])
        pages = batch.kv_cache[batch.page_table[r, : -(-n // page)]]
        kv = pages.reshape(-1, *batch.kv_cache.shape[2:])[:n]  # [n, 2Hkv, D]
        rows = slice(qsl[r], qsl[r + 1])
        q_pos = np.arange(n - (qsl[r + 1] - qsl[r]), n)
        want = dense_attention(
            batch.q[rows].astype(np.float64), kv[:, 0::2], kv[:, 1::2], q_pos, batch.sm_scale,
            batch.sliding_window, batch.soft_cap, None if q_end is None else q_end[rows],
            chunk=batch.attention_chunk_size, sinks=sinks,
        )  # fmt: skip
        yield rows, q_pos, want


@st.composite
def batches(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 64]))
    num_real = draw(st.integers(1, 4))
    q_lens = [draw(st.integers(1, 9)) for _ in range(num_real)]
    ctx = [draw(st.integers(0, 40)) for _ in range(num_real)]
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 12))) if causal else None
    soft_cap = draw(st.one_of(st.none(), st.just(5.0)))
    chunk = draw(st.one_of(st.none(), st.sampled_from([2, 5, 8]))) if causal else None
    return page_size, hkv, group, head_dim, q_lens, ctx, window, soft_cap, causal, chunk


@settings(max_examples=25, deadline=None)
@given(batches(), st.integers(0, 2**31 - 1))
def test_reference_matches_dense(batch, seed):
    page_size, hkv, group, head_dim, q_lens, ctx, window, soft_cap, causal, chunk = batch
    rng = np.random.default_rng(seed)
    hq = hkv * group
    num_reqs = len(q_lens) + 1  # one padding request row
    num_tokens = sum(q_lens) + 3  # three padding tokens
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    max_pages = max(-(-s // page_size) for s in seq_lens)
    num_pages = 1 + sum(-(-s // page_size) for s in seq_lens)
    perm = rng.permutation(np.arange(1, num_pages))  # scattered pages; 0 is the null page
    page_table = np.zeros((num_reqs, max_pages), np.int32)
    cache = rng.standard_normal((num_pages, page_size, 2 * hkv, head_dim)).astype(np.float32)
    keys, values, used = [], [], 0
    for r, s in enumerate(seq_lens):
        n = -(-s // page_size)
        page_table[r, :n] = perm[used : used + n]
        used += n
        kv = cache[page_table[r, :n]].reshape(n * page_size, 2 * hkv, head_dim)[:s]
        keys.append(kv[:, 0::2])
        values.append(kv[:, 1::2])
    qsl = np.zeros(num_reqs + 1, np.int32)
    qsl[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1 :] = qsl[len(q_lens)]
    q = rng.standard_normal((num_tokens, hq, head_dim)).astype(np.float32)
    sm_scale = head_dim**-0.5
    attention = jitted_reference(
        sm_scale=sm_scale,
        sliding_window=window,
        soft_cap=soft_cap,
        pages_per_chunk=2,
        causal=causal,
        attention_chunk_size=chunk,
    )
    out = attention(
        jnp.asarray(q),
        jnp.asarray(cache),
        jnp.asarray(seq_lens + [0], jnp.int32),
        jnp.asarray(page_table),
        jnp.asarray(qsl),
        jnp.asarray(len(q_lens), jnp.int32),
    )
    out = np.asarray(out)
    assert np.isfinite(out).all()
    for r, (c, ql) in enumerate(zip(ctx, q_lens, strict=True)):
        # bidirectional (an encoder): every token sees the request's keys, as its last does
        q_pos = np.arange(c, c + ql) if causal else np.full(ql, c + ql - 1)
        want = dense_attention(
            q[qsl[r] : qsl[r + 1]].astype(np.float64),
            keys[r].astype(np.float64),
            values[r].astype(np.float64),
            q_pos,
            sm_scale,
            window,
            soft_cap,
            chunk=chunk,
        )
        np.testing.assert_allclose(out[qsl[r] : qsl[r + 1]], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[qsl[-1] :], 0.0)


def _dots(dtype) -> tuple[int, int]:
    """(dot_general count, how many ask for HIGHEST) in the reference's program."""
    batch = build(Shape(4, 1, 2, 8, (1, 3), (2, 5), 0, 0, None, None), 0)
    text = str(
        jax.make_jaxpr(lambda *a: ragged_paged_attention(*a, **batch.kwargs()))(*batch.args(dtype))
    )
    return text.count("dot_general["), text.count(
        "precision=(Precision.HIGHEST, Precision.HIGHEST)"
    )


def test_float32_inputs_get_float32_dots():
    """The reference is the kernels' truth: float32 inputs get full-float32 dots, not
    the TF32 that XLA's default precision gives on GPUs; bfloat16 keeps the default."""
    assert _dots("float32") == (2, 2)
    assert _dots("bfloat16") == (2, 0)


@pytest.mark.parametrize("window", [None, 6])
def test_image_spans_match_dense(window):
    """``attend_until``: a run of new tokens (an image) sees up to the run's last key;
    the sliding window still counts from each token."""
    shape = Shape(4, 2, 2, 16, (11, 1, 6), (5, 9, 0), 1, 2, window, None)
    batch = build(shape, seed=3)
    ends = image_spans(batch, seed=3)
    out = np.asarray(ragged_paged_attention(*batch.args(), **batch.kwargs(), attend_until=ends))
    widened = 0
    for rows, q_pos, want in dense_per_request(batch, q_end=ends):
        np.testing.assert_allclose(out[rows], want, rtol=1e-5, atol=1e-5)
        widened += int(np.sum(ends[rows] > q_pos))
    assert widened > 0  # some tokens saw keys after their own


@pytest.mark.parametrize("window", [None, 6])
def test_chunked_attention_crosses_chunk_boundaries(window):
    """``attention_chunk_size`` 8: prefill chunks that start mid-chunk and cross one or
    two chunk boundaries, and decodes on either side of a boundary, each see only the
    keys of their own chunk (and window); the dense check would fail without the mask."""
    shape = Shape(4, 2, 2, 16, (13, 1, 1, 20), (5, 8, 15, 0), 1, 2, window, None, 8)
    batch = build(shape, seed=5)
    out = np.asarray(ragged_paged_attention(*batch.args(), **batch.kwargs()))
    full = np.asarray(
        ragged_paged_attention(*batch.args(), sm_scale=batch.sm_scale, sliding_window=window)
    )
    for rows, _, want in dense_per_request(batch):
        np.testing.assert_allclose(out[rows], want, rtol=1e-5, atol=1e-5)
    real = batch.num_real_tokens
    np.testing.assert_array_equal(out[real:], 0.0)
    assert np.abs(out[:real] - full[:real]).max() > 1e-3  # the chunks changed something


@settings(max_examples=12, deadline=None)
@given(shape=shapes(head_dims=(8, 16), page_sizes=(1, 4, 8)), seed=st.integers(0, 2**31 - 1))
def test_sinks_match_dense(shape, seed):
    """Attention sinks (gpt-oss) on random ragged batches (windows, soft caps, chunks,
    padding): each head's sink logit joins the dense softmax and its mass is dropped."""
    batch = build(shape, seed)
    sinks = random_sinks(batch, seed)
    attention = jitted_reference(**batch.kwargs())
    out = np.asarray(attention(*batch.args(), sinks=jnp.asarray(sinks)))
    assert np.isfinite(out).all()
    for rows, _, want in dense_per_request(batch, sinks=sinks):
        np.testing.assert_allclose(out[rows], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[batch.num_real_tokens :], 0.0)


def test_sinks_of_minus_infinity_are_no_sinks_and_finite_ones_differ():
    """``sinks`` None and a sink of -inf give the same output (exp(-inf) = 0 mass); a
    finite sink, even 0 (it adds exp(0 - m)), changes every real token's output."""
    batch = build(Shape(4, 2, 2, 16, (9, 1, 1), (5, 0, 30), 1, 2, 12, None), seed=9)
    attention = jitted_reference(**batch.kwargs())
    plain = np.asarray(attention(*batch.args()))
    hq, real = batch.q.shape[1], batch.num_real_tokens
    minus_inf = np.asarray(attention(*batch.args(), sinks=jnp.full((hq,), -jnp.inf)))
    np.testing.assert_array_equal(minus_inf, plain)
    for sinks in (np.zeros(hq, np.float32), random_sinks(batch, 1)):
        out = np.asarray(attention(*batch.args(), sinks=jnp.asarray(sinks)))
        assert np.isfinite(out).all()
        changed = np.abs(out[:real] - plain[:real]).max(axis=(1, 2))  # per token
        assert (changed > 1e-4).all(), changed
        np.testing.assert_array_equal(out[real:], 0.0)
