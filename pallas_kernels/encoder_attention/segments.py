"""Bidirectional attention within segments of one sequence (plain JAX, any backend):
a vision tower's windows and whole images (Qwen2.5-VL).

Each of ``N`` rows carries a segment id and attends to the rows with the same id.
`segment_attention_reference` is the definition: dense scores ``[H, N, N]`` masked to
the segment, so its memory grows as ``N**2`` (about 4 GiB of scores at 16 heads and
8192 rows). The two forms the tower runs keep it linear in ``N``:

- `window_attention`, when every segment is a contiguous run of at most ``max_len``
  rows (windows in window order): queries in blocks of ``max_len`` rows, each against
  the keys of its own block and its two neighbours (a run that touches a block lies
  within them), so the scores are ``[N / max_len, H, max_len, 3 * max_len]``;
- `blocked_segment_attention`, for any segments (whole images): ``jax.lax.map`` over
  blocks of ``block`` query rows against all keys, so the largest live tensor is one
  block's scores ``[H, block, N]``.

Both compute what the reference does (the same masked float32 softmax) for every row
whose segment satisfies their precondition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30
"""Masked scores: finite, so a row that sees no key is uniform, never NaN."""
_NO_SEGMENT = jnp.iinfo(jnp.int32).min
"""Segment id of the rows padded onto a sequence (equal to no real row's)."""


def _attend(q, k, v, same, scale: float) -> jax.Array:
    """``q [..., Q, H, D]`` over ``k, v [..., K, H, D]`` where ``same [..., Q, K]``;
    scores and softmax in float32, probabilities in ``v``'s dtype -> ``[..., Q, H, D]``."""
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(same[..., None, :, :], scores * scale, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", probs, v)


def segment_attention_reference(q, k, v, segments: jax.Array, *, sm_scale: float) -> jax.Array:
    """``q, k, v [N, H, D]``, ``segments [N]`` int -> ``[N, H, D]``: each row attends
    to every row of its segment (itself included). Dense: scores ``[H, N, N]``."""
    return _attend(q, k, v, segments[:, None] == segments[None, :], sm_scale)


def _pad_rows(x: jax.Array, rows: int, value=0) -> jax.Array:
    pad = [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=value)


def window_attention(q, k, v, segments: jax.Array, *, sm_scale: float, max_len: int) -> jax.Array:
    """`segment_attention_reference` for segments that are contiguous runs of at most
    ``max_len`` rows. A row of a longer run (a tower's padding) sees only the part of
    its run within its block and the two next to it: its output is finite, not the
    reference's. Memory and work: ``3 * max_len`` keys per query."""
    n, heads, dim = q.shape
    blocks = -(-n // max_len)
    rows = blocks * max_len
    seg = _pad_rows(segments.astype(jnp.int32), rows, _NO_SEGMENT)
    qb = _pad_rows(q, rows).reshape(blocks, max_len, heads, dim)

    def neighbours(x: jax.Array, fill=0) -> jax.Array:  # [rows, ...] -> [blocks, 3L, ...]
        padded = jnp.pad(x, [(max_len, max_len)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        shifted = padded.reshape(blocks + 2, max_len, *x.shape[1:])
        return jnp.concatenate([shifted[:-2], shifted[1:-1], shifted[2:]], axis=1)

    kb, vb = neighbours(_pad_rows(k, rows)), neighbours(_pad_rows(v, rows))
    keys_seg = neighbours(seg, _NO_SEGMENT)  # [blocks, 3 * max_len]
    same = seg.reshape(blocks, max_len)[:, :, None] == keys_seg[:, None, :]
    out = _attend(qb, kb, vb, same, sm_scale)  # [blocks, max_len, H, D]
    return out.reshape(rows, heads, dim)[:n]


def blocked_segment_attention(
    q, k, v, segments: jax.Array, *, sm_scale: float, block: int
) -> jax.Array:
    """`segment_attention_reference` one block of ``block`` query rows at a time
    (``jax.lax.map``: the blocks run in sequence), each against all ``N`` keys: live
    scores ``[H, block, N]``. ``N <= block``: one dense call."""
    n, heads, dim = q.shape
    if n <= block:
        return segment_attention_reference(q, k, v, segments, sm_scale=sm_scale)
    blocks = -(-n // block)
    rows = blocks * block
    qb = _pad_rows(q, rows).reshape(blocks, block, heads, dim)
    segments = segments.astype(jnp.int32)
    sb = _pad_rows(segments, rows, _NO_SEGMENT).reshape(blocks, block)

    def one(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        q_block, seg_block = args  # [block, H, D], [block]
        return _attend(q_block, k, v, seg_block[:, None] == segments[None, :], sm_scale)

    return jax.lax.map(one, (qb, sb)).reshape(rows, heads, dim)[:n]
