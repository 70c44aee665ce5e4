"""What one ragged paged attention call costs: flops, transcendentals and bytes.

Two views of the same count:

- `attention_cost` works from shapes alone (all a `pallas_call` knows at trace time)
  and gives XLA's scheduler an upper bound as a `pl.CostEstimate`: every token may
  attend to a full page-table row, every request reads its whole row of pages once.
- `batch_cost` works from a concrete batch (host numpy) and counts what the kernel
  must do: each new token attends to its causal (and windowed) span, each request
  reads the K and V of the keys its tokens see, once. The benchmark divides these
  by the measured time for achieved FLOP/s and bandwidth (the roofline).

Flops: QK^T and PV are 2 * D flops per (query head, key) pair each, so 4 * D.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: int
    transcendentals: int
    bytes_accessed: int

    def estimate(self) -> pl.CostEstimate:
        return pl.CostEstimate(
            flops=int(self.flops),
            transcendentals=int(self.transcendentals),
            bytes_accessed=int(self.bytes_accessed),
        )


def attention_cost(q_shape, kv_cache_shape, page_table_shape, dtype) -> pl.CostEstimate:
    """Upper bound of one call from its shapes, for ``pallas_call(cost_estimate=...)``."""
    num_tokens, num_q_heads, head_dim = q_shape
    _, page_size, two_hkv, _ = kv_cache_shape
    num_reqs, max_pages = page_table_shape
    itemsize = np.dtype(dtype).itemsize
    span = max_pages * page_size
    pairs = num_tokens * num_q_heads * span
    kv_bytes = num_reqs * span * two_hkv * head_dim * itemsize
    qo_bytes = 2 * num_tokens * num_q_heads * head_dim * itemsize
    meta_bytes = 4 * (num_reqs * (max_pages + 2) + 2)
    return Cost(4 * head_dim * pairs, pairs, kv_bytes + qo_bytes + meta_bytes).estimate()


def batch_cost(
    seq_lens,
    query_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    sliding_window: int | None = None,
) -> Cost:
    """The work a batch needs (real requests only): its flops and bytes moved."""
    seq_lens = np.asarray(seq_lens, np.int64)
    query_lens = np.asarray(query_lens, np.int64)
    pairs = 0
    keys_read = 0
    for seq_len, q_len in zip(seq_lens, query_lens, strict=True):
        q_pos = np.arange(seq_len - q_len, seq_len)
        seen = q_pos + 1  # causal: keys 0..q_pos
        first = np.zeros_like(q_pos)
        if sliding_window is not None:
            first = np.maximum(q_pos - sliding_window + 1, 0)
            seen = q_pos - first + 1
        pairs += int(seen.sum())
        if q_len:
            keys_read += int(seq_len - first[0])
    kv_bytes = keys_read * 2 * num_kv_heads * head_dim * itemsize
    qo_bytes = 2 * int(query_lens.sum()) * num_q_heads * head_dim * itemsize
    return Cost(4 * head_dim * num_q_heads * pairs, num_q_heads * pairs, kv_bytes + qo_bytes)
