"""POST /v1/completions through the official `openai` client (raw HTTP where it cannot).

Every request is greedy or seeded, so the outputs are deterministic; the usage figures
are checked exactly against POST /tokenize of the same prompt.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.server.chunks import finishes, joined
from tests.server.conftest import ALIAS, MODEL

PROMPT = "The capital of France is"
OTHER = "Once upon a time, there was a"
SEEDED = {"temperature": 1.0, "seed": 1234}
GREEDY = {"temperature": 0.0}


def count_tokens(server, prompt: str) -> int:
    response = server.post("/tokenize", {"prompt": prompt})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def token_ids(server, prompt: str) -> list[int]:
    return server.post("/tokenize", {"prompt": prompt}).json()["tokens"]


def complete(client, prompt=PROMPT, max_tokens=8, extra_body=None, **kwargs):
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body=extra_body, **kwargs
    )


def stream_chunks(client, **kwargs) -> list:
    return list(complete(client, stream=True, **kwargs))


# ---------------------------------------------------------------------- basics


def test_completion_shape_and_exact_usage(server, client):
    out = complete(client, max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.object == "text_completion"
    assert out.id.startswith("cmpl-")
    assert out.model == MODEL
    assert [c.index for c in out.choices] == [0]
    choice = out.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert choice.model_extra["stop_reason"] is None
    assert out.usage.prompt_tokens == count_tokens(server, PROMPT)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.usage.prompt_tokens_details.cached_tokens is not None


def test_greedy_is_repeatable_and_stream_matches(client):
    first = complete(client, max_tokens=10, **GREEDY).choices[0]
    twice = complete(client, n=2, max_tokens=10, **GREEDY).choices  # n > 1 greedy, as vLLM
    assert [c.text for c in twice] == [first.text, first.text]
    chunks = stream_chunks(client, max_tokens=10, **GREEDY)
    assert joined(chunks) == {0: first.text}
    assert finishes(chunks) == {0: [first.finish_reason]}
    assert all(c.object == "text_completion" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_alias_model_name(client):
    out = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2)
    assert out.model == ALIAS


def test_unknown_fields_are_ignored(client):
    body = {"no_such_field": 1, "nested_unknown": {"a": [1, 2]}}
    out = complete(client, max_tokens=2, extra_body=body, **GREEDY)
    assert out.choices[0].text


# ---------------------------------------------------------------------- n and seed


def test_n_with_seed_is_repeatable(server, client):
    first = complete(client, n=3, max_tokens=8, extra_body={"ignore_eos": True}, **SEEDED)
    second = complete(client, n=3, max_tokens=8, extra_body={"ignore_eos": True}, **SEEDED)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 3 * 8
    assert first.usage.prompt_tokens == count_tokens(server, PROMPT)


def test_n_streamed_matches_non_streamed(client):
    body = {"ignore_eos": True}
    full = complete(client, n=2, max_tokens=8, extra_body=body, **SEEDED)
    chunks = stream_chunks(client, n=2, max_tokens=8, extra_body=body, **SEEDED)
    assert joined(chunks) == {c.index: c.text for c in full.choices}
    assert finishes(chunks) == {0: ["length"], 1: ["length"]}


# ---------------------------------------------------------------------- logprobs


def check_completion_logprobs(logprobs, text: str, count: int, top: int) -> None:
    assert len(logprobs.tokens) == count
    assert len(logprobs.token_logprobs) == count
    assert len(logprobs.top_logprobs) == count
    assert len(logprobs.text_offset) == count
    assert "".join(logprobs.tokens) == text
    for token, logprob, tops in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0.0
        assert top <= len(tops) <= top + 1  # the sampled token is added when not in the top
        assert tops[token] == logprob
    ends = [o + len(t) for o, t in zip(logprobs.text_offset, logprobs.tokens, strict=True)]
    assert logprobs.text_offset[1:] == ends[:-1]


def test_logprobs(client):
    out = complete(client, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True}, **GREEDY)
    choice = out.choices[0]
    check_completion_logprobs(choice.logprobs, choice.text, 6, 3)
    assert choice.logprobs.text_offset[0] == 0
    # Greedy: the sampled token is the most likely one.
    for token, tops in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs, strict=True):
        assert max(tops, key=tops.get) == token


def test_logprobs_streamed(client):
    full = complete(client, max_tokens=6, logprobs=2, **GREEDY).choices[0]
    chunks = stream_chunks(client, max_tokens=6, logprobs=2, **GREEDY)
    tokens = [t for c in chunks for ch in c.choices for t in ch.logprobs.tokens]
    offsets = [o for c in chunks for ch in c.choices for o in ch.logprobs.text_offset]
    assert tokens == full.logprobs.tokens
    assert offsets == full.logprobs.text_offset


def test_return_tokens_as_token_ids(server, client):
    body = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    out = complete(client, max_tokens=6, logprobs=2, extra_body=body, **GREEDY)
    logprobs = out.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in logprobs.tokens)
    assert all(k.startswith("token_id:") for tops in logprobs.top_logprobs for k in tops)
    ids = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    text = server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    assert text == out.choices[0].text


# ---------------------------------------------------------------------- echo


def test_echo(client):
    plain = complete(client, max_tokens=5, **GREEDY).choices[0].text
    out = complete(client, max_tokens=5, echo=True, **GREEDY)
    assert out.choices[0].text == PROMPT + plain


def test_echo_with_logprobs(server, client):
    n_prompt = count_tokens(server, PROMPT)
    body = {"ignore_eos": True}
    out = complete(client, max_tokens=4, echo=True, logprobs=1, extra_body=body, **GREEDY)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == n_prompt + 4
    assert logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert "".join(logprobs.tokens[:n_prompt]) == PROMPT
    assert out.usage.prompt_tokens == n_prompt and out.usage.completion_tokens == 4


def test_echo_streamed(client):
    full = complete(client, max_tokens=5, echo=True, **GREEDY).choices[0].text
    chunks = stream_chunks(client, max_tokens=5, echo=True, **GREEDY)
    assert joined(chunks) == {0: full}


# ---------------------------------------------------------------------- prompts


def test_token_id_prompt(server, client):
    text = complete(client, max_tokens=6, **GREEDY).choices[0].text
    out = complete(client, prompt=token_ids(server, PROMPT), max_tokens=6, **GREEDY)
    assert out.choices[0].text == text
    assert out.usage.prompt_tokens == count_tokens(server, PROMPT)


def test_batch_of_strings_indexes_prompt_then_n(server, client):
    body = {"ignore_eos": True}
    batch = complete(client, prompt=[PROMPT, OTHER], n=2, max_tokens=6, extra_body=body, **SEEDED)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate([PROMPT, OTHER]):
        alone = complete(client, prompt=prompt, n=2, max_tokens=6, extra_body=body, **SEEDED)
        assert [c.text for c in batch.choices[2 * i : 2 * i + 2]] == [c.text for c in alone.choices]
    prompt_tokens = count_tokens(server, PROMPT) + count_tokens(server, OTHER)
    assert batch.usage.prompt_tokens == prompt_tokens
    assert batch.usage.completion_tokens == 4 * 6


def test_batch_of_token_lists(server, client):
    texts = [
        complete(client, prompt=p, max_tokens=5, **GREEDY).choices[0].text for p in (PROMPT, OTHER)
    ]
    ids = [token_ids(server, PROMPT), token_ids(server, OTHER)]
    out = complete(client, prompt=ids, max_tokens=5, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == texts


def test_batch_streamed(client):
    full = complete(client, prompt=[PROMPT, OTHER], n=2, max_tokens=5, **SEEDED)
    chunks = stream_chunks(client, prompt=[PROMPT, OTHER], n=2, max_tokens=5, **SEEDED)
    assert joined(chunks) == {c.index: c.text for c in full.choices}
    assert sorted(finishes(chunks)) == [0, 1, 2, 3]
    assert all(len(r) == 1 for r in finishes(chunks).values())


# ---------------------------------------------------------------------- stops


def reference(client, max_tokens=12):
    """A greedy run without stops: its text and its tokens (text and ids)."""
    body = {"ignore_eos": True}
    choice = complete(client, max_tokens=max_tokens, logprobs=0, extra_body=body, **GREEDY)
    choice = choice.choices[0]
    ids_body = {**body, "return_tokens_as_token_ids": True}
    as_ids = complete(client, max_tokens=max_tokens, logprobs=0, extra_body=ids_body, **GREEDY)
    ids = [int(t.removeprefix("token_id:")) for t in as_ids.choices[0].logprobs.tokens]
    return choice.text, choice.logprobs.tokens, ids


def test_stop_string(client):
    text, tokens, _ = reference(client)
    stop = tokens[4].strip() or tokens[4]
    out = complete(client, max_tokens=12, stop=[stop], **GREEDY).choices[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.model_extra["stop_reason"] == stop


def test_stop_string_included(client):
    text, tokens, _ = reference(client)
    stop = tokens[4].strip() or tokens[4]
    body = {"include_stop_str_in_output": True}
    out = complete(client, max_tokens=12, stop=stop, extra_body=body, **GREEDY).choices[0]
    assert out.text == text[: text.index(stop) + len(stop)]
    assert out.text.endswith(stop)
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == stop


def test_stop_string_streamed(client):
    text, tokens, _ = reference(client)
    stop = tokens[4].strip() or tokens[4]
    chunks = stream_chunks(client, max_tokens=12, stop=[stop], **GREEDY)
    assert joined(chunks) == {0: text[: text.index(stop)]}
    assert finishes(chunks) == {0: ["stop"]}


def test_stop_token_ids(client):
    text, _, ids = reference(client)
    stop_id = ids[3]
    body = {"stop_token_ids": [stop_id]}
    out = complete(client, max_tokens=12, extra_body=body, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id
    assert out.usage.completion_tokens == ids.index(stop_id) + 1
    assert text.startswith(choice.text)


# ---------------------------------------------------------------------- usage (see test_usage.py)


def test_stream_without_usage_by_default(client):
    chunks = stream_chunks(client, max_tokens=4, **GREEDY)
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


# ---------------------------------------------------------------------- async


def test_async_concurrent_completions(async_client):
    async def one(prompt: str):
        return await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY
        )

    async def one_streamed(prompt: str) -> str:
        stream = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, stream=True, **GREEDY
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        try:
            plain = [one(p) for p in (PROMPT, OTHER, PROMPT + " a")]
            streamed = [one_streamed(p) for p in (PROMPT, OTHER)]
            return await asyncio.gather(*plain, *streamed)
        finally:
            await async_client.close()

    *outs, s1, s2 = asyncio.run(main())
    assert all(o.usage.completion_tokens == 6 for o in outs)
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    assert s1 and s2


@pytest.mark.parametrize("model", [MODEL, ALIAS])
def test_async_client_model_names(async_client, model):
    async def main():
        try:
            return await async_client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        finally:
            await async_client.close()

    assert asyncio.run(main()).model == model
