"""Attention metadata: the pytree every model forward receives (DESIGN §3).

All arrays are device arrays of fixed shape per bucket: ``T`` padded tokens, ``R``
padded requests, ``M`` page-table columns. The host builds them in numpy
(`jaxengine.runner.batch`), so this module stays tiny.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a flat ragged batch reads and writes the paged KV cache.

    Invariants: ``query_start_loc`` is non-decreasing with ``query_start_loc[0] == 0``;
    request ``r`` has ``q_len = query_start_loc[r+1] - query_start_loc[r]`` new tokens
    and ``seq_lens[r] >= q_len`` (cached tokens + new tokens); rows ``>= num_seqs`` are
    padding with ``q_len == 0``; padding tokens' ``slot_mapping`` points at the null
    page 0 or past the cache's end.
    """

    seq_lens: jax.Array  # [R] int32: KV length after this step
    query_start_loc: jax.Array  # [R + 1] int32: offsets of each request's tokens
    page_table: jax.Array  # [R, M] int32: page ids per request
    slot_mapping: jax.Array  # [T] int32: page * page_size + offset for each token
    num_seqs: jax.Array  # [] int32: number of real requests
    lora_slots: jax.Array | None = None  # [T] int32: each token's adapter slot (0: none)
    image_rows: jax.Array | None = None
    """[T] int32: the row of the step's image embeddings that is each token's input
    embedding (`runner.encoder`), -1 for a text token; None in a text-only model."""
    attend_until: jax.Array | None = None
    """[T] int32: each token's last key position (its own, or its image's last token
    where an image's tokens attend both ways: Gemma 3); None: causal everywhere."""
    mrope_positions: jax.Array | None = None
    """[3, T] int32: each token's (temporal, height, width) rotary positions in an
    M-RoPE model (Qwen2.5-VL: `layers.rope.apply_mrope`); None: ``positions`` rotate."""
    state_rows: jax.Array | None = None
    """[R] int32: each request's slot in the linear-attention layers' state pools
    (`layers.gated_delta`), -1 for padding requests; None in a model without them."""
