"""Bytes per device of arrays, read from their shards (tests, benchmarks, docs)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax


def bytes_per_device(tree: Any) -> Counter:
    """Bytes each device holds of the arrays in ``tree`` (from their addressable shards)."""
    held: Counter = Counter()
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return held


def total_bytes(tree: Any) -> int:
    """Bytes of the arrays in ``tree`` as one copy (whatever their sharding)."""
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))
