"""BlockPool: null block, ref counts, LRU free list (eviction order), hash map."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.core.kv_cache.block_pool import BlockPool


def test_null_block_never_handed_out():
    pool = BlockPool(8)
    assert pool.num_usable_blocks == 7 and pool.num_free_blocks == 7
    ids = [b.block_id for b in pool.get_new_blocks(7)]
    assert sorted(ids) == list(range(1, 8))
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.check_invariants()


def test_host_pool_has_no_null_block():
    pool = BlockPool(4, reserve_null_block=False)
    assert sorted(b.block_id for b in pool.get_new_blocks(4)) == [0, 1, 2, 3]


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and b.block_id not in pool.free_block_ids()
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and b.block_id in pool.free_block_ids()
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])
    pool.check_invariants()


def test_eviction_order_lru_tail_first():
    pool = BlockPool(9)
    a = pool.get_new_blocks(4)  # sequence A: blocks a0..a3
    b = pool.get_new_blocks(4)  # sequence B
    for i, blk in enumerate(a + b):
        assert pool.cache_block(blk, ("h", i))
    pool.free_blocks(reversed(a))  # A finishes first: its tail is evicted first
    pool.free_blocks(reversed(b))
    order = pool.free_block_ids()
    assert order == [blk.block_id for blk in reversed(a)] + [blk.block_id for blk in reversed(b)]
    # Reallocation pops in that order and evicts the hashes.
    got = pool.get_new_blocks(2)
    assert [g.block_id for g in got] == order[:2]
    assert pool.get_cached_block(("h", 3)) is None and pool.get_cached_block(("h", 2)) is None
    assert pool.get_cached_block(("h", 1)) is a[1]
    pool.check_invariants()


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[0], "x")
    pool.cache_block(blocks[1], "y")
    pool.free_blocks(reversed(blocks))
    head = pool.free_block_ids()[:2]
    assert set(head) == {blocks[2].block_id, blocks[3].block_id}
    assert pool.free_block_ids()[2:] == [blocks[1].block_id, blocks[0].block_id]


def test_touch_takes_cached_free_block_off_free_list():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 42)
    pool.free_blocks([b])
    assert pool.get_cached_block(42) is b and pool.num_free_blocks == 3
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    assert pool.get_cached_block(42) is b  # a hit keeps the hash
    pool.check_invariants()


def test_one_block_per_hash():
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    assert pool.cache_block(b1, "h")
    assert not pool.cache_block(b2, "h")
    assert b2.block_hash is None and pool.get_cached_block("h") is b1
    assert pool.cache_block(b1, "h")  # idempotent


def test_reset_prefix_cache():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, "h")
    assert not pool.reset_prefix_cache()  # a block is in use
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block("h") is None and b.block_hash is None
    pool.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "touch", "cache"]), st.integers(0, 5)),
        max_size=60,
    )
)
def test_random_operations_keep_invariants(ops):
    """Model check: ref counts equal held references; draining frees everything."""
    pool = BlockPool(10)
    held = []  # one entry per reference
    for op, k in ops:
        if op == "alloc" and k <= pool.num_free_blocks:
            held += pool.get_new_blocks(k)
        elif op == "free" and held:
            pool.free_blocks([held.pop(k % len(held))])
        elif op == "touch" and held:
            blk = held[k % len(held)]
            pool.touch([blk])
            held.append(blk)
        elif op == "cache" and held:
            pool.cache_block(held[k % len(held)], k)
        pool.check_invariants()
        for blk in pool.blocks[1:]:
            assert blk.ref_cnt == sum(h is blk for h in held)
    pool.free_blocks(held)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks
