"""``--kv-cache-dtype``: the cache is stored in that dtype and sized by its bytes."""

from __future__ import annotations

import logging

import jax.numpy as jnp

from tests.sharding.engine_checks import build, greedy


def test_bfloat16_cache_halves_the_bytes_and_still_generates(llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="jaxengine.executor.build"):
        with build(llama_dir, kv_cache_dtype="bfloat16", num_gpu_blocks_override=40) as llm:
            runner = llm.engine.executor.runner
            assert {c.dtype for c in runner.kv_caches} == {jnp.dtype(jnp.bfloat16)}
            half = llm.engine.kv_cache_size.bytes_per_block
            assert len(greedy(llm)[0]) > 0
        with build(llama_dir, kv_cache_dtype="auto", num_gpu_blocks_override=40) as llm:
            runner = llm.engine.executor.runner
            assert {c.dtype for c in runner.kv_caches} == {jnp.dtype(jnp.float32)}
            assert llm.engine.kv_cache_size.bytes_per_block == 2 * half
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
    assert lines[0].endswith("bfloat16") and lines[1].endswith("float32")
