"""Beam search on the OpenAI server: vLLM's ``use_beam_search`` extra parameter.

vLLM's docs list ``use_beam_search`` and ``length_penalty`` among the extra
parameters of the completions and chat APIs; with beam search, ``n`` is the beam
width and the ``n`` choices are the best beams. vLLM refuses to stream completions
with beam search ("Streaming is not currently supported with beam search"); a chat
stream carries each finished beam whole. The beams must be transformers' own
(``generate(num_beams=n, num_return_sequences=n, ...)``), as `LLM.beam_search`'s are
(tests/engine/test_beam_search.py).

The completions tests run on the shared tiny-model servers (one engine and
data-parallel replicas), against the tiny model's transformers beams. The chat tests
need a beam that ends on EOS, which a random model never writes, so they run on
SmolLM2's real weights (`smollm2_server`), whose best chat beam answers and stops.
"""

from __future__ import annotations

import json

import pytest

from jaxengine.tokenizer import apply_chat_template
from tests.models.hf_reference import hf_beam_search
from tests.server.conftest import DP1_ONLY, MODEL

EOS = 2  # SmolLM2's <|im_end|>
TEXT = "The history of the printing press begins"
CHAT = [{"role": "user", "content": "What is the capital of Italy?"}]
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return smollm2_tokenizer.encode(TEXT)


@pytest.fixture(scope="module")
def chat_ids(smollm2_tokenizer):
    return apply_chat_template(smollm2_tokenizer, CHAT)


def expected_beams(hf, tokenizer, ids, width, max_tokens, length_penalty, early_stopping):
    """transformers' beams as the server shows them: (text, finish_reason) each."""
    beams, _ = hf_beam_search(hf, ids, width, max_tokens, length_penalty, early_stopping, EOS)
    shown = []
    for beam in beams:
        ended = beam[-1] == EOS
        text = tokenizer.decode(beam[:-1] if ended else beam, skip_special_tokens=True)
        shown.append((text, "stop" if ended else "length"))
    return shown


@pytest.fixture(scope="module")
def completion_beams(tiny_smollm2, smollm2_tokenizer, prompt_ids):
    """The tiny model's beams (the model of the shared `server`)."""
    return expected_beams(tiny_smollm2[1], smollm2_tokenizer, prompt_ids, 3, 8, 0.5, False)


@pytest.fixture(scope="module")
def chat_beams(smollm2_hf, smollm2_tokenizer, chat_ids):
    return expected_beams(smollm2_hf, smollm2_tokenizer, chat_ids, 2, 12, 1.0, True)


def test_completions_return_transformers_beams(client, prompt_ids, completion_beams):
    out = client.completions.create(
        model=MODEL,
        prompt=prompt_ids,
        max_tokens=8,
        n=3,
        logprobs=2,
        extra_body={**BEAM, "length_penalty": 0.5},
    )
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [(c.text, c.finish_reason) for c in choices] == completion_beams
    assert len({c.text for c in choices}) == 3
    for choice in choices:  # each beam's own tokens, with at most 2 alternatives
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 8
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in choices)


def test_several_prompts_each_get_n_beams(client, prompt_ids, completion_beams):
    out = client.completions.create(
        model=MODEL,
        prompt=[prompt_ids, prompt_ids[:4]],
        max_tokens=8,
        n=3,
        extra_body={**BEAM, "length_penalty": 0.5},
    )
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(6))
    assert [(c.text, c.finish_reason) for c in choices[:3]] == completion_beams


def test_chat_returns_transformers_beams(smollm2_server, chat_ids, chat_beams):
    assert smollm2_server.post("/tokenize", {"messages": CHAT}).json()["tokens"] == chat_ids
    client = smollm2_server.client(max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, n=2, extra_body={**BEAM, "early_stopping": True}
    )
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [(c.message.content, c.finish_reason) for c in choices] == chat_beams
    assert chat_beams[0][1] == "stop" and "Rome" in chat_beams[0][0]


def test_chat_stream_sends_each_beam_whole(smollm2_server, chat_beams):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "n": 2, "stream": True}
    response = smollm2_server.post("/v1/chat/completions", {**body, **BEAM, "early_stopping": True})
    assert response.status_code == 200, response.text
    chunks = [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")
    ]
    content = {0: [], 1: []}
    finish = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["delta"].get("content"):
                content[choice["index"]].append(choice["delta"]["content"])
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert [len(content[i]) for i in (0, 1)] == [1, 1]  # one chunk per beam
    assert [(content[i][0], finish[i]) for i in (0, 1)] == chat_beams


@DP1_ONLY
def test_completions_refuse_streaming_with_beam_search(server):
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 4, "n": 2, "stream": True, **BEAM}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "Streaming is not currently supported with beam search"
    )


REFUSED = {
    "top_p": ({"top_p": 0.5}, "top_p is not supported with beam search"),
    "stop": ({"stop": ["."]}, "stop is not supported with beam search"),
    "penalty": ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
    "structured": ({"response_format": {"type": "json_object"}}, "structured outputs"),
    "prompt_logprobs": ({"prompt_logprobs": 1}, "prompt logprobs"),
    "too wide": ({"n": 11}, "22 candidates per beam"),
}


@pytest.mark.parametrize("change, message", REFUSED.values(), ids=REFUSED.keys())
@DP1_ONLY
def test_what_beam_search_does_not_run_is_refused(server, change, message):
    """Sampling fields mean nothing to beam search (vLLM drops them): a 400 here."""
    for path, body in (
        ("/v1/completions", {"prompt": TEXT}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        full = {"model": MODEL, "max_tokens": 4, "n": 2, **body, **BEAM, **change}
        response = server.post(path, full)
        assert response.status_code == 400, (path, response.text)
        assert message in response.json()["error"]["message"]
    assert server.get("/health").status_code == 200
