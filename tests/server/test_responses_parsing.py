"""The Responses API without a server: request fields refused, the translation into a
chat request, output items and usage, the event stream built from chat's real view
over fake engine outputs (checked against the openai SDK's event models), and the
bounded response store.
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from jaxengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.chat.serving import _ChatView
from server.chat_rendering.output import ChatOutputParser
from server.errors import APIError
from server.responses.input import BUILT_IN_TOOLS, chat_request, input_messages
from server.responses.output import base_response, output_items, reasoning_tokens
from server.responses.protocol import ResponsesRequest
from server.responses.run import ResponseRun
from server.responses.store import ResponseStore, StoredResponse
from server.serving import ServerOptions
from server.tool_calls import resolve_tool_choice
from tests.server.test_chat_parsing import FakeReasoning

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
PING = {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def translate(**fields):
    request = ResponsesRequest(**{"input": "Hi", **fields})
    return chat_request(request, input_messages(request.input), "resp_1")


# ---------------------------------------------------------------------- the request


@pytest.mark.parametrize(
    "field, value",
    [
        ("conversation", "conv_1"),
        ("prompt", {"id": "pmpt_1"}),
        ("truncation", "auto"),
        ("max_tool_calls", 2),
        ("include", ["reasoning.encrypted_content"]),
        ("reasoning", {"summary": "detailed"}),
        ("text", {"verbosity": "low"}),
        ("context_management", [{"type": "compaction"}]),
    ],
)
def test_refused_fields_name_themselves(field, value):
    with pytest.raises(pydantic.ValidationError) as info:
        ResponsesRequest(input="Hi", **{field: value})
    error = info.value.errors()[0]
    assert error["loc"][0] == field
    if field == "include":
        assert "reasoning.encrypted_content" in error["msg"]


def test_background_needs_store():
    with pytest.raises(pydantic.ValidationError, match="store"):
        ResponsesRequest(input="Hi", background=True, store=False)


def test_defaults_are_accepted():
    request = ResponsesRequest(input="Hi", truncation="disabled", reasoning={"summary": "auto"})
    assert request.store and not request.background and request.parallel_tool_calls


def test_fields_reach_the_chat_request():
    chat = translate(
        model="my-lora",  # a LoRA adapter's name: chat resolves it
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0.0,
        top_p=0.5,
        stop=["\n"],
        seed=7,
        user="u",
        reasoning={"effort": "low"},
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        text={"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
    )
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert (chat.model, chat.max_tokens, chat.temperature, chat.top_p) == ("my-lora", 12, 0.0, 0.5)
    assert (chat.stop, chat.seed, chat.user, chat.reasoning_effort) == (["\n"], 7, "u", "low")
    assert chat.logprobs and chat.top_logprobs == 2 and chat.request_id == "resp_1"
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    assert translate(text={"format": {"type": "json_object"}}).response_format.type == (
        "json_object"
    )
    assert translate(stream=True).stream_options.include_usage


def test_items_become_messages():
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sure.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "ping", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "ping", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "pong"},
        {"type": "function_call_output", "call_id": "c2", "output": "pong2"},
    ]
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": '{"a": 1}'}},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "Go"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Sure."}], "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "pong"},
        {"role": "tool", "tool_call_id": "c2", "content": "pong2"},
    ]
    lone = input_messages([{"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}])
    assert lone[0]["content"] is None and lone[0]["tool_calls"][0]["id"] == "c"


@pytest.mark.parametrize(
    "items, needle",
    [
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input_file"),
        ([{"type": "item_reference", "id": "msg_1"}], "item_reference"),
        ([{"role": "critic", "content": "x"}], "critic"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "call_id"),
    ],
)
def test_bad_items_are_400(items, needle):
    with pytest.raises(APIError) as info:
        input_messages(items)
    assert info.value.status == 400 and info.value.param == "input"
    assert needle in info.value.message


def test_input_images_become_chat_image_parts():
    """An input_image's image_url becomes chat's image_url part, in place; one given by
    file_id is refused (there is no files API)."""
    content = [
        {"type": "input_text", "text": "what is"},
        {"type": "input_image", "image_url": "data:x"},
    ]
    (message,) = input_messages([{"role": "user", "content": content}])
    assert message["content"][1] == {"type": "image_url", "image_url": {"url": "data:x"}}
    with pytest.raises(APIError, match="file_id images are not supported"):
        input_messages([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}])


def test_tools_and_tool_choice():
    chat = translate(tools=[WEATHER, PING], tool_choice={"type": "function", "name": "ping"})
    assert chat.tools[0] == {
        "type": "function",
        "function": {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")},
    }
    assert chat.tool_choice == {"type": "function", "function": {"name": "ping"}}
    assert translate(tools=[PING], tool_choice="required").tool_choice == "required"
    assert translate(tool_choice="auto").tool_choice is None  # no tools: nothing to call


@pytest.mark.parametrize("kind", BUILT_IN_TOOLS)
def test_built_in_tools_are_400(kind):
    with pytest.raises(APIError) as info:
        translate(tools=[{"type": kind}])
    assert info.value.param == "tools" and repr(kind) in info.value.message


def test_chat_validation_is_reported_at_the_responses_field():
    with pytest.raises(APIError) as info:
        translate(seed=2**70)
    assert info.value.param == "seed"
    with pytest.raises(APIError) as info:
        translate(tool_choice={"type": "allowed_tools", "tools": []})
    assert info.value.param == "tool_choice"


# ---------------------------------------------------------------------- the output


def test_output_items_and_incomplete_last_item():
    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    choice = {
        "message": {"content": "Hi", "reasoning_content": "hmm", "tool_calls": [call]},
        "finish_reason": "length",
        "logprobs": None,
    }
    items = output_items(choice)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert items[1]["content"][0]["text"] == "Hi" and items[1]["status"] == "completed"
    assert items[2]["call_id"] == "call_9" and items[2]["status"] == "incomplete"
    assert output_items({"message": {"content": None}, "finish_reason": "stop"}) == []


class FakeThink(FakeReasoning):
    """<think>...</think>: whole (chat's fake), streamed (markers within one delta),
    and by token ids (END is the end marker's id)."""

    END = 99

    def stream(self):
        state = {"done": False}

        class Stream:
            def feed(self, delta):
                if state["done"]:
                    return "", delta
                delta = delta.replace("<think>", "")
                if "</think>" not in delta:
                    return delta, ""
                state["done"] = True
                return tuple(delta.split("</think>", 1))

            def finish(self):
                return "", ""

        return Stream()

    def is_reasoning_end(self, ids):
        return self.END in ids

    def content_token_ids(self, ids):
        return list(ids[list(ids).index(self.END) + 1 :]) if self.END in ids else []


def test_reasoning_tokens():
    think = FakeThink()
    assert reasoning_tokens(think, [1, 2, 99, 4, 5], True) == 3
    assert reasoning_tokens(think, [1, 2], True) == 2
    assert reasoning_tokens(think, [1, 2], False) == 0
    assert reasoning_tokens(None, [1, 2], True) == 0


# ---------------------------------------------------------------------- runs over chat's view


def _outputs(pieces, finish, stream):
    """Fake engine outputs: one token per piece (the piece with </think> is END)."""
    ids = [FakeThink.END if "</think>" in p else i + 1 for i, p in enumerate(pieces)]

    def output(text, token_ids, reason):
        seq = CompletionOutput(0, text, token_ids, None, None, finish_reason=reason)
        finished = reason is not None
        times = RequestMetrics(
            1.0, last_token_time=1.5, first_scheduled_time=1.1, first_token_time=1.2
        )
        return RequestOutput(
            "r", None, [1, 2, 3], None, [seq], finished, times, num_cached_tokens=2
        )

    async def gen():
        if not stream:
            yield 0, output("".join(pieces), ids, finish)
            return
        for k, piece in enumerate(pieces):
            yield 0, output(piece, ids[k : k + 1], finish if k == len(pieces) - 1 else None)

    return gen()


def _run(pieces, finish, stream, reasoning=None, timings=False, **fields) -> ResponseRun:
    request = ResponsesRequest(input="Hi", stream=stream, **fields)
    conversation = input_messages(request.input)
    chat = chat_request(request, conversation, "resp_1")
    counter = itertools.count()
    parser = ChatOutputParser(
        chat, resolve_tool_choice(chat, False), reasoning, None, lambda: f"call_{next(counter)}"
    )
    options = ServerOptions(served_model_names=("m",), enable_per_request_metrics=timings)
    ctx = SimpleNamespace(options=options, tokenizer=None)
    view = _ChatView(ctx, chat, "m", "resp_1", 3, parser)
    base = base_response(request, "resp_1", "m", {})
    return ResponseRun(
        view, _outputs(pieces, finish, stream), base, conversation, reasoning, stream
    )


def _stream(run: ResponseRun) -> list[dict]:
    async def collect():
        return [event async for event in run.stream()]

    return asyncio.run(collect())


def _check_sdk_shapes(events: list[dict]) -> None:
    """Every event parses as the openai SDK's event model of its type; the Response
    objects as its `Response` (usage checked apart: the SDK's model also wants
    ``cache_write_tokens``, which the engine does not count)."""
    for event in events:
        if "response" in event:
            response = {k: v for k, v in event["response"].items() if k != "usage"}
            Response.model_validate(response)
            event = {**event, "response": response}
        parsed = EVENTS.validate_python(event)
        assert parsed.type == event["type"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def _short(event: dict) -> str:
    kind = event["type"].removeprefix("response.")
    if "item" in event:
        kind += f"({event['item']['type']})"
    return kind


PIECES = ["<think>", "hm", "m</think>Par", "is"]


def test_stream_events_reasoning_then_text():
    run = _run(PIECES, "length", True, FakeThink())
    events = _stream(run)
    _check_sdk_shapes(events)
    reasoning = ["content_part.added", "reasoning_text.delta", "reasoning_text.delta"]
    reasoning += ["reasoning_text.done", "content_part.done", "output_item.done(reasoning)"]
    message = ["content_part.added", "output_text.delta", "output_text.delta"]
    message += ["output_text.done", "content_part.done", "output_item.done(message)"]
    assert [_short(e) for e in events] == [
        "created",
        "in_progress",
        "output_item.added(reasoning)",
        *reasoning,
        "output_item.added(message)",
        *message,
        "incomplete",
    ]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    final = events[-1]["response"]
    assert "".join(deltas) == "Paris" == final["output"][1]["content"][0]["text"]
    assert final["output"][0]["content"][0]["text"] == "hmm"
    assert final["status"] == "incomplete" and final["output"][1]["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 2}
    whole = asyncio.run(_run(PIECES, "length", False, FakeThink()).collect())
    assert _without_ids(whole["output"]) == _without_ids(final["output"])
    assert whole["usage"] == final["usage"] and whole["status"] == final["status"]


def _without_ids(items):
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_stream_events_of_forced_calls():
    text = '[{"name": "ping", "parameters": {}}, '
    text += '{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    run = _run(pieces, "stop", True, tools=[WEATHER, PING], tool_choice="required")
    events = _stream(run)
    _check_sdk_shapes(events)
    kinds = [_short(e) for e in events]
    assert kinds[:3] == ["created", "in_progress", "output_item.added(function_call)"]
    assert kinds[-1] == "completed"
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == ["{}", '{"city": "Oslo"}']
    added = [i for i, k in enumerate(kinds) if k == "output_item.added(function_call)"]
    closed = [i for i, k in enumerate(kinds) if k == "output_item.done(function_call)"]
    assert added[0] < closed[0] < added[1] < closed[1]  # one item after the other
    for item_id, arguments in [(d["item_id"], d["arguments"]) for d in done]:
        fragments = [
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == item_id
        ]
        assert "".join(fragments) == arguments
    final = events[-1]["response"]
    calls = [("ping", "call_0"), ("get_weather", "call_1")]
    assert [(i["name"], i["call_id"]) for i in final["output"]] == calls
    for kind in ("response.output_item.added", "response.output_item.done"):
        items = [e["item"] for e in events if e["type"] == kind]
        assert [(i["name"], i["call_id"]) for i in items] == calls
        assert [i["id"] for i in items] == [i["id"] for i in final["output"]]


def test_per_request_metrics_come_through_chat():
    """--enable-per-request-metrics: chat's ``metrics``, whole or streamed."""
    whole = asyncio.run(_run(["Hel", "lo"], "stop", False, timings=True).collect())
    streamed = _stream(_run(["Hel", "lo"], "stop", True, timings=True))[-1]["response"]
    assert whole["metrics"]["queue_time_ms"] == pytest.approx(100.0)
    assert streamed["metrics"] == whole["metrics"]
    assert "metrics" not in asyncio.run(_run(["Hel", "lo"], "stop", False).collect())


def test_a_stream_closed_early_closes_the_engine_stream():
    """A client that goes away mid-stream: closing the events closes (aborts) the
    engine's output stream at once, not when the garbage collector gets to it."""
    run = _run(["Hel", "lo", "!"], "stop", True)
    inner, closed = run.streams, []

    async def tracked():
        try:
            async for item in inner:
                yield item
        finally:
            closed.append(True)

    run.streams = tracked()

    async def read_one_delta():
        events = run.stream()
        async for event in events:
            if event["type"] == "response.output_text.delta":
                break
        await events.aclose()
        return list(closed)  # before asyncio.run's own clean-up closes what is left

    assert asyncio.run(read_one_delta()) == [True]


def test_conversation_after_a_response_continues_it():
    run = _run(["Hel", "lo"], "stop", False)
    response = asyncio.run(run.collect())
    assert run.conversation_after(response) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
    ]


# ---------------------------------------------------------------------- the store


def _stored(response_id: str, status: str, task=None) -> StoredResponse:
    return StoredResponse({"id": response_id, "status": status}, task=task)


def test_store_evicts_the_least_recently_used_finished_response():
    async def scenario():
        running = asyncio.create_task(asyncio.sleep(60))
        store = ResponseStore(2)
        store.put(_stored("a", "completed"))
        store.put(_stored("b", "in_progress", running))
        assert store.get("a") is not None  # a is now the most recently used
        store.put(_stored("c", "completed"))
        assert "a" not in store and "b" in store and "c" in store  # b runs: a goes
        store.put(_stored("d", "in_progress", asyncio.create_task(asyncio.sleep(60))))
        assert "c" not in store and "b" in store and "d" in store
        store.put(_stored("e", "in_progress"))  # every other one runs: the oldest goes
        await asyncio.sleep(0)
        assert "b" not in store and running.cancelled()
        store.get("d").task.cancel()

    asyncio.run(scenario())
    empty = ResponseStore(0)
    empty.put(_stored("a", "completed"))
    assert len(empty) == 0 and empty.get("a") is None


def test_store_size_flag():
    from jaxengine.config.arg_utils import FlexibleArgumentParser
    from server.api_server.args import add_server_args, check_server_args

    parse = add_server_args(FlexibleArgumentParser()).parse_args
    assert parse([]).max_stored_responses == 1024
    check_server_args(parse(["--max-stored-responses", "0"]))
    with pytest.raises(ValueError, match="--max-stored-responses"):
        check_server_args(parse(["--max-stored-responses", "-1"]))
