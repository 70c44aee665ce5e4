"""Usage figures of both generation endpoints: exact counts, cached prompt tokens,
and the streamed usage options (`include_usage`, `continuous_usage_stats`).

Prompt token counts are checked against POST /tokenize of the same prompt (or the
same messages, for chat).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from tests.server.conftest import MODEL

GREEDY = {"temperature": 0.0}
LONG = " ".join(f"item{i}" for i in range(40))


@dataclasses.dataclass(frozen=True)
class Endpoint:
    name: str
    create: Callable  # (client, text, **kwargs) -> response or stream
    tokenize_body: Callable[[str], dict]


ENDPOINTS = [
    Endpoint(
        "completions",
        lambda client, text, **kw: client.completions.create(model=MODEL, prompt=text, **kw),
        lambda text: {"prompt": text},
    ),
    Endpoint(
        "chat",
        lambda client, text, **kw: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], **kw
        ),
        lambda text: {"messages": [{"role": "user", "content": text}]},
    ),
]


@pytest.fixture(params=ENDPOINTS, ids=[e.name for e in ENDPOINTS])
def endpoint(request) -> Endpoint:
    return request.param


def count_tokens(server, endpoint: Endpoint, text: str) -> int:
    response = server.post("/tokenize", endpoint.tokenize_body(text))
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_cached_tokens_on_repeated_long_prompt(server, client, endpoint):
    text = f"Prefix caching test ({endpoint.name}): {LONG}"
    n_prompt = count_tokens(server, endpoint, text)
    assert n_prompt > 48
    endpoint.create(client, text, max_tokens=2, **GREEDY)
    out = endpoint.create(client, text, max_tokens=2, **GREEDY)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert out.usage.prompt_tokens == n_prompt
    assert 0 < cached < n_prompt and cached % 16 == 0  # whole 16-token blocks


def test_stream_include_usage(server, client, endpoint):
    text = "What is the capital of France?"
    chunks = list(
        endpoint.create(
            client,
            text,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == count_tokens(server, endpoint, text)
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6


def test_stream_continuous_usage(server, client, endpoint):
    text = "Name a colour."
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        endpoint.create(client, text, max_tokens=6, stream=True, stream_options=options, **GREEDY)
    )
    n_prompt = count_tokens(server, endpoint, text)
    assert all(c.usage is not None and c.usage.prompt_tokens == n_prompt for c in chunks)
    generated = [c.usage.completion_tokens for c in chunks]
    assert generated == sorted(generated)
    assert chunks[-1].choices == [] and generated[-1] == generated[-2]
    assert all(c.usage.total_tokens == n_prompt + c.usage.completion_tokens for c in chunks)
    if endpoint.name == "chat":
        assert generated[0] == 0  # the role chunk comes before any token
