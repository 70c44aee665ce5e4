"""Host-side runner pieces: batch packing, buckets, KV sizing, packed transfers."""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine.runner.batch import SeqChunk, pack_batch
from jaxengine.runner.buckets import BucketSet, default_token_buckets
from jaxengine.runner.kv_sizing import CPU_DEFAULT_BYTES, plan_kv_cache
from jaxengine.runner.transfer import pack_tree, unpack_tree


def test_pack_batch_layout():
    chunks = [SeqChunk([5, 6, 7], 0, [3]), SeqChunk([9], 6, [4, 8])]
    b = pack_batch(chunks, page_size=4, num_tokens=8, num_reqs=4, pages_per_req=3)
    assert b.token_ids.tolist() == [5, 6, 7, 9, 0, 0, 0, 0]
    assert b.positions[:4].tolist() == [0, 1, 2, 6]
    assert b.slot_mapping[:4].tolist() == [12, 13, 14, 8 * 4 + 2]
    assert b.slot_mapping[4:].tolist() == [0] * 4  # padding writes the null page
    assert b.query_start_loc.tolist() == [0, 3, 4, 4, 4]
    assert b.seq_lens.tolist() == [3, 7, 0, 0]
    assert b.logits_indices[:2].tolist() == [2, 3]
    assert int(b.num_seqs) == 2


def test_pack_batch_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        pack_batch(
            [SeqChunk([1] * 9, 0, [1, 2, 3])],
            page_size=4,
            num_tokens=8,
            num_reqs=1,
            pages_per_req=3,
        )
    with pytest.raises(ValueError, match="cannot hold"):
        pack_batch(
            [SeqChunk([1] * 5, 0, [1])], page_size=4, num_tokens=8, num_reqs=1, pages_per_req=3
        )


def test_buckets_cover_every_batch():
    assert default_token_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    buckets = BucketSet([8, 32, 128], max_num_seqs=16)
    assert buckets.select(1, 1).num_tokens == 8
    b = buckets.select(20, 12)
    assert (b.num_tokens, b.num_reqs) == (32, 16)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        buckets.select(129, 1)
    assert buckets.request_sizes == [8, 16]


def test_kv_sizing_precedence_and_errors():
    kw = dict(
        per_block=1000, block_size=16, max_model_len=64, max_num_seqs=4, gpu_memory_utilization=0.9
    )
    assert (
        plan_kv_cache(num_gpu_blocks_override=9, kv_cache_memory_bytes=None, **kw).num_blocks == 9
    )
    assert (
        plan_kv_cache(num_gpu_blocks_override=None, kv_cache_memory_bytes=20_000, **kw).num_blocks
        == 20
    )
    cpu = plan_kv_cache(num_gpu_blocks_override=None, kv_cache_memory_bytes=None, **kw)
    assert cpu.num_blocks == 4 * 4 + 1 <= CPU_DEFAULT_BYTES // 1000
    assert "maximum concurrency" in cpu.describe(64)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        plan_kv_cache(num_gpu_blocks_override=3, kv_cache_memory_bytes=None, **kw)
    # a device's memory: (util - 5% for activations) x limit, less what is in use
    device = plan_kv_cache(
        num_gpu_blocks_override=None, kv_cache_memory_bytes=None, memory=(100_000, 5_000), **kw
    )
    assert device.num_blocks == int(100_000 * (0.9 - 0.05) - 5_000) // 1000
    with pytest.raises(ValueError, match=r"weights take 0.00 GiB .* nothing is left"):
        plan_kv_cache(
            num_gpu_blocks_override=None, kv_cache_memory_bytes=None, memory=(100_000, 90_000), **kw
        )


def test_pack_tree_round_trip():
    tree = {
        "a": np.arange(6, dtype=np.int32).reshape(2, 3),
        "b": np.float32(2.5),
        "c": (np.ones(4, np.float32), np.array([True, False])),
    }
    buffers, spec = pack_tree(tree)
    assert len(buffers) == 3  # one per dtype
    back = unpack_tree(buffers, spec)
    np.testing.assert_array_equal(back["a"], tree["a"])
    assert back["b"] == 2.5 and back["c"][1].tolist() == [True, False]
    assert hash(spec) == hash(pack_tree(tree)[1])
