"""After warm-up no XLA compilation happens, whatever the traffic (DESIGN §3).

One engine (the tiny model: what compiles depends on shapes and sampling flags, not
weights) with small buckets and a small KV cache receives varied traffic: mixed
prompt lengths, prompts longer than the token budget (chunked prefill), enough
concurrency to force preemption, n > 1, logprobs (top-k and `logprob_token_ids`) and
prompt logprobs on and off,
every sampling feature, structured outputs (grammar bitmasks) mixed with free
requests. The compile guard must count no compilation during it (the
guard hears every compilation in the process, so other engines built by earlier
tests may have added to its count before this test starts).
"""

from __future__ import annotations

import pytest

from jaxengine import SamplingParams, StructuredOutputsParams


@pytest.mark.slow
def test_varied_traffic_compiles_nothing_after_warmup(tiny_llm):
    llm = tiny_llm
    guard = llm.engine.executor.runner.guard
    assert guard.armed
    before = guard.compiles_after_warmup
    lengths = [3, 70, 12, 45, 1, 90, 30, 8, 20, 5]
    prompts = [
        {"prompt_token_ids": [(17 * i + j) % 5000 + 10 for j in range(n)]}
        for i, n in enumerate(lengths)
    ]
    variants = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=3, n=2),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, max_tokens=12, logprobs=5),
        SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=3, logprobs=0),
        SamplingParams(
            temperature=0.7,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            max_tokens=14,
        ),
        SamplingParams(temperature=0.9, logit_bias={42: 5.0}, min_tokens=4, max_tokens=9),
        SamplingParams(temperature=0.5, allowed_token_ids=list(range(100, 400)), max_tokens=8),
        SamplingParams(temperature=0, stop=["the", "\n"], max_tokens=30, logprob_token_ids=[5, 99]),
        SamplingParams(
            temperature=0,
            logprobs=1,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(json={"type": "array"}),
        ),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            repetition_penalty=1.1,
            max_tokens=10,
            structured_outputs=StructuredOutputsParams(regex="[a-z ]+"),
        ),
    ]
    outputs = llm.generate(prompts, variants, use_tqdm=False)
    assert len(outputs) == len(prompts)
    assert len(outputs[1].outputs) == 2
    assert outputs[2].outputs[0].logprobs is not None
    assert outputs[3].prompt_logprobs is not None and outputs[3].prompt_logprobs[0] is None
    assert all(100 <= t < 400 for t in outputs[6].outputs[0].token_ids)
    assert all({5, 99} <= set(entry) for entry in outputs[7].outputs[0].logprobs)
    assert outputs[9].outputs[0].text.replace(" ", "").isalpha()
    # a second round with the batch composition reshuffled
    outputs = llm.generate(prompts[::-1], variants[::-1], use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    assert guard.compiles_after_warmup == before
    assert llm.engine.get_stats().kv_cache_usage == 0.0
