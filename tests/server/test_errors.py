"""Error responses: status codes, OpenAI's error shape, and a server that keeps serving.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` with ``code``
equal to the HTTP status; after each one a normal request still succeeds.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from server.chat_rendering.images import NOT_MULTIMODAL
from server.completions.protocol import NO_PROMPT
from tests.server.conftest import DP1_ONLY, MODEL

CHAT = [{"role": "user", "content": "Hi"}]
MAX_MODEL_LEN = 512
VOCAB = 49152


def check_error(response: httpx.Response, status: int, *needles: str) -> dict:
    """Asserts the status and OpenAI's error shape; returns the error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] == status
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def still_serves(server) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def count_tokens(server, **body) -> int:
    return server.post("/tokenize", body).json()["count"]


# ---------------------------------------------------------------------- 400: parameters

INVALID_COMPLETIONS = {
    "temperature -1": ({"temperature": -1}, "temperature"),
    "n 0": ({"n": 0}, "n"),
    "max_tokens a": ({"max_tokens": "a"}, "max_tokens"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "top_p 2": ({"top_p": 2}, "top_p"),
    "top_k -5": ({"top_k": -5}, "top_k"),
    "presence_penalty 3": ({"presence_penalty": 3}, "presence_penalty"),
    "stop empty": ({"stop": [""]}, "stop"),
    "logprobs 21": ({"logprobs": 21}, "20"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream"),
    # vLLM's CompletionRequest: "Either prompt or prompt_embeds must be provided and
    # non-empty." (its test_empty_prompt, test_empty_prompt_list_rejected)
    "prompt missing": ({"prompt": None}, NO_PROMPT),
    "prompt empty list": ({"prompt": []}, NO_PROMPT),
    "prompt empty string": ({"prompt": ""}, NO_PROMPT),
    "prompt_embeds empty": ({"prompt": None, "prompt_embeds": []}, NO_PROMPT),
    # one prompt of several empty: the engine's (vLLM's) wording
    "prompt list of empty strings": ({"prompt": [""]}, "The decoder prompt cannot be empty"),
    "prompt list of empty ids": ({"prompt": [[]]}, "The decoder prompt cannot be empty"),
}


@pytest.mark.parametrize("fields", INVALID_COMPLETIONS.values(), ids=INVALID_COMPLETIONS.keys())
@DP1_ONLY
def test_invalid_completion_parameters(server, fields):
    change, needle = fields
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}  # "prompt": None: none sent
    check_error(server.post("/v1/completions", body), 400, needle)
    still_serves(server)


INVALID_CHATS = {
    "temperature -1": ({"temperature": -1}, "temperature"),
    "n 0": ({"n": 0}, "n"),
    "max_tokens a": ({"max_tokens": "a"}, "max_tokens"),
    "top_p 2": ({"top_p": 2}, "top_p"),
    "top_logprobs 21": ({"logprobs": True, "top_logprobs": 21}, "20"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "logprobs"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream"),
    "messages empty": ({"messages": []}, "messages"),
    "message without role": ({"messages": [{"content": "Hi"}]}, "role"),
}


@pytest.mark.parametrize("fields", INVALID_CHATS.values(), ids=INVALID_CHATS.keys())
@DP1_ONLY
def test_invalid_chat_parameters(server, fields):
    change, needle = fields
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **change}
    check_error(server.post("/v1/chat/completions", body), 400, needle)
    still_serves(server)


@DP1_ONLY
def test_invalid_parameter_in_a_stream_fails_before_streaming(server):
    body = {"model": MODEL, "prompt": "Hello", "stream": True, "temperature": -1}
    check_error(server.post("/v1/completions", body), 400, "temperature")
    body = {"model": MODEL, "messages": CHAT, "stream": True, "top_p": 2}
    check_error(server.post("/v1/chat/completions", body), 400, "top_p")
    still_serves(server)


@DP1_ONLY
def test_malformed_json(server):
    response = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "Hello", ',
        headers={**server.headers, "Content-Type": "application/json"},
        timeout=30,
    )
    check_error(response, 400)
    still_serves(server)


@DP1_ONLY
def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=-1)
    assert info.value.status_code == 400
    assert "temperature" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=21)


