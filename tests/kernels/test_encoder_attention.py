"""The encoder's padded attention against the paged reference with ``causal=False``.

Batches are an encoder step's: every request whole in the step (no cached prefix),
padding rows and tokens after the real ones. The reference reads the step's k/v from
a paged cache they were written to; `encoder_attention` takes them as they are.

The vision tower's segment forms (`window_attention`, `blocked_segment_attention`)
against the dense `segment_attention_reference`, on random segment layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from ragged_batches import Shape, build, jitted_reference

from pallas_kernels.encoder_attention import (
    blocked_segment_attention,
    encoder_attention,
    padded_attention,
    segment_attention_reference,
    window_attention,
)
from pallas_kernels.kv_cache_update.reference import update_kv_cache
from pallas_kernels.ragged_paged_attention import reference


def encoder_batch(q_lens, ctx_lens=None, seed=0, heads=2, head_dim=32, pad_tokens=3):
    """(batch, k, v, cache with this step's k/v written): a whole-request step."""
    ctx_lens = ctx_lens or (0,) * len(q_lens)
    shape = Shape(16, heads, 1, head_dim, tuple(q_lens), tuple(ctx_lens), 1, pad_tokens, None, None)
    batch = build(shape, seed)
    rng = np.random.default_rng(seed + 1)
    k, v = (rng.standard_normal(batch.q.shape).astype(np.float32) for _ in range(2))
    slots = np.full(batch.q.shape[0], -1, np.int32)  # padding tokens: dropped
    for r, (c, n) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        pos = c + np.arange(n)
        start = batch.query_start_loc[r]
        slots[start : start + n] = batch.page_table[r, pos // 16] * 16 + pos % 16
    cache = update_kv_cache(jnp.asarray(batch.kv_cache), jnp.asarray(k), jnp.asarray(v), slots)
    return batch, jnp.asarray(k), jnp.asarray(v), cache


def reference_out(batch, cache) -> np.ndarray:
    q, _, *meta = batch.args()
    out = jitted_reference(sm_scale=batch.sm_scale, causal=False)(q, cache, *meta)
    return np.asarray(out)


@settings(max_examples=3, deadline=None)
@given(q_lens=st.lists(st.integers(1, 32), min_size=1, max_size=6), seed=st.integers(0, 99))
@example(q_lens=[32, 1, 31, 7], seed=3)
def test_padded_matches_reference(q_lens, seed):
    batch, k, v, cache = encoder_batch(q_lens, seed=seed)
    q, _, _, _, qsl, num_seqs = batch.args()
    got = padded_attention(q, k, v, qsl, num_seqs, sm_scale=batch.sm_scale, max_len=32)
    real = batch.num_real_tokens
    want = reference_out(batch, cache)
    np.testing.assert_allclose(np.asarray(got)[:real], want[:real], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got)[real:], 0.0)


CASES = [  # (q_lens, whether encoder_attention pads them)
    ((5, 32, 17), True),  # all at most 32 tokens long
    ((3, 33, 9), False),  # one longer: the paged kernel over a cache of this step's keys
    ((40, 1, 16, 17), False),  # pages of 16 filled exactly, and one token over
]


@pytest.mark.parametrize(("q_lens", "padded"), CASES)
def test_each_branch_matches_reference(q_lens, padded):
    """Either branch equals the paged reference over the engine's cache, though
    `encoder_attention` reads only this step's k/v (`step_cache` for the paged one);
    a fallback that answers NaN shows which branch ran."""
    batch, k, v, cache = encoder_batch(q_lens, seed=len(q_lens))
    q, _, _, page_table, qsl, num_seqs = batch.args()
    blank = jnp.full_like(cache, jnp.nan)  # the engine's cache: its shape only
    real = batch.num_real_tokens
    for fallback in (reference.ragged_paged_attention, lambda q, *_, **__: q * jnp.nan):
        run = jax.jit(
            functools.partial(
                encoder_attention,
                fallback=fallback,
                update=lambda c, slots: update_kv_cache(c, k, v, slots),
            ),
            static_argnames="sm_scale",
        )
        got = np.asarray(run(q, k, v, blank, page_table, qsl, num_seqs, sm_scale=batch.sm_scale))
        if fallback is reference.ragged_paged_attention:
            want = reference_out(batch, cache)[:real]
            np.testing.assert_allclose(got[:real], want, atol=2e-5)
            np.testing.assert_array_equal(got[real:], 0.0)
        else:
            assert np.isfinite(got[:real]).all() == padded


SEGMENT_ROWS = 100  # every segment case: one shape, so each form compiles once
window_jit = jax.jit(functools.partial(window_attention, sm_scale=0.3, max_len=8))
blocked_jit = jax.jit(functools.partial(blocked_segment_attention, sm_scale=0.3, block=32))
dense_jit = jax.jit(functools.partial(segment_attention_reference, sm_scale=0.3))


def segment_inputs(seed: int, heads: int = 2, head_dim: int = 8):
    rng = np.random.default_rng(seed)
    shape = (SEGMENT_ROWS, heads, head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    return q, k, v, rng


@settings(max_examples=4, deadline=None)
@given(runs=st.lists(st.integers(1, 8), min_size=1, max_size=11), seed=st.integers(0, 99))
@example(runs=[8, 3, 8, 1, 5, 8, 8, 2], seed=1)  # runs across block edges, 57 padding rows
def test_window_attention_matches_reference(runs, seed):
    """Contiguous runs of at most ``max_len`` rows (windows), then padding rows in one
    run, longer than that: every row of a short run equals the dense reference;
    padding rows are finite."""
    real = sum(runs)
    ids = [np.full(n, i) for i, n in enumerate(runs)] + [np.full(SEGMENT_ROWS - real, -1)]
    q, k, v, _ = segment_inputs(seed)
    seg = jnp.asarray(np.concatenate(ids), jnp.int32)
    got = np.asarray(window_jit(q, k, v, seg))
    np.testing.assert_allclose(got[:real], np.asarray(dense_jit(q, k, v, seg))[:real], atol=2e-6)
    assert np.isfinite(got).all()


@settings(max_examples=4, deadline=None)
@given(segments=st.integers(1, 4), seed=st.integers(0, 99))
def test_blocked_attention_matches_reference(segments, seed):
    """Any segment ids (not contiguous), query blocks of 32 (the last one part
    padding): equal to the reference."""
    q, k, v, rng = segment_inputs(seed)
    seg = jnp.asarray(rng.integers(0, segments, SEGMENT_ROWS), jnp.int32)
    got, want = blocked_jit(q, k, v, seg), dense_jit(q, k, v, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)
