"""KVCacheManager and block hashing: prefix hits, allocation, eviction, swap."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from jaxengine.core.kv_cache.hashing import extend_block_hashes, get_hash_fn
from jaxengine.core.kv_cache.manager import KVCacheManager
from jaxengine.core.request import Request

BS = 4


def make_req(rid, tokens, **kw):
    return Request(rid, tokens, SimpleNamespace(max_tokens=16), **kw)


def compute(mgr, req, n, hits=()):
    """Allocate for n tokens, pretend they were computed, publish full blocks."""
    ids = mgr.allocate_slots(req, n, list(hits))
    assert ids is not None
    req.num_computed_tokens += n + len(hits) * BS
    mgr.cache_full_blocks(req)
    return ids


# ---- hashing ---------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_chained_hashes(algo):
    fn = get_hash_fn(algo)
    a = extend_block_hashes([], list(range(12)), 12, BS, fn)
    b = extend_block_hashes([], [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], 12, BS, fn)
    assert len(a) == 3 and a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]  # the chain carries the difference forward
    salted = extend_block_hashes([], list(range(12)), 12, BS, fn, cache_salt="s")
    assert all(x != y for x, y in zip(a, salted, strict=True))
    # Incremental extension equals one-shot hashing; partial blocks are not hashed.
    inc = extend_block_hashes([], list(range(12)), 7, BS, fn)
    assert len(inc) == 1
    assert extend_block_hashes(inc, list(range(12)), 12, BS, fn) == a


def test_sha256_hash_is_stable_across_processes():
    code = (
        "from jaxengine.core.kv_cache.hashing import extend_block_hashes, get_hash_fn;"
        "print(extend_block_hashes([], list(range(8)), 8, 4, get_hash_fn('sha256'),"
        " cache_salt='x')[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    }
    assert len(outs) == 1


def test_unknown_hash_algo():
    with pytest.raises(ValueError):
        get_hash_fn("md5")


# ---- prefix cache ------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_prefix_hit_shares_blocks(algo):
    mgr = KVCacheManager(32, BS, hash_algo=algo)
    a = make_req("a", list(range(10)))
    compute(mgr, a, 10)
    assert mgr.prefix_queries == 10 and mgr.prefix_hits == 0
    b = make_req("b", list(range(8)) + [99, 98, 97])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8 and hits == mgr.get_block_ids("a")[:2]
    compute(mgr, b, b.num_tokens - n, hits)
    assert mgr.get_block_ids("b")[:2] == hits
    assert [mgr.pool.blocks[i].ref_cnt for i in hits] == [2, 2]
    assert mgr.prefix_queries == 21 and mgr.prefix_hits == 8
    mgr.free(a)
    mgr.free(b)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 31


def test_never_hits_the_whole_prompt():
    mgr = KVCacheManager(32, BS)
    a = make_req("a", list(range(8)))
    compute(mgr, a, 8)
    mgr.free(a)
    b = make_req("b", list(range(8)))  # identical, exactly two blocks
    hits, n = mgr.get_computed_blocks(b)
    assert n == 4 and len(hits) == 1  # the last block is recomputed for logits


def test_salt_and_prompt_logprobs_isolate():
    mgr = KVCacheManager(32, BS)
    compute(mgr, make_req("a", list(range(9))), 9)
    assert mgr.get_computed_blocks(make_req("b", list(range(9)), cache_salt="u1"))[1] == 0
    lp = Request("c", list(range(9)), SimpleNamespace(prompt_logprobs=1))
    assert mgr.get_computed_blocks(lp) == ([], 0)
    assert mgr.get_computed_blocks(make_req("d", list(range(9))))[1] == 8


def test_caching_disabled():
    mgr = KVCacheManager(32, BS, enable_caching=False)
    a = make_req("a", list(range(9)))
    compute(mgr, a, 9)
    assert mgr.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)
    assert not mgr.pool.cached and mgr.prefix_queries == 0


def test_only_computed_blocks_are_published():
    mgr = KVCacheManager(32, BS)
    a = make_req("a", list(range(12)))
    mgr.allocate_slots(a, 12)  # scheduled, not computed yet
    assert mgr.get_computed_blocks(make_req("b", list(range(12))))[1] == 0
    a.num_computed_tokens = 6
    mgr.cache_full_blocks(a)
    assert mgr.get_computed_blocks(make_req("c", list(range(12))))[1] == 4


def test_allocate_fails_without_side_effects():
    mgr = KVCacheManager(5, BS)  # 4 usable blocks
    a = make_req("a", list(range(12)))
    compute(mgr, a, 12)
    b = make_req("b", list(range(8)))
    assert mgr.allocate_slots(b, 8) is None
    assert mgr.num_free_blocks == 1 and mgr.get_block_ids("b") == []
    mgr.check_invariants()


def test_hits_on_free_blocks_count_against_free_space():
    mgr = KVCacheManager(5, BS)  # 4 usable
    a = make_req("a", list(range(12)))
    compute(mgr, a, 12)
    mgr.free(a)  # 3 cached free blocks + 1 never used
    b = make_req("b", list(range(12)) + list(range(100, 108)))  # 20 tokens: 5 blocks
    hits, n = mgr.get_computed_blocks(b)
    assert n == 12
    assert mgr.allocate_slots(b, 8, hits) is None  # needs 2 fresh, only 1 after hits
    assert mgr.allocate_slots(b, 4, hits) is not None
    mgr.check_invariants()


def test_free_puts_sequence_tail_first_and_evicts_lru():
    mgr = KVCacheManager(7, BS)  # 6 usable
    a = make_req("a", list(range(12)))
    b = make_req("b", list(range(50, 62)))
    compute(mgr, a, 12)
    compute(mgr, b, 12)
    ida, idb = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    mgr.free(a)
    mgr.free(b)
    assert mgr.pool.free_block_ids() == ida[::-1] + idb[::-1]
    # A new request needing 2 blocks evicts a's tail: a's head block is still a hit.
    c = make_req("c", list(range(200, 208)))
    compute(mgr, c, 8)
    assert mgr.get_computed_blocks(make_req("a2", list(range(12))))[1] == 4
    assert mgr.get_computed_blocks(make_req("b2", list(range(50, 62))))[1] == 8
    mgr.check_invariants()


def test_block_stats_count_the_prefix_cache_until_eviction():
    """vLLM's prefix-cache gauges: cached blocks stay counted while free, and leave
    the count only when a new allocation evicts them."""
    mgr = KVCacheManager(7, BS)  # 6 usable
    stats = mgr.block_stats
    assert stats() == {
        "num_kv_cache_total_blocks": 6,
        "num_prefix_cached_blocks": 0,
        "num_prefix_cached_tokens": 0,
    }
    a = make_req("a", list(range(14)))  # 3 full blocks + 2 tokens
    compute(mgr, a, 14)
    assert stats()["num_prefix_cached_blocks"] == 3  # the partial block is not cached
    assert stats()["num_prefix_cached_tokens"] == 3 * BS
    mgr.free(a)
    assert stats()["num_prefix_cached_blocks"] == 3  # free, still findable
    compute(mgr, make_req("b", list(range(100, 124))), 24)  # all 6 blocks: evicts a's
    assert stats() == {
        "num_kv_cache_total_blocks": 6,
        "num_prefix_cached_blocks": 6,
        "num_prefix_cached_tokens": 6 * BS,
    }


def test_grow_by_decode():
    mgr = KVCacheManager(8, BS)
    a = make_req("a", list(range(4)))
    assert len(compute(mgr, a, 4)) == 1
    for t in range(5):
        a.append_output_token_ids(t)
        new = compute(mgr, a, 1)
        assert len(new) == (1 if a.num_computed_tokens % BS == 1 else 0)
    assert len(mgr.get_block_ids("a")) == 3
    mgr.free(a)
    mgr.free(a)  # idempotent
    mgr.check_invariants()
    assert mgr.num_free_blocks == 7


# ---- swap --------------------------------------------------------------------------
def test_swap_out_and_in():
    mgr = KVCacheManager(8, BS, num_host_blocks=4)
    a = make_req("a", list(range(10)))
    compute(mgr, a, 10)
    dev = mgr.get_block_ids("a")
    assert mgr.can_swap_out(a)
    pairs = mgr.swap_out(a)
    assert [d for d, _ in pairs] == dev and mgr.get_block_ids("a") == []
    assert mgr.num_free_blocks == 7 and mgr.num_free_host_blocks == 1
    assert mgr.is_swapped("a")
    mgr.check_invariants()
    host = [h for _, h in pairs]
    assert mgr.can_swap_in(a, 1)
    back = mgr.swap_in(a)
    assert [h for h, _ in back] == host
    assert mgr.get_block_ids("a") == [d for _, d in back]
    assert mgr.num_free_host_blocks == 4
    mgr.check_invariants()
    mgr.free(a)
    assert mgr.num_free_blocks == 7


def test_swap_needs_host_room_and_free_releases_host_blocks():
    mgr = KVCacheManager(8, BS, num_host_blocks=2)
    a = make_req("a", list(range(10)))  # 3 blocks
    compute(mgr, a, 10)
    assert not mgr.can_swap_out(a)
    b = make_req("b", list(range(20, 26)))
    compute(mgr, b, 6)
    mgr.swap_out(b)
    mgr.free(b)  # aborted while swapped
    assert mgr.num_free_host_blocks == 2
    mgr.check_invariants()
