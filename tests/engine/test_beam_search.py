"""`LLM.beam_search` on the default model against transformers' beam search.

vLLM's API: ``LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens,
ignore_eos, temperature, length_penalty, include_stop_str_in_output))`` returns one
`BeamSearchOutput` per prompt: "The output of beam search. It contains the list of the
best beam search sequences. The length of the list is equal to the beam width."
(each a `BeamSearchSequence`: tokens, logprobs, cum_logprob, text, finish_reason). The selection is
transformers' (`jaxengine.beam_search`), so each case must give exactly the
sequences of ``generate(num_beams=w, num_return_sequences=w, length_penalty=...,
max_new_tokens=..., early_stopping=..., do_sample=False)``, in order. The engine is
the shared small SmolLM2 one (float32, prefix caching on, a KV cache small enough
to preempt).
"""

from __future__ import annotations

import pytest

from jaxengine.beam_search import BeamSearchParams
from jaxengine.tokenizer import apply_chat_template
from tests.engine.test_engine_golden import OTHERS, PREAMBLE, QUESTIONS
from tests.models.hf_reference import hf_beam_search

NEW_TOKENS = 10
EOS = 2  # <|im_end|>: SmolLM2's EOS (and pad) id


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    """Two raw golden prompts and two chat prompts (whose replies end on EOS)."""
    texts = [PREAMBLE + QUESTIONS[4], OTHERS[7]]
    chats = ["What is the capital of Italy?", "Say hello."]
    ids = [smollm2_tokenizer.encode(t) for t in texts]
    ids += [apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": c}]) for c in chats]
    return ids


CASES = [
    # width, length_penalty, early_stopping
    (2, 1.0, False),  # transformers' defaults
    (4, 1.0, False),
    (3, 0.0, True),
    (3, 2.0, "never"),
]


@pytest.mark.parametrize("width, length_penalty, early_stopping", CASES)
def test_beams_equal_transformers(
    small_llm, smollm2_hf, prompts, width, length_penalty, early_stopping
):
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=NEW_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        include_stop_str_in_output=True,
    )
    stats = small_llm.engine.get_stats()
    outputs = small_llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    after = small_llm.engine.get_stats()
    for prompt, out in zip(prompts, outputs, strict=True):
        ours = [seq.tokens[len(prompt) :] for seq in out.sequences]
        expected, _ = hf_beam_search(
            smollm2_hf, prompt, width, NEW_TOKENS, length_penalty, early_stopping, EOS
        )
        assert ours == expected
        for seq in out.sequences:
            assert seq.tokens[: len(prompt)] == prompt
            ended = seq.tokens[-1] == EOS
            assert seq.finish_reason == ("stop" if ended else "length")
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
            output = seq.tokens[len(prompt) :]
            chosen = [lp[t].logprob for t, lp in zip(output, seq.logprobs, strict=True)]
            assert seq.cum_logprob == pytest.approx(sum(chosen), abs=1e-4)
    # beams share their prompt's pages: most prompt tokens of each step's requests
    # come from the prefix cache
    queries = after.prefix_cache_queries - stats.prefix_cache_queries
    hits = after.prefix_cache_hits - stats.prefix_cache_hits
    assert hits > 0.7 * queries


def test_the_chat_replies_end_on_eos_and_text_is_decoded(small_llm, smollm2_tokenizer, prompts):
    """Without include_stop_str_in_output the EOS token is left out; as vLLM's
    `LLM.beam_search`, ``text`` decodes the prompt and the output together."""
    params = BeamSearchParams(beam_width=2, max_tokens=NEW_TOKENS)
    (out,) = small_llm.beam_search({"prompt_token_ids": prompts[2]}, params)
    best = out.sequences[0]
    assert best.finish_reason == "stop"
    assert EOS not in best.tokens[len(prompts[2]) :]
    assert best.text == smollm2_tokenizer.decode(best.tokens)
    assert "Rome" in best.text


def test_text_prompts_and_ignore_eos(small_llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    outs = small_llm.beam_search(["Paris is", "1 2 3 4 5"], params, use_tqdm=True)
    assert [len(o.sequences) for o in outs] == [2, 2]
    assert all(s.finish_reason == "length" for o in outs for s in o.sequences)
    assert outs[1].sequences[0].text.startswith("1 2 3 4 5")


def test_bad_requests_are_refused_before_anything_runs(small_llm):
    with pytest.raises(ValueError, match="max_logprobs"):
        small_llm.beam_search(["Hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    too_long = [1] * 125
    with pytest.raises(ValueError, match="maximum context length"):
        small_llm.beam_search(["Hi", too_long], BeamSearchParams(beam_width=2, max_tokens=8))
    assert not small_llm.engine.has_unfinished_requests()
