"""What one ragged paged MLA call costs (`reference.ragged_paged_mla`'s signature).

An upper bound from the shapes alone, all a `pallas_call` knows at trace time, as the
GQA kernels' `ragged_paged_attention.cost.attention_cost`: every token may attend to a
full page-table row, and every request reads its whole row of pages once (the kernels
read each latent row once for all query heads). Flops per (query head, key) pair:
``2 * W`` for the score over the whole row and ``2 * value_dim`` for the value sum.
"""

from __future__ import annotations

import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention.cost import Cost


def mla_cost(q_shape, kv_cache_shape, page_table_shape, value_dim: int, dtype) -> pl.CostEstimate:
    """Upper bound of one call, for ``pallas_call(cost_estimate=...)``."""
    num_tokens, num_heads, width = q_shape
    _, page_size, _, cache_width = kv_cache_shape
    num_reqs, max_pages = page_table_shape
    itemsize = np.dtype(dtype).itemsize
    span = max_pages * page_size
    pairs = num_tokens * num_heads * span
    kv_bytes = num_reqs * span * cache_width * itemsize
    qo_bytes = num_tokens * num_heads * (width + value_dim) * itemsize
    meta_bytes = 4 * (num_reqs * (max_pages + 2) + 2)
    flops = 2 * (width + value_dim) * pairs
    return Cost(flops, pairs, kv_bytes + qo_bytes + meta_bytes).estimate()
