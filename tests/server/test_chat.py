"""POST /v1/chat/completions through the official `openai` client.

Greedy or seeded requests only; prompt token counts are checked against POST /tokenize
with the same messages.
"""

from __future__ import annotations

import asyncio

from tests.server.chunks import finishes, joined
from tests.server.conftest import ALIAS, MODEL

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
OTHER = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a colour."},
]
SEEDED = {"temperature": 1.0, "seed": 4321}
GREEDY = {"temperature": 0.0}


def count_tokens(server, messages) -> int:
    response = server.post("/tokenize", {"messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def chat(client, messages=MESSAGES, max_tokens=8, extra_body=None, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, extra_body=extra_body, **kwargs
    )


def stream_chunks(client, **kwargs) -> list:
    return list(chat(client, stream=True, **kwargs))


def first_deltas(chunks) -> dict:
    first: dict = {}
    for chunk in chunks:
        for choice in chunk.choices:
            first.setdefault(choice.index, choice.delta)
    return first


# ---------------------------------------------------------------------- basics


def test_chat_shape_and_exact_usage(server, client):
    out = chat(client, max_tokens=10, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-")
    assert out.model == MODEL
    assert [c.index for c in out.choices] == [0]
    message = out.choices[0].message
    assert message.role == "assistant" and message.content
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == count_tokens(server, MESSAGES)
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10
    assert out.usage.prompt_tokens_details.cached_tokens is not None


def test_max_completion_tokens(server, client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=OTHER,
        max_completion_tokens=7,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens == count_tokens(server, OTHER)


def test_greedy_stream_matches_non_streamed(client):
    full = chat(client, max_tokens=10, **GREEDY).choices[0]
    again = chat(client, max_tokens=10, **GREEDY).choices[0]
    assert full.message.content == again.message.content
    chunks = stream_chunks(client, max_tokens=10, **GREEDY)
    assert joined(chunks) == {0: full.message.content}
    assert finishes(chunks) == {0: [full.finish_reason]}
    assert first_deltas(chunks)[0].role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_alias_model_name(client):
    out = client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=2)
    assert out.model == ALIAS


def test_unknown_fields_are_ignored(client):
    body = {"no_such_field": True, "metadata_unknown": {"x": 1}}
    out = chat(client, max_tokens=2, extra_body=body, **GREEDY)
    assert out.choices[0].message.content is not None


def test_content_as_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    plain = chat(client, max_tokens=6, **GREEDY).choices[0].message.content
    assert chat(client, messages=parts, max_tokens=6, **GREEDY).choices[0].message.content == plain


# ---------------------------------------------------------------------- n and seed


def test_n_with_seed_is_repeatable(client):
    body = {"ignore_eos": True}
    first = chat(client, n=3, max_tokens=8, extra_body=body, **SEEDED)
    second = chat(client, n=3, max_tokens=8, extra_body=body, **SEEDED)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert first.usage.completion_tokens == 3 * 8


def test_n_streamed(client):
    body = {"ignore_eos": True}
    full = chat(client, n=2, max_tokens=8, extra_body=body, **SEEDED)
    chunks = stream_chunks(client, n=2, max_tokens=8, extra_body=body, **SEEDED)
    assert joined(chunks) == {c.index: c.message.content for c in full.choices}
    assert finishes(chunks) == {0: ["length"], 1: ["length"]}
    firsts = first_deltas(chunks)
    assert sorted(firsts) == [0, 1]
    assert all(delta.role == "assistant" for delta in firsts.values())


# ---------------------------------------------------------------------- logprobs


def test_logprobs(client):
    body = {"ignore_eos": True}
    out = chat(client, max_tokens=6, logprobs=True, top_logprobs=3, extra_body=body, **GREEDY)
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == 6
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob == entry.logprob
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(top.bytes == list(top.token.encode("utf-8")) for top in entry.top_logprobs)


def test_logprobs_without_top(client):
    out = chat(client, max_tokens=4, logprobs=True, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(entry.top_logprobs == [] for entry in content)


def test_max_top_logprobs_allowed(client):
    out = chat(client, max_tokens=2, logprobs=True, top_logprobs=20, **GREEDY)
    assert all(len(entry.top_logprobs) == 20 for entry in out.choices[0].logprobs.content)


def test_logprobs_streamed(client):
    full = chat(client, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY).choices[0]
    chunks = stream_chunks(client, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
    streamed = [
        entry.token
        for c in chunks
        for ch in c.choices
        if ch.logprobs
        for entry in ch.logprobs.content
    ]
    assert streamed == [entry.token for entry in full.logprobs.content]


def test_return_tokens_as_token_ids(server, client):
    body = {"return_tokens_as_token_ids": True}
    out = chat(client, max_tokens=6, logprobs=True, top_logprobs=2, extra_body=body, **GREEDY)
    content = out.choices[0].logprobs.content
    assert all(entry.token.startswith("token_id:") for entry in content)
    assert all(top.token.startswith("token_id:") for e in content for top in e.top_logprobs)
    ids = [int(entry.token.removeprefix("token_id:")) for entry in content]
    text = server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    assert text == out.choices[0].message.content


# ---------------------------------------------------------------------- stops


def test_stop_string(client):
    body = {"ignore_eos": True}
    full = chat(client, max_tokens=10, logprobs=True, extra_body=body, **GREEDY).choices[0]
    token = full.logprobs.content[3].token
    stop = token.strip() or token
    text = full.message.content
    out = chat(client, max_tokens=10, stop=[stop], **GREEDY).choices[0]
    assert out.message.content == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.model_extra["stop_reason"] == stop
    included = chat(
        client,
        max_tokens=10,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
        **GREEDY,
    ).choices[0]
    assert included.message.content == text[: text.index(stop) + len(stop)]


def test_stop_token_ids(client):
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    full = chat(client, max_tokens=10, logprobs=True, extra_body=body, **GREEDY)
    ids = [int(e.token.removeprefix("token_id:")) for e in full.choices[0].logprobs.content]
    out = chat(client, max_tokens=10, extra_body={"stop_token_ids": [ids[2]]}, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == ids[2]
    assert out.usage.completion_tokens == ids.index(ids[2]) + 1


# ---------------------------------------------------------------------- async


def test_async_concurrent_chats(async_client):
    async def one(messages, **kwargs):
        return await async_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, extra_body={"ignore_eos": True}, **kwargs
        )

    async def streamed(messages) -> list:
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, stream=True, n=2, **SEEDED
        )
        return [chunk async for chunk in stream]

    async def main():
        try:
            return await asyncio.gather(
                one(MESSAGES, **GREEDY), one(OTHER, n=2, **SEEDED), streamed(OTHER)
            )
        finally:
            await async_client.close()

    greedy, seeded, chunks = asyncio.run(main())
    assert greedy.usage.completion_tokens == 5
    assert [c.index for c in seeded.choices] == [0, 1]
    assert seeded.usage.completion_tokens == 10
    assert sorted(finishes(chunks)) == [0, 1]
    assert all(len(r) == 1 for r in finishes(chunks).values())