# ---------------------------------------------------------------------- 400: model limits


@DP1_ONLY
def test_prompt_longer_than_context(server):
    prompt = "hello " * 600
    n_prompt = count_tokens(server, prompt=prompt)
    assert n_prompt > MAX_MODEL_LEN
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16}
    error = check_error(server.post("/v1/completions", body), 400)
    message = error["message"]
    assert f"maximum context length is {MAX_MODEL_LEN}" in message
    assert f"{n_prompt + 16} tokens" in message and f"{n_prompt} in the messages" in message
    still_serves(server)


@DP1_ONLY
def test_prompt_plus_max_tokens_over_context(server):
    n_prompt = count_tokens(server, prompt="Hello there")
    max_tokens = MAX_MODEL_LEN - n_prompt + 1
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": max_tokens}
    check_error(
        server.post("/v1/completions", body),
        400,
        f"maximum context length is {MAX_MODEL_LEN}",
        f"{MAX_MODEL_LEN + 1} tokens",
        f"{max_tokens} in the completion",
    )
    still_serves(server)


@DP1_ONLY
def test_chat_longer_than_context(server):
    messages = [{"role": "user", "content": "hello " * 600}]
    n_prompt = count_tokens(server, messages=messages)
    body = {"model": MODEL, "messages": messages, "max_tokens": 8}
    check_error(
        server.post("/v1/chat/completions", body),
        400,
        f"maximum context length is {MAX_MODEL_LEN}",
        f"{n_prompt} in the messages",
    )
    still_serves(server)


def test_prompt_that_just_fits(server):
    """prompt + max_tokens == max-model-len is accepted; the stream is closed at once
    (which aborts the request), so the 500 tokens are never generated."""
    n_prompt = count_tokens(server, prompt="Hello there")
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": MAX_MODEL_LEN - n_prompt}
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json=body | {"stream": True}, headers=server.headers) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
    still_serves(server)


@pytest.mark.parametrize(
    "prompt",
    [[1, 2, VOCAB], [[5, 6], [7, VOCAB + 100]], [1, -1]],
    ids=["ids", "batch", "negative"],
)
@DP1_ONLY
def test_out_of_vocabulary_prompt_ids(server, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    check_error(server.post("/v1/completions", body), 400, "vocab")
    still_serves(server)


@DP1_ONLY
def test_out_of_vocabulary_stop_token_id(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [VOCAB]}
    check_error(server.post("/v1/completions", body), 400, "vocab")
    still_serves(server)


@DP1_ONLY
def test_detokenize_out_of_vocabulary(server):
    check_error(server.post("/detokenize", {"tokens": [1, VOCAB]}), 400, "vocab")


# ---------------------------------------------------------------------- 404


@DP1_ONLY
def test_unknown_model(server, client):
    body = {"model": "no-such-model", "prompt": "Hello", "max_tokens": 2}
    error = check_error(server.post("/v1/completions", body), 404, "no-such-model")
    assert error["type"] == "NotFoundError"
    body = {"model": "no-such-model", "messages": CHAT, "max_tokens": 2}
    check_error(server.post("/v1/chat/completions", body), 404, "no-such-model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    still_serves(server)


@DP1_ONLY
def test_unknown_route(server):
    check_error(server.get("/v1/no-such-route"), 404)


# ---------------------------------------------------------------------- 401


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "test-key"}]
)
@DP1_ONLY
def test_api_key_required_on_v1(server, headers):
    routes = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
    ]
    for method, path, body in routes:
        response = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        error = check_error(response, 401)
        assert error["type"] == "AuthenticationError"
    still_serves(server)


@DP1_ONLY
def test_openai_client_with_wrong_key(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics"])
@DP1_ONLY
def test_routes_outside_v1_need_no_key(server, path):
    assert httpx.get(server.url + path, timeout=30).status_code == 200


@DP1_ONLY
def test_image_to_a_text_only_model(server):
    """An image_url part to the text-only model: a 400 before any image is fetched."""
    part = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/never-fetched.png"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
    reply = server.post("/v1/chat/completions", body)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == NOT_MULTIMODAL
