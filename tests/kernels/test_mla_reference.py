"""The reference ragged paged MLA (`pallas_kernels.mla.reference`) against a dense
numpy computation of multi-head latent attention in its *expanded* form (every head's
keys ``W_uk c`` and values ``W_uv c`` built from the latents, as transformers does), on
ragged batches: decodes, prefill chunks after cached context, and both mixed, with
padding tokens and padding requests, pages scattered at random. The reference runs on
the absorbed queries and its output goes through ``W_uv``, as `layers.mla` does; so
this checks the absorption identity and the paged, ragged bookkeeping together."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla.reference import ragged_paged_mla, update_mla_cache

HQ, NOPE, ROPE, LAT, V = 4, 16, 8, 32, 12


@dataclasses.dataclass
class MLABatch:
    q_nope: np.ndarray  # [T, Hq, NOPE]
    q_pe: np.ndarray  # [T, Hq, ROPE]
    rows: np.ndarray  # [tokens of all requests, LAT + ROPE] by request
    w_uk: np.ndarray  # [Hq, NOPE, LAT]
    w_uv: np.ndarray  # [Hq, V, LAT]
    kv_cache: np.ndarray  # [P, S, 1, LAT + ROPE]
    seq_lens: np.ndarray
    page_table: np.ndarray
    query_start_loc: np.ndarray
    num_seqs: int
    starts: list[int]  # each request's first row in ``rows``


def build(q_lens, ctx, page_size, pad_tokens=3, pad_reqs=1, seed=0) -> MLABatch:
    """Requests with ``q_lens[r]`` new tokens after ``ctx[r]`` cached ones; their rows
    written into random distinct pages (page 0 left as the null page)."""
    rng = np.random.default_rng(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx, strict=True)]
    pages_per = [-(-n // page_size) for n in seq_lens]
    max_pages = max(pages_per) + 1
    num_pages = sum(pages_per) + 2
    ids = rng.permutation(np.arange(1, num_pages))
    width = LAT + ROPE
    cache = rng.normal(size=(num_pages, page_size, 1, width)).astype(np.float32)  # junk
    num_reqs = len(q_lens) + pad_reqs
    page_table = np.zeros((num_reqs, max_pages), np.int32)
    rows, starts, used = [], [], 0
    for r, n in enumerate(seq_lens):
        mine = ids[used : used + pages_per[r]]
        used += pages_per[r]
        page_table[r, : len(mine)] = mine
        row = rng.normal(size=(n, width)).astype(np.float32)
        for j in range(n):
            cache[mine[j // page_size], j % page_size, 0] = row[j]
        starts.append(sum(len(x) for x in rows))
        rows.append(row)
    num_tokens = sum(q_lens) + pad_tokens
    qsl = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_reqs]).astype(np.int32)
    lens = np.array(seq_lens + [0] * pad_reqs, np.int32)
    return MLABatch(
        q_nope=rng.normal(size=(num_tokens, HQ, NOPE)).astype(np.float32),
        q_pe=rng.normal(size=(num_tokens, HQ, ROPE)).astype(np.float32),
        rows=np.concatenate(rows),
        w_uk=(rng.normal(size=(HQ, NOPE, LAT)) / np.sqrt(LAT)).astype(np.float32),
        w_uv=rng.normal(size=(HQ, V, LAT)).astype(np.float32),
        kv_cache=cache,
        seq_lens=lens,
        page_table=page_table,
        query_start_loc=qsl,
        num_seqs=len(q_lens),
        starts=starts,
    )


def dense_expanded(b: MLABatch, r: int, sm_scale: float) -> np.ndarray:
    """Request ``r``'s outputs ``[q_len, Hq, V]`` in float64 from expanded keys/values."""
    n, q0, q1 = b.seq_lens[r], b.query_start_loc[r], b.query_start_loc[r + 1]
    rows = b.rows[b.starts[r] : b.starts[r] + n].astype(np.float64)
    c, k_pe = rows[:, :LAT], rows[:, LAT:]  # [n, L], [n, R]
    k_nope = np.einsum("hdl,nl->nhd", b.w_uk, c)  # [n, Hq, NOPE]
    v = np.einsum("hvl,nl->nhv", b.w_uv, c)  # [n, Hq, V]
    s = np.einsum("qhd,nhd->hqn", b.q_nope[q0:q1], k_nope)
    s += np.einsum("qhd,nd->hqn", b.q_pe[q0:q1], k_pe)
    s *= sm_scale
    q_pos = np.arange(n - (q1 - q0), n)
    s = np.where(np.arange(n)[None, None, :] <= q_pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqn,nhv->qhv", p, v)


def absorbed(b: MLABatch, sm_scale: float) -> np.ndarray:
    """The reference on ``[q_nope W_uk; q_pe]``, then ``W_uv``: ``[T, Hq, V]``."""
    q = jnp.concatenate([jnp.einsum("thd,hdl->thl", b.q_nope, b.w_uk), b.q_pe], axis=-1)
    run = jax.jit(ragged_paged_mla, static_argnames=("sm_scale", "value_dim", "pages_per_chunk"))
    out = run(
        q,
        jnp.asarray(b.kv_cache),
        jnp.asarray(b.seq_lens),
        jnp.asarray(b.page_table),
        jnp.asarray(b.query_start_loc),
        jnp.asarray(b.num_seqs, jnp.int32),
        sm_scale=sm_scale,
        value_dim=LAT,
        pages_per_chunk=2,
    )  # [T, Hq, L]
    assert out.shape == (q.shape[0], HQ, LAT)
    return np.einsum("thl,hvl->thv", np.asarray(out, np.float64), b.w_uv)


CASES = {
    "decode": ([1, 1, 1], [0, 13, 30]),
    "prefill_chunks": ([9, 5], [0, 17]),
    "mixed": ([1, 7, 1, 12], [21, 3, 0, 9]),
}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_mla_matches_dense_expanded_attention(case, page_size):
    q_lens, ctx = CASES[case]
    b = build(q_lens, ctx, page_size, seed=page_size)
    scale = (NOPE + ROPE) ** -0.5
    got = absorbed(b, scale)
    for r in range(b.num_seqs):
        q0, q1 = b.query_start_loc[r], b.query_start_loc[r + 1]
        np.testing.assert_allclose(got[q0:q1], dense_expanded(b, r, scale), rtol=2e-5, atol=2e-5)
    pad = got[b.query_start_loc[b.num_seqs] :]
    assert pad.shape[0] == 3 and np.all(pad == 0)  # padding tokens: zeros, no NaN


def test_update_writes_rows_and_drops_outside_slots():
    """Each token's ``[latent; k_rope]`` lands in its slot; negative slots and slots
    past the end change nothing."""
    page_size, num_pages = 4, 3
    cache = jnp.zeros((num_pages, page_size, 1, LAT + ROPE))
    rng = np.random.default_rng(0)
    latent = rng.normal(size=(4, 1, LAT)).astype(np.float32)
    k_rope = rng.normal(size=(4, 1, ROPE)).astype(np.float32)
    slots = jnp.array([5, 11, -1, num_pages * page_size], jnp.int32)
    out = np.asarray(update_mla_cache(cache, latent, k_rope, slots))
    flat = out.reshape(-1, LAT + ROPE)
    for t, slot in enumerate([5, 11]):
        np.testing.assert_array_equal(flat[slot, :LAT], latent[t, 0])
        np.testing.assert_array_equal(flat[slot, LAT:], k_rope[t, 0])
    written = np.zeros(len(flat), bool)
    written[[5, 11]] = True
    assert np.all(flat[~written] == 0)
