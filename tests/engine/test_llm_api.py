"""`LLM` as a vLLM user calls it: seeds, validation, chat, stops, n, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxengine import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = {"prompt_token_ids": [504, 3575, 282, 4649, 314]}  # "The capital of France is"


def _others(n):
    return [{"prompt_token_ids": [100 + i, 200 + 3 * i, 300]} for i in range(n)]


def test_seeded_request_ignores_its_batch(small_llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = small_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.3, max_tokens=7)
    mixed = small_llm.generate(
        [*_others(3), PROMPT, *_others(2)], [noisy] * 3 + [params] + [noisy] * 2, use_tqdm=False
    )
    assert mixed[3].outputs[0].token_ids == alone


def test_too_long_prompt_is_rejected_and_nothing_is_queued(small_llm):
    with pytest.raises(ValueError, match="maximum context length is 128"):
        small_llm.generate(
            [PROMPT, {"prompt_token_ids": [7] * 200}], SamplingParams(max_tokens=4), use_tqdm=False
        )
    assert not small_llm.engine.has_unfinished_requests()
    out = small_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_out_of_vocabulary_token_is_named(small_llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        small_llm.generate({"prompt_token_ids": [1, 10**7]}, use_tqdm=False)


def test_chat_and_text_prompts(small_llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    (reply,) = small_llm.chat([{"role": "user", "content": "Say hello."}], params, use_tqdm=False)
    assert reply.outputs[0].text and reply.outputs[0].finish_reason in ("stop", "length")
    (text,) = small_llm.generate("The capital of France is", params, use_tqdm=False)
    assert text.prompt == "The capital of France is"
    assert text.outputs[0].text == small_llm.get_tokenizer().decode(text.outputs[0].token_ids)


def test_stop_string_truncates_and_reports(small_llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = small_llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    stop = full.strip().split()[1]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    out = small_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    params.include_stop_str_in_output = True
    out = small_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop) + len(stop)]


def test_n_samples_and_logprobs(small_llm):
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=6, logprobs=4)
    (out,) = small_llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert len(completion.logprobs) == 6
        total = 0.0
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and len(entry) >= 4
            total += entry[token].logprob
            assert {1, 2, 3, 4} <= {lp.rank for lp in entry.values()}
        assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-5)


def test_greedy_logprobs_are_log_softmax(small_llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    (out,) = small_llm.generate(PROMPT, params, use_tqdm=False)
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the most likely token
        values = np.array([lp.logprob for lp in entry.values()])
        assert (values <= 0).all()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 5
    for position in range(1, 5):
        assert PROMPT["prompt_token_ids"][position] in out.prompt_logprobs[position]


def test_logits_processor_runs_on_the_host_path(small_llm):
    def only_42(output_ids, logits):
        forced = logits.copy()
        forced[:] = -1e9
        forced[42] = 0.0
        return forced

    params = SamplingParams(temperature=0, max_tokens=3, logits_processors=[only_42])
    (out,) = small_llm.generate(PROMPT, params, use_tqdm=False)
    assert out.outputs[0].token_ids == [42, 42, 42]


def test_max_new_tokens_of_the_generation_config_caps_every_request(tiny_llm, monkeypatch):
    """vLLM's ``max_new_tokens`` (a generation config's, or ``--override-generation-config
    '{"max_new_tokens": N}'``, merged into the same dict): every request's max_tokens
    is at most N, whether the request sets one or runs to the context's end."""
    monkeypatch.setitem(tiny_llm.engine.generation_config, "max_new_tokens", 3)
    for max_tokens, want in ((None, 3), (10, 3), (2, 2)):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = tiny_llm.generate(PROMPT, params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == want, max_tokens
        assert out.outputs[0].finish_reason == "length"
