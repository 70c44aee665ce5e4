"""``--model-impl transformers``: greedy tokens through `LLM.generate` equal
transformers' own ``generate`` (eager attention, float32), with chunked prefill, a
prefix-cache hit, and preemption forced by too few pages (recompute and swap); no
page is left held and nothing compiles after warm-up."""

from __future__ import annotations

import pytest

from jaxengine import LLM, SamplingParams
from tests.models.hf_reference import hf_greedy, hf_greedy_batch
from tests.torch_fallback.conftest import CONFIGS, ENGINE_KWARGS, PROMPTS

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_done(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.kv_cache_usage == 0.0  # every page back
    assert llm.engine.executor.compiles_after_warmup == 0


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_matches_transformers(arch, checkpoints):
    folder, model = checkpoints(arch)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(model=folder, **ENGINE_KWARGS)
    try:
        assert generate(llm) == want
        assert generate(llm) == want  # again, from the prefix cache
        assert llm.engine.get_stats().prefix_cache_hits > 0
        check_done(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("swap", [0, 1], ids=["recompute", "swap"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_preemption(arch, swap, checkpoints):
    folder, model = checkpoints(arch)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    kwargs = {
        **ENGINE_KWARGS,
        "num_gpu_blocks_override": 5,
        "swap_space": swap,
        "max_model_len": 48,
    }
    llm = LLM(model=folder, **kwargs)
    try:
        assert generate(llm) == want
        assert llm.engine.get_stats().num_preemptions > 0
        check_done(llm)
    finally:
        llm.shutdown()


def test_smollm2_gguf_through_transformers_loader(smollm2_gguf, smollm2_hf, smollm2_tokenizer):
    """A real model forced through the fallback: the default model's GGUF, read by
    transformers' own GGUF loader, gives transformers' greedy tokens."""
    from tests.engine.test_engine_golden import PREAMBLE, QUESTIONS

    prompts = [smollm2_tokenizer.encode(PREAMBLE + q) for q in QUESTIONS[:3]]
    want = hf_greedy_batch(smollm2_hf, prompts, 16)
    kwargs = {**ENGINE_KWARGS, "skip_tokenizer_init": False, "max_model_len": 256}
    llm = LLM(model=str(smollm2_gguf), **{**kwargs, "num_gpu_blocks_override": 64})
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in out] == want
        check_done(llm)
    finally:
        llm.shutdown()
