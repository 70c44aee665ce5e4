"""The engine tests' shared engines, each built once per worker: SmolLM2 (`small_llm`)
and the tiny model (`tiny_llm`). Their users decode enough tokens that both compile
with XLA's full optimization (tests/xla_effort.py)."""

from __future__ import annotations

import pytest

from jaxengine import LLM
from tests.xla_effort import optimized


def small_llm_kwargs(xla_cache_dir: str) -> dict:
    """SmolLM2 with small buckets and a small KV cache (preemption happens)."""
    return dict(
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        compile_token_buckets=[8, 32],
        num_gpu_blocks_override=24,
        swap_space=0,
        compilation_cache_dir=xla_cache_dir,
    )


@pytest.fixture(scope="session")
def small_llm(smollm2_gguf, xla_cache_dir):
    """One engine with `small_llm_kwargs`, shared by the engine tests."""
    with optimized():
        engine = LLM(model=str(smollm2_gguf), **small_llm_kwargs(xla_cache_dir))
    yield engine
    engine.engine.shutdown()


@pytest.fixture(scope="session")
def tiny_llm(tiny_smollm2, xla_cache_dir):
    """`small_llm_kwargs` on the tiny model (SmolLM2's tokenizer, two random layers):
    the shared engine of the tests about scheduling, compilation and the `LLM` surface
    rather than the weights."""
    with optimized():
        engine = LLM(model=str(tiny_smollm2[0]), **small_llm_kwargs(xla_cache_dir))
    yield engine
    engine.engine.shutdown()
