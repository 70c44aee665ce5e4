"""What the parallelism tests measure on an `LLM`: outputs, logits, bytes per device."""

from __future__ import annotations

import jax
import numpy as np

from jaxengine import LLM, SamplingParams
from jaxengine.runner.batch import SeqChunk, pack_batch
from sharding.memory import bytes_per_device, total_bytes  # noqa: F401 (re-exported)
from tests.sharding.conftest import ENGINE_KWARGS, MAX_TOKENS, PROMPTS


def build(model: str, **parallel) -> LLM:
    return LLM(model=model, **ENGINE_KWARGS, **parallel)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def runner_of(llm: LLM):
    """The (first replica's) runner."""
    engine = llm.engine
    replicas = getattr(engine, "replicas", None)
    return (replicas[0] if replicas else engine).executor.runner


def prefill_logits(llm: LLM) -> np.ndarray:
    """Last-token logits of a prefill of the first prompts, through the engine's step.

    Run on an idle engine: it writes the prompts' KV into pages 1.. of the cache.
    """
    runner = runner_of(llm)
    prompts = [p[:8] for p in PROMPTS[:3]]
    pages = -(-8 // runner.settings.block_size)
    chunks = [
        SeqChunk(p, 0, list(range(1 + i * pages, 1 + (i + 1) * pages)))
        for i, p in enumerate(prompts)
    ]
    bucket = runner.buckets.select(sum(len(p) for p in prompts), len(prompts))
    batch = pack_batch(
        chunks,
        page_size=runner.settings.block_size,
        num_tokens=bucket.num_tokens,
        num_reqs=bucket.num_reqs,
        pages_per_req=runner.pages_per_req,
    )
    logits, _, runner.kv_caches = runner.program.step(
        runner.params, runner.kv_caches, batch, runner.no_feed
    )
    return np.asarray(jax.device_get(logits))[: len(prompts)]


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))
