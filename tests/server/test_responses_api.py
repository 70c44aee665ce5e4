"""POST /v1/responses (and GET, DELETE, cancel) through the official `openai` client,
on the shared `agents_server` (the tiny random model, hermes tool parsing).

The model is random, so every expectation comes from /v1/chat/completions on the
same server: a greedy response's text is the greedy chat completion's of the same
conversation. Generations are short (8 to 16 tokens).
"""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.test_endpoints import wait_for
from tests.server.test_errors import check_error, still_serves

ASK = "What is the capital of France?"
GREEDY = {"temperature": 0.0, "max_output_tokens": 8}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
}
TIME_TOOL = {"type": "function", "name": "get_time", "description": "The time.", "parameters": ZONE}


@pytest.fixture(scope="module")
def api(agents_server):
    return agents_server.client(max_retries=0, timeout=120)


def chat_text(api, messages, max_tokens=8, **kwargs) -> tuple[str, str]:
    """(content, finish_reason) of the greedy chat completion of ``messages``."""
    out = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0, **kwargs
    )
    return out.choices[0].message.content or "", out.choices[0].finish_reason


def status_of(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def test_greedy_text_equals_chat_and_is_stored(agents_server, api):
    idle = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    assert wait_for(lambda: all(agents_server.metrics()[name] == 0 for name in idle))
    before = agents_server.metrics()
    r = api.responses.create(
        model=MODEL, instructions="Be brief.", input=ASK, metadata={"case": "greedy"}, **GREEDY
    )

    def delta(name: str) -> float:
        return agents_server.metrics().get(name, 0.0) - before.get(name, 0.0)

    assert wait_for(lambda: delta("vllm:request_success_total") == 1)  # the engine's metrics
    assert delta("vllm:generation_tokens_total") == r.usage.output_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    chat = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.0
    )
    choice = chat.choices[0]
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == choice.message.content
    assert r.status == status_of(choice.finish_reason)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == chat.usage.total_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.metadata == {"case": "greedy"} and r.instructions == "Be brief."
    assert r.store and r.temperature == 0.0 and r.max_output_tokens == 8
    assert api.responses.retrieve(r.id).model_dump() == r.model_dump()
    api.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(r.id)


def test_stream_events_in_order_join_to_the_text(api):
    logprobs = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = api.responses.create(model=MODEL, input=ASK, **logprobs, **GREEDY)
    events = list(api.responses.create(model=MODEL, input=ASK, stream=True, **logprobs, **GREEDY))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    final = events[-1].response
    assert types[-1] == f"response.{final.status}" and final.status == whole.status
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == whole.output_text
    body = types[2:-1]  # one message item
    n = len(deltas)
    assert body == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert final.usage.output_tokens == whole.usage.output_tokens
    tokens = [lp.token for lp in whole.output[0].content[0].logprobs]
    assert len(tokens) == whole.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in whole.output[0].content[0].logprobs)
    streamed = [lp.token for e in events if e.type.endswith("text.delta") for lp in e.logprobs]
    assert streamed == tokens
    assert api.responses.retrieve(final.id).output_text == whole.output_text


def test_forced_tool_call_and_its_output_round_trip(api):
    ask = [{"role": "user", "content": "What time is it in Berlin?"}]
    r = api.responses.create(
        model=MODEL,
        input=ask,
        tools=[TIME_TOOL],
        tool_choice={"type": "function", "name": "get_time"},
        temperature=0.0,
        max_output_tokens=16,
    )
    assert r.status == "completed", r
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), {**ZONE, "additionalProperties": False})
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}
    follow = api.responses.create(
        model=MODEL, input=[*ask, calls[0].model_dump(), result], tools=[TIME_TOOL], **GREEDY
    )
    call = {
        "id": calls[0].call_id,
        "type": "function",
        "function": {"name": "get_time", "arguments": calls[0].arguments},
    }
    messages = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "12:00"},
    ]
    function = {"name": "get_time", "description": "The time.", "parameters": ZONE}
    chat_tools = [{"type": "function", "function": function}]
    text, finish = chat_text(api, messages, tools=chat_tools)
    assert follow.output_text == text and follow.status == status_of(finish)


def test_json_schema_text_format(api):
    """Compact JSON (vLLM's structured_outputs option): free whitespace would let the
    random model write blanks until the token limit."""
    fmt = {"type": "json_schema", "name": "zone", "schema": ZONE, "strict": True}
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    r = api.responses.create(
        model=MODEL, input="Pick a zone.", text={"format": fmt}, temperature=0.0,
        max_output_tokens=16, extra_body=compact,
    )  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "zone", "schema": ZONE}}
    messages = [{"role": "user", "content": "Pick a zone."}]
    text, finish = chat_text(api, messages, 16, response_format=response_format, extra_body=compact)
    assert r.output_text == text and r.text.format.type == "json_schema"
    assert r.status == status_of(finish) == "completed"
    jsonschema.validate(json.loads(r.output_text), ZONE)


def test_previous_response_id_continues_without_its_instructions(api):
    first = api.responses.create(model=MODEL, instructions="Be brief.", input=ASK, **GREEDY)
    second = api.responses.create(
        model=MODEL, previous_response_id=first.id, input="And of Spain?", **GREEDY
    )
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Spain?"},
    ]
    text, finish = chat_text(api, messages)
    assert second.output_text == text and second.status == status_of(finish)
    unstored = api.responses.create(model=MODEL, input=ASK, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model=MODEL, previous_response_id=unstored.id, input="Hi", **GREEDY)


def wait_finished(api, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        r = api.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_background_then_cancel(agents_server, api):
    queued = api.responses.create(model=MODEL, input=ASK, background=True, **GREEDY)
    assert queued.status in ("queued", "in_progress") and queued.background
    done = wait_finished(api, queued.id)
    text, finish = chat_text(api, [{"role": "user", "content": ASK}])
    assert done.output_text == text and done.status == status_of(finish)
    with pytest.raises(openai.BadRequestError):
        api.responses.cancel(done.id)  # finished
    generated = "vllm:generation_tokens_total"
    before = agents_server.metrics()[generated]
    long = api.responses.create(
        model=MODEL,
        input=ASK,
        background=True,
        max_output_tokens=400,
        extra_body={"ignore_eos": True},
    )
    cancelled = api.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert api.responses.retrieve(long.id).status == "cancelled"
    running = "vllm:num_requests_running"
    assert wait_for(lambda: agents_server.metrics()[running] == 0)
    assert agents_server.metrics()[generated] - before < 400  # aborted before its end
    with pytest.raises(openai.BadRequestError):
        api.responses.cancel(long.id)


REFUSED = [
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "file_search"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "code_interpreter"),
    ({"tools": [{"type": "mcp", "server_label": "s"}]}, "mcp"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"include": ["reasoning.encrypted_content"]}, "reasoning.encrypted_content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "not a multimodal model"),
    ({"background": True, "stream": True}, "background"),
    ({"background": True, "store": False}, "store"),
]  # fmt: skip


def test_unsupported_fields_are_400_and_the_server_serves(agents_server):
    for fields, needle in REFUSED:
        body = {"model": MODEL, "input": ASK, "max_output_tokens": 8, **fields}
        check_error(agents_server.post("/v1/responses", body), 400, needle)
    check_error(agents_server.get("/v1/responses/resp_missing"), 404, "resp_missing")
    check_error(agents_server.post("/v1/responses/resp_missing/cancel", {}), 404, "not found")
    body = {"model": "no-such-model", "input": ASK}
    check_error(agents_server.post("/v1/responses", body), 404)
    still_serves(agents_server)
