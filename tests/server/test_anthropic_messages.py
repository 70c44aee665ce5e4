"""Anthropic's POST /v1/messages and /v1/messages/count_tokens through the official
`anthropic` client, on `agents_server` (the tiny random model, hermes tool calls).

The model is random, so every expectation comes from /v1/chat/completions on the
same server and the same conversation (greedy): the text, the stop, the usage, the
prompt size. Errors are checked for Anthropic's shape, and the server serving after.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import ALIAS, MODEL
from tests.server.test_endpoints import wait_for

SYSTEM = "You are a terse assistant."
QUESTION = [{"role": "user", "content": "Name a colour."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
    },
}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
GREEDY = {"temperature": 0.0}
"""Sent as an extra body field: the newest clients no longer declare `temperature`."""
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@pytest.fixture(scope="module")
def claude(agents_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=agents_server.url, api_key=agents_server.api_key, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def openai_client(agents_server):
    return agents_server.client(max_retries=0, timeout=120)


def chat(openai_client, messages, max_tokens, **kwargs):
    """The greedy chat completion that a greedy message is compared with."""
    return openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0, **kwargs
    )


def create(claude, messages=QUESTION, max_tokens=12, **kwargs):
    body = {**GREEDY, **kwargs.pop("extra_body", {})}
    return claude.messages.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, extra_body=body, **kwargs
    )


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def function_tools(*tools) -> list[dict]:
    """Chat's function tools for Anthropic ones (the keys in the translation's order)."""
    out = []
    for tool in tools:
        function = {"name": tool["name"]}
        if "description" in tool:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def test_greedy_message_matches_chat_and_counts(agents_server, claude, openai_client):
    idle = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    assert wait_for(lambda: all(agents_server.metrics()[name] == 0 for name in idle))
    before = agents_server.metrics()
    message = claude.messages.create(
        model=ALIAS, system=SYSTEM, messages=QUESTION, max_tokens=12, extra_body=GREEDY
    )

    def delta(name: str) -> float:
        return agents_server.metrics().get(name, 0.0) - before.get(name, 0.0)

    assert wait_for(lambda: delta("vllm:request_success_total") == 1)  # the engine's metrics
    assert delta("vllm:generation_tokens_total") == message.usage.output_tokens
    conversation = [{"role": "system", "content": SYSTEM}, *QUESTION]
    reference = chat(openai_client, conversation, 12)
    choice = reference.choices[0]
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == ALIAS
    assert text_of(message) == (choice.message.content or "")
    assert message.stop_reason == STOP_REASONS[choice.finish_reason]
    assert message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == reference.usage.prompt_tokens
    assert usage.output_tokens == reference.usage.completion_tokens
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert counted.input_tokens == reference.usage.prompt_tokens


def test_stream_matches_create(agents_server, claude):
    whole = create(claude)
    with claude.messages.stream(
        model=MODEL, messages=QUESTION, max_tokens=12, extra_body=GREEDY
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id.startswith("msg_") and final.id != whole.id
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "stream": True}
    headers = {"x-api-key": agents_server.api_key}  # Anthropic's header, no Bearer
    raw = httpx.post(f"{agents_server.url}/v1/messages", json=body, headers=headers, timeout=120)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.text.split("\n\n") if e]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    for event in events:
        name, data = event.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert "[DONE]" not in raw.text


def test_stop_sequence_matches_chat(claude, openai_client):
    text = chat(openai_client, QUESTION, 16).choices[0].message.content
    at = next(i for i in range(1, len(text) - 1) if text[i : i + 2].strip())
    stop = text[at : at + 2]
    reference = chat(openai_client, QUESTION, 16, stop=[stop]).choices[0]
    assert (reference.finish_reason, reference.model_extra["stop_reason"]) == ("stop", stop)
    message = create(claude, max_tokens=16, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert text_of(message) == (reference.message.content or "") == text[: text.index(stop)]


def test_forced_tool_use_round_trip(claude, openai_client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    message = create(claude, question, 16, tools=[WEATHER], tool_choice=choice)
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}
    history = [
        *question,
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [result]},
    ]
    follow = create(claude, history, 8, tools=[WEATHER])  # auto: the hermes parser
    arguments = json.dumps(call.input)
    chat_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }
    chat_history = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
    ]
    reference = chat(openai_client, chat_history, 8, tools=function_tools(WEATHER))
    assert text_of(follow) == (reference.choices[0].message.content or "")
    assert follow.stop_reason == STOP_REASONS[reference.choices[0].finish_reason]
    counted = claude.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    assert counted.input_tokens == reference.usage.prompt_tokens


def test_any_tool_choice_streams_one_tool_use(claude):
    choice = {"type": "any", "disable_parallel_tool_use": True}
    question = [{"role": "user", "content": "Weather or time?"}]
    with claude.messages.stream(
        model=MODEL,
        messages=question,
        max_tokens=40,
        extra_body=GREEDY,
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
    ) as stream:
        fragments = [
            event.delta.partial_json
            for event in stream
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (call,) = [block for block in final.content if block.type == "tool_use"]
    schemas = {tool["name"]: tool["input_schema"] for tool in (WEATHER, CLOCK)}
    jsonschema.validate(call.input, schemas[call.name])
    assert json.loads("".join(fragments)) == call.input


def _post(agents_server, path, body, key=None):
    headers = {"x-api-key": agents_server.api_key if key is None else key}
    return httpx.post(agents_server.url + path, json=body, headers=headers, timeout=60)


def test_errors_in_anthropic_shape_and_still_serving(agents_server, claude):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}
    for key in ("wrong", ""):
        response = _post(agents_server, "/v1/messages", body, key=key)
        assert response.status_code == 401
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "authentication_error"
    openai_shape = agents_server.post("/v1/chat/completions", {}, headers={"Authorization": "x"})
    assert openai_shape.status_code == 401 and "message" in openai_shape.json()["error"]
    headers = {"x-api-key": agents_server.api_key}
    assert httpx.get(f"{agents_server.url}/v1/models", headers=headers).status_code == 200
    wrong_method = httpx.get(f"{agents_server.url}/v1/messages", headers=headers)
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    cases = [
        ({"model": MODEL, "messages": QUESTION}, 400, "max_tokens"),
        ({**body, "messages": [{"role": "user", "content": [image]}]}, 400, "image"),
        ({**body, "tools": [server_tool]}, 400, "web_search_20250305"),
        ({**body, "container": "c"}, 400, "container"),
        ({**body, "mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}, 400, "mcp_servers"),
        ({**body, "thinking": {"type": "enabled", "budget_tokens": 2}}, 400, "--reasoning-parser"),
        ({**body, "model": "no-such-model"}, 404, "no-such-model"),
    ]
    for request, status, words in cases:
        response = _post(agents_server, "/v1/messages", request)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
        assert words in error["message"]
    document = {"type": "document", "source": {"type": "text", "data": "x"}}
    counted = {"model": MODEL, "messages": [{"role": "user", "content": [document]}]}
    response = _post(agents_server, "/v1/messages/count_tokens", counted)
    assert response.status_code == 400 and "document" in response.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        create(claude, extra_body={"service_tier": "priority"})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "service_tier" in info.value.body["error"]["message"]
    served = create(claude, max_tokens=2)  # still serving
    assert served.stop_reason == ("max_tokens" if served.usage.output_tokens == 2 else "end_turn")
