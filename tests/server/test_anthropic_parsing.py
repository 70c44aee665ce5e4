"""Anthropic's Messages API without a model: a request's translation to chat, the
refusals, stop reasons and usage, the message built from a chat.completion, and the
streamed events built from chat chunks (fake ones, and the chat view's own over fake
engine outputs with a fake reasoning parser)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pydantic
import pytest

from server.chat.serving import _ChatView
from server.chat_rendering.output import ChatOutputParser
from server.errors import APIError
from server.messages.errors import error_type, is_messages_path
from server.messages.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from server.messages.response import from_chat_completion, signature, stop_reason, usage
from server.messages.stream import anthropic_sse, message_events
from server.messages.translate import to_chat_request
from server.tool_calls import NO_TOOLS
from tests.server.test_chat_parsing import FakeReasoning, ids

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
USER = [{"role": "user", "content": "Hi"}]


def messages_request(**fields) -> AnthropicMessagesRequest:
    return AnthropicMessagesRequest(**{"model": "m", "max_tokens": 16, "messages": USER, **fields})


# ---------------------------------------------------------------------- translation


def test_conversation_translates_to_chat():
    weather = {"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}
    oslo = {"city": "Oslo"}
    request = messages_request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [weather]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look it up", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": oslo},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                     "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        tools=[WEATHER],
        stop_sequences=["\n\n"],
        temperature=0.5,
        top_k=3,
        metadata={"user_id": "u1"},
    )  # fmt: skip
    chat = to_chat_request(request, reasoning=False, request_id="msg_1")
    assert [m["role"] for m in chat.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "user",
    ]
    assert chat.messages[0]["content"] == [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Be kind."},
    ]
    assistant = chat.messages[2]
    assert assistant["content"] == [{"type": "text", "text": "Checking."}]
    assert assistant["reasoning_content"] == assistant["reasoning"] == "look it up"
    call = assistant["tool_calls"][0]
    assert call["id"] == "t1" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "rain"}
    assert chat.messages[4]["content"] == "Error: a\nb"
    assert chat.tools[0]["function"] == {
        "name": "get_weather",
        "parameters": WEATHER["input_schema"],
        "description": "The weather in a city.",
    }
    assert chat.tool_choice is None  # chat's default: auto where the server parses calls
    assert (chat.stop, chat.temperature, chat.top_k, chat.user) == (["\n\n"], 0.5, 3, "u1")
    assert (chat.max_tokens, chat.request_id, chat.stream) == (16, "msg_1", False)
    assert chat.add_generation_prompt and not chat.continue_final_message


@pytest.mark.parametrize(
    "choice, chat_choice, parallel",
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            True,
        ),
    ],
)
def test_tool_choice(choice, chat_choice, parallel):
    chat = to_chat_request(messages_request(tools=[WEATHER], tool_choice=choice), False)
    assert chat.tool_choice == chat_choice and chat.parallel_tool_calls is parallel


def test_prefill_stream_thinking_and_output_config():
    request = messages_request(
        messages=[*USER, {"role": "assistant", "content": "The answer is"}],
        stream=True,
        max_tokens=4096,
        thinking={"type": "enabled", "budget_tokens": 2048},
        output_config={
            "effort": "low",
            "format": {"type": "json_schema", "schema": {"type": "object"}},
        },
        chat_template_kwargs={"custom": 1},
    )
    chat = to_chat_request(request, reasoning=True)
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.stream_options.include_usage and chat.stream_options.continuous_usage_stats
    assert chat.chat_template_kwargs == {"enable_thinking": True, "custom": 1}
    assert chat.thinking_token_budget == 2048  # enforced by the engine
    assert chat.sampling_params(4096, None, {}).extra_args == {"thinking_token_budget": 2048}
    assert chat.reasoning_effort == "low"
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    disabled = messages_request(thinking={"type": "disabled"})
    assert to_chat_request(disabled, False).chat_template_kwargs == {"enable_thinking": False}
    assert to_chat_request(disabled, False).thinking_token_budget is None
    adaptive = to_chat_request(messages_request(thinking={"type": "adaptive"}), True)
    assert adaptive.thinking_token_budget is None  # no budget: the model decides


def test_count_tokens_request_has_no_sampling_fields():
    request = AnthropicCountTokensRequest(model="m", messages=USER, system="S", tools=[WEATHER])
    chat = to_chat_request(request, False)
    assert chat.max_tokens is None and chat.request_id is None and not chat.stream
    assert chat.messages[0] == {"role": "system", "content": "S"} and chat.tools


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        (
            {"messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
            "only taken in user messages",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
        ({"messages": [{"role": "user", "content": [{"type": "thinking"}]}]}, "'thinking'"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "`type`"),
        ({"system": [{"type": "image"}]}, "image"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "defer_loading"),
        ({"tools": [{**WEATHER, "strict": True}]}, "strict"),
        ({"tools": [{"name": "f"}]}, "input_schema"),
        ({"tool_choice": {"type": "any"}}, "needs `tools`"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "--reasoning-parser"),
        ({"thinking": {"type": "between_tools"}}, "between_tools"),
    ],
)  # fmt: skip
def test_refused_content_names_it(fields, words):
    with pytest.raises(APIError) as info:
        to_chat_request(messages_request(**fields), reasoning=False)
    assert words in info.value.message and info.value.status == 400
    assert info.value.param == next(iter(fields))  # the field that holds it


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "greater than or equal to 1024"),
        (
            {"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1023}},
            "greater than or equal to 1024",
        ),
        (
            {"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 2048}},
            "`max_tokens` must be greater than `thinking.budget_tokens`",
        ),
        ({"thinking": {"type": "enabled"}}, "budget_tokens: Field required"),
        (
            {"thinking": {"type": "adaptive"}, "tools": [WEATHER], "tool_choice": {"type": "any"}},
            'tool_choice "any"',
        ),
    ],
)
def test_thinking_limits(fields, words):
    with pytest.raises(APIError) as info:
        to_chat_request(messages_request(**fields), reasoning=True)
    assert words in info.value.message and info.value.param == "thinking"


def test_count_tokens_checks_the_budget_and_carries_none():
    thinking = {"type": "enabled", "budget_tokens": 1024}
    request = AnthropicCountTokensRequest(model="m", messages=USER, thinking=thinking)
    chat = to_chat_request(request, reasoning=True)
    assert chat.thinking_token_budget is None and chat.chat_template_kwargs
    small = AnthropicCountTokensRequest(
        model="m", messages=USER, thinking={**thinking, "budget_tokens": 8}
    )
    with pytest.raises(APIError, match="greater than or equal to 1024"):
        to_chat_request(small, reasoning=True)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"container": "c1"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "x", "name": "n"}]}, "mcp_servers"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"context_management": {"edits": []}}, "context_management"),
        ({"output_format": {"type": "json_schema"}}, "output_format"),
        ({"diagnostics": {}}, "diagnostics"),
        ({"max_tokens": None}, "max_tokens"),
    ],
)
def test_refused_fields_are_validation_errors_at_the_field(fields, field):
    with pytest.raises(pydantic.ValidationError) as info:
        messages_request(**fields)
    assert info.value.errors()[0]["loc"][0] == field
    messages_request(service_tier="standard_only", cache_control={"type": "ephemeral"})


# ---------------------------------------------------------------------- responses


def test_stop_reasons_and_usage():
    assert stop_reason("stop", None) == ("end_turn", None)
    assert stop_reason("stop", 2) == ("end_turn", None)  # a stop token id
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    assert stop_reason("abort", None) == ("pause_turn", None)
    plain = {"prompt_tokens": 9, "completion_tokens": 4}
    assert usage(plain) == {"input_tokens": 9, "output_tokens": 4}
    cached = {**plain, "prompt_tokens_details": {"cached_tokens": 6}}
    assert usage(cached) == {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": 6}
    assert error_type(503) == "overloaded_error" and error_type(422) == "invalid_request_error"
    assert is_messages_path("/v1/messages/count_tokens") and not is_messages_path("/v1/models")


def chat_completion(message, finish="stop", matched=None, metrics=None) -> dict:
    return {
        "id": "msg_1",
        "model": "m",
        "choices": [{"message": message, "finish_reason": finish, "stop_reason": matched}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7},
        "metrics": metrics,
    }


def test_message_from_chat_completion():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    message = {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": "hm",
        "tool_calls": [call],
    }
    out = from_chat_completion(chat_completion(message, "tool_calls", metrics={"x": 1.0}))
    assert out == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "hm", "signature": signature("hm")},
            {"type": "text", "text": "Hi"},
            {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 7},
        "metrics": {"x": 1.0},
    }
    omitted = from_chat_completion(chat_completion(message), thinking_shown=False)
    assert omitted["content"][0] == {
        "type": "thinking",
        "thinking": "",
        "signature": signature("hm"),
    }
    cut = {**call, "function": {"name": "f", "arguments": '{"a": '}}
    out = from_chat_completion(chat_completion({"content": None, "tool_calls": [cut]}, "length"))
    assert out["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}]
    out = from_chat_completion(chat_completion({"content": "x"}, "stop", "END"))
    assert (out["stop_reason"], out["stop_sequence"], "metrics" in out) == (
        "stop_sequence",
        "END",
        False,
    )


# ---------------------------------------------------------------------- streaming


def events_of(chunks, thinking_shown=True) -> list[tuple[str, dict]]:
    async def source():
        for chunk in chunks:
            yield chunk

    async def collect():
        return [e async for e in message_events(source(), "msg_1", "m", thinking_shown)]

    return asyncio.run(collect())


def chunk(delta=None, finish=None, completion=0, matched=None, prompt=4, cached=None) -> dict:
    choices = []
    if delta is not None:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if matched is not None:
            choice["stop_reason"] = matched
        choices.append(choice)
    details = {"prompt_tokens_details": {"cached_tokens": cached}} if cached is not None else {}
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, **details}
    return {"id": "msg_1", "choices": choices, "usage": usage}


def test_event_order_from_chat_chunks():
    first = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "hm", "reasoning": "hm"}, completion=1),
        chunk({"reasoning_content": "m", "content": "Hi"}, completion=2),
        chunk({"content": " there", "tool_calls": [first]}, completion=3),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}, completion=4),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls", 5),
        {**chunk(completion=5, cached=2), "metrics": {"x": 1.0}},
    ]  # fmt: skip
    events = events_of(chunks)
    assert all(data["type"] == name for name, data in events)
    summary = [
        (name, data.get("index"), (data.get("delta") or {}).get("type")) for name, data in events
    ]
    assert summary == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    start = events[0][1]["message"]
    assert start["usage"] == {"input_tokens": 4, "output_tokens": 0} and start["content"] == []
    assert events[5][1]["delta"]["signature"] == signature("hmm")
    assert events[11][1]["content_block"] == {
        "type": "tool_use",
        "id": "c1",
        "name": "f",
        "input": {},
    }
    partial = "".join(d.get("delta", {}).get("partial_json", "") for _, d in events)
    assert json.loads(partial) == {"a": 1}
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"] == {"input_tokens": 2, "output_tokens": 5, "cache_read_input_tokens": 2}
    assert end["metrics"] == {"x": 1.0}


def test_stop_sequence_and_omitted_thinking_in_stream():
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "secret"}, completion=1),
        chunk({"content": "ok"}, "stop", 2, matched="END"),
        chunk(completion=2),
    ]
    events = events_of(chunks, thinking_shown=False)
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas == ["signature_delta", "text_delta"]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_chat_view_with_reasoning_streams_thinking_blocks():
    """The chat view's own chunks, over fake engine outputs split by a fake reasoning
    parser, give a thinking block then a text block, as the whole message does."""
    from jaxengine.outputs import CompletionOutput, RequestOutput

    steps = [("<think>", None), ("why", None), ("</think>Par", None), ("is", "length")]

    def output(text, finish):
        seq = CompletionOutput(
            index=0, text=text, token_ids=[1], cumulative_logprob=None, logprobs=None
        )
        seq.finish_reason = finish
        return RequestOutput("r", None, [1, 2, 3], None, [seq], finished=finish is not None)

    async def outputs():
        for text, finish in steps:
            yield 0, output(text, finish)

    request = to_chat_request(messages_request(stream=True), reasoning=True, request_id="msg_1")
    options = SimpleNamespace(
        response_role="assistant",
        return_tokens_as_token_ids=False,
        enable_force_include_usage=False,
        enable_prompt_tokens_details=False,
        enable_per_request_metrics=False,
    )
    ctx = SimpleNamespace(options=options, tokenizer=None)
    parser = ChatOutputParser(request, NO_TOOLS, FakeReasoning(), None, ids())
    view = _ChatView(ctx, request, "m", "msg_1", 3, parser)

    async def collect():
        chunks = view.stream(outputs())
        return [e async for e in message_events(chunks, "msg_1", "m")]

    events = asyncio.run(collect())
    blocks = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert blocks == ["thinking", "text"]
    thinking = "".join(
        d["delta"].get("thinking", "") for n, d in events if n == "content_block_delta"
    )
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert (thinking, text) == ("why", "Paris")
    end = events[-2][1]
    assert end["delta"]["stop_reason"] == "max_tokens"
    assert end["usage"] == {"input_tokens": 3, "output_tokens": 4}


def test_sse_format_and_error_event():
    async def failing():
        yield "message_start", {"type": "message_start"}
        raise APIError("the engine is asleep", 503)

    async def collect():
        return [text async for text in anthropic_sse(failing())]

    texts = asyncio.run(collect())
    assert texts[0] == 'event: message_start\ndata: {"type": "message_start"}\n\n'
    name, data = texts[1].split("\n")[:2]
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the engine is asleep"},
    }
    assert len(texts) == 2  # no message_stop, no [DONE]


def test_user_image_blocks_become_chat_image_parts():
    """base64 and url sources become image_url parts in place (a text-only model
    refuses them in chat, before anything is fetched)."""
    b64 = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    text = {"type": "text", "text": "compare"}
    request = AnthropicMessagesRequest(
        model="m", max_tokens=4, messages=[{"role": "user", "content": [b64, text, url]}]
    )
    parts = to_chat_request(request, False).messages[0]["content"]
    assert parts == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
