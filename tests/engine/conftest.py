"""One small engine on the default model, compiled once and shared by engine tests."""

from __future__ import annotations

import pytest

from jaxengine import LLM


@pytest.fixture(scope="session")
def small_llm(smollm2_gguf, tmp_path_factory):
    """SmolLM2 with small buckets and a small KV cache (preemption happens)."""
    engine = LLM(
        model=str(smollm2_gguf),
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        compile_token_buckets=[8, 32],
        num_gpu_blocks_override=24,
        swap_space=0,
        compilation_cache_dir=str(tmp_path_factory.getbasetemp() / "xla-cache"),
    )
    yield engine
    engine.engine.shutdown()
