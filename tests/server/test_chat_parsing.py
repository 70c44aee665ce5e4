"""The server's request reading and output parsing for structured outputs, tools and
reasoning, without a model: refused fields, the constraint a request makes, tool
choice rules, the forced tool-call schema, reading calls back from streamed JSON,
and the split of a reply into reasoning, content and tool calls.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
from types import SimpleNamespace

import jsonschema
import pydantic
import pytest

from server import structured
from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import ChatHandler, _ChatView, _finish_reason, normalize_message
from server.chat_rendering.output import ChatOutputParser
from server.completions.protocol import CompletionRequest
from server.errors import APIError
from server.structured import structured_outputs_params
from server.tool_calls import (
    AUTO_NEEDS_FLAGS,
    NO_TOOLS,
    ForcedCalls,
    ToolChoice,
    forced_schema,
    resolve_tool_choice,
)
from server.unsupported_fields import REFUSED

MESSAGES = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
FREE = {"type": "function", "function": {"name": "log", "parameters": {"type": "object"}}}
BARE = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, FREE, BARE]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# ---------------------------------------------------------------------- refused fields


def test_every_refused_field_is_declared():
    """A refusal the models do not declare would never run (the field is dropped)."""
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert set(REFUSED) <= declared


@pytest.mark.parametrize(
    "model, field, value",
    [
        (ChatCompletionRequest, "length_penalty", 0.5),  # without use_beam_search
        (ChatCompletionRequest, "modalities", ["audio"]),
        (ChatCompletionRequest, "web_search_options", {}),
        (ChatCompletionRequest, "functions", [{"name": "f"}]),
        (CompletionRequest, "suffix", "x"),
        (CompletionRequest, "best_of", 2),
    ],
)
def test_refused_field_error_is_at_the_field(model, field, value):
    base = {"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "Hi"}
    with pytest.raises(pydantic.ValidationError) as info:
        model(**base, **{field: value})
    assert info.value.errors()[0]["loc"] == (field,)


def test_defaults_of_refused_fields_pass():
    chat(use_beam_search=False, length_penalty=1.0, best_of=1, modalities=["text"])
    CompletionRequest(prompt="Hi", n=2, best_of=2, cache_salt=None, suffix=None)


def test_ignored_fields_are_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxengine.server"):
        chat(store=True, metadata={"a": "b"})
    assert "['metadata', 'store']" in caplog.text


# ---------------------------------------------------------------------- structured outputs


@pytest.mark.parametrize(
    "fields, kind, value",
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"a": 1}}}},
            "json",
            {"a": 1},
        ),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"]),
        ({"guided_grammar": "start: /a/"}, "grammar", "start: /a/"),
        ({"guided_json": '{"type": "object"}'}, "json", '{"type": "object"}'),
        ({"structural_tag": '{"structures": []}'}, "structural_tag", '{"structures": []}'),
    ],
)
def test_each_spelling_gives_the_constraint(fields, kind, value):
    params = structured_outputs_params(chat(**fields))
    assert params.kind == kind and getattr(params, kind) == value


def test_no_constraint():
    assert structured_outputs_params(chat()) is None
    assert structured_outputs_params(chat(response_format={"type": "text"})) is None
    options_only = {"disable_any_whitespace": True}
    assert structured_outputs_params(chat(structured_outputs=options_only)) is None


def test_options_reach_the_params():
    request = chat(
        structured_outputs={"json_object": True, "disable_any_whitespace": True},
        guided_whitespace_pattern=" ?",
    )
    params = structured_outputs_params(request)
    assert params.json_object and params.disable_any_whitespace
    assert params.whitespace_pattern == " ?"


def test_structural_tag_response_format_is_passed_whole():
    form = {"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]}
    params = structured_outputs_params(chat(response_format=form))
    assert json.loads(params.structural_tag) == form


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"structured_outputs": {"regex": "a", "grammar": "g"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"nope": 1}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_conflicts_and_bad_values_are_400(fields, param):
    with pytest.raises(APIError) as info:
        structured_outputs_params(chat(**fields))
    assert info.value.status == 400 and info.value.param == param


def test_legacy_fields_warn_once(caplog, monkeypatch):
    monkeypatch.setattr(structured, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="jaxengine.server"):
        for _ in range(3):
            structured_outputs_params(chat(guided_regex="a"))
    assert caplog.text.count("`guided_regex` is deprecated") == 1


def test_per_request_backend():
    config = SimpleNamespace(option=lambda key: "auto", backend="guidance")
    for name in ("auto", "guidance", "guidance:disable-any-whitespace", "AUTO"):
        structured_outputs_params(chat(guided_regex="a", guided_decoding_backend=name), config)
    with pytest.raises(APIError) as info:
        structured_outputs_params(
            chat(guided_regex="a", guided_decoding_backend="xgrammar"), config
        )
    assert info.value.param == "guided_decoding_backend"


# ---------------------------------------------------------------------- tool choice


def test_default_tool_choice():
    assert resolve_tool_choice(chat(tools=TOOLS), auto_tool_choice=True) == ToolChoice("auto")
    assert resolve_tool_choice(chat(tools=TOOLS), auto_tool_choice=False) == NO_TOOLS
    assert resolve_tool_choice(chat(), auto_tool_choice=True) == NO_TOOLS


def test_explicit_tool_choices():
    named = {"type": "function", "function": {"name": "ping"}}
    assert resolve_tool_choice(chat(tools=TOOLS, tool_choice=named), False) == ToolChoice(
        "named", "ping"
    )
    assert resolve_tool_choice(chat(tools=TOOLS, tool_choice="required"), False).forced
    assert resolve_tool_choice(chat(tools=TOOLS, tool_choice="none"), True) == NO_TOOLS


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"tools": TOOLS, "tool_choice": "auto"}, AUTO_NEEDS_FLAGS),
        ({"tool_choice": "none"}, "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "'x'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "named tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "always"),
        ({"tools": [{"type": "code_interpreter"}]}, "function tools"),
    ],
)
def test_bad_tool_choices(fields, needle):
    with pytest.raises(APIError) as info:
        resolve_tool_choice(chat(**fields), auto_tool_choice=False)
    assert needle in info.value.message and info.value.status == 400


def test_handler_refuses_auto_without_the_flags():
    ctx = SimpleNamespace(check_model=lambda name: "m", auto_tool_choice=False)
    with pytest.raises(APIError) as info:
        asyncio.run(ChatHandler(ctx).create(chat(tools=TOOLS, tool_choice="auto")))
    assert info.value.message == AUTO_NEEDS_FLAGS


# ---------------------------------------------------------------------- forced schemas


def test_required_schema_is_closed():
    schema = forced_schema(TOOLS, ToolChoice("required"), parallel=True)
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "ping", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    bad = [
        [],
        [{"name": "get_weather", "parameters": {"city": "Paris", "extra": 1}}],
        [{"name": "get_weather", "parameters": {"city": "Paris"}, "id": 3}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "ping", "parameters": {"x": 1}}],
    ]
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    jsonschema.validate([{"name": "log", "parameters": {"any": [1]}}], schema)  # free-form


def test_required_without_parallel_calls_has_one_item():
    schema = forced_schema(TOOLS, ToolChoice("required"), parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1


def test_named_schema_is_the_arguments():
    schema = forced_schema(TOOLS, ToolChoice("named", "get_weather"), parallel=True)
    assert schema["properties"] == WEATHER["function"]["parameters"]["properties"]
    assert schema["additionalProperties"] is False
    assert "additionalProperties" not in WEATHER["function"]["parameters"]  # not mutated


# ---------------------------------------------------------------------- reading calls

CALLS_TEXT = (
    ' [\n {"name": "get_weather", "parameters": {"city": "Pa\\"ris {x}", "days": 3}},'
    ' {"parameters" : {"a": [1, {"b": "]"}], "c": null}, "name":"log"} , '
    '{"name": "ping", "parameters": {}}]'
)


def _split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _joined(deltas: list[dict]) -> dict[int, dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["type"] == "function" and d["id"] and d["function"]["name"]
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "args": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        calls[d["index"]]["args"] += d["function"]["arguments"]
    return calls


@pytest.mark.parametrize("seed", range(20))
def test_streamed_required_calls_join_to_the_final_ones(seed):
    forced = ForcedCalls(ToolChoice("required"), ids())
    deltas = [d for piece in _split(CALLS_TEXT, random.Random(seed)) for d in forced.feed(piece)]
    final = forced.calls()
    assert [c["function"]["name"] for c in final] == ["get_weather", "log", "ping"]
    streamed = _joined(deltas)
    assert [streamed[i]["args"] for i in range(3)] == [c["function"]["arguments"] for c in final]
    assert [streamed[i]["id"] for i in range(3)] == [c["id"] for c in final]
    parsed = json.loads(CALLS_TEXT)
    assert [json.loads(c["function"]["arguments"]) for c in final] == [
        p["parameters"] for p in parsed
    ]
    assert forced.called


def test_named_call_streams_the_whole_output():
    forced = ForcedCalls(ToolChoice("named", "get_weather"), ids())
    first = forced.feed("")
    assert first == [
        {
            "index": 0,
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
    ]
    rest = forced.feed('{"city"') + forced.feed("") + forced.feed(': "Oslo"}')
    assert "".join(d["function"]["arguments"] for d in rest) == '{"city": "Oslo"}'
    assert forced.calls()[0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_unfinished_required_output_gives_what_is_complete():
    forced = ForcedCalls(ToolChoice("required"), ids())
    forced.feed('[{"name": "get_weather", "parameters": {"city": "Pa')
    calls = forced.calls()
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


# ---------------------------------------------------------------------- reasoning and content


class FakeReasoning:
    """<think>...</think> at the start; markers arrive whole within one delta."""

    def extract(self, text):
        if "</think>" not in text:
            return None, text
        reasoning, content = text.removeprefix("<think>").split("</think>", 1)
        return reasoning or None, content or None

    def stream(self):
        class Stream:
            done = False

            def feed(self, delta):
                if self.done:
                    return "", delta
                delta = delta.replace("<think>", "")
                if "</think>" not in delta:
                    return delta, ""
                self.done = True
                return tuple(delta.split("</think>", 1))

            def finish(self):
                return "", ""

        return Stream()


class FakeHermes:
    """Calls as <call>name</call>; content is the rest."""

    def extract_tool_calls(self, text, request):
        if "<call>" not in text:
            return SimpleNamespace(tools_called=False, tool_calls=[], content=text)
        before, _, rest = text.partition("<call>")
        name = rest.partition("</call>")[0]
        call = SimpleNamespace(name=name, arguments="{}", id=None)
        return SimpleNamespace(tools_called=True, tool_calls=[call, call], content=before or None)

    def stream(self, request):
        class Stream:
            tool_calls_sent = False

            def feed(self, delta):
                if delta.startswith("<call>"):
                    self.tool_calls_sent = True
                    calls = [
                        SimpleNamespace(to_openai=lambda i=i: {"index": i, "id": f"c{i}"})
                        for i in range(2)
                    ]
                    return SimpleNamespace(content="", tool_calls=calls)
                return SimpleNamespace(content=delta, tool_calls=[])

            def finish(self):
                return SimpleNamespace(content="", tool_calls=[])

        return Stream()


def parser(request, choice=NO_TOOLS, reasoning=None, tools=None) -> ChatOutputParser:
    return ChatOutputParser(request, choice, reasoning, tools, ids())


def test_reasoning_split_whole_and_streamed():
    p = parser(chat(), reasoning=FakeReasoning())
    message, called = p.message("<think>hmm</think>Paris", "assistant")
    assert message == {
        "role": "assistant",
        "content": "Paris",
        "reasoning_content": "hmm",
        "reasoning": "hmm",
    }
    assert not called
    stream = p.stream()
    deltas = [p.delta_dict(stream.feed(t)) for t in ["<think>", "hm", "m</think>Par", "is"]]
    assert deltas[0] == {}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert "".join(d.get("content", "") for d in deltas) == "Paris"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_include_reasoning_false_hides_it():
    p = parser(chat(include_reasoning=False), reasoning=FakeReasoning())
    message, _ = p.message("<think>hmm</think>Paris", "assistant")
    assert message == {"role": "assistant", "content": "Paris"}


def test_tool_parsing_runs_on_the_content_only():
    p = parser(chat(tools=TOOLS), ToolChoice("auto"), FakeReasoning(), FakeHermes())
    message, called = p.message("<think>a <call>x</call></think>ok <call>ping</call>", "assistant")
    assert (
        called
        and message["content"] == "ok "
        and message["reasoning_content"] == "a <call>x</call>"
    )
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["ping", "ping"]
    assert message["tool_calls"][0]["id"] == "call_0"


def test_auto_without_parallel_calls_keeps_the_first():
    request = chat(tools=TOOLS, parallel_tool_calls=False)
    p = parser(request, ToolChoice("auto"), tools=FakeHermes())
    message, _ = p.message("<call>ping</call>", "assistant")
    assert len(message["tool_calls"]) == 1
    stream = p.stream()
    delta = stream.feed("<call>")
    assert [c["index"] for c in delta.tool_calls] == [0] and stream.tools_called


def test_forced_calls_after_reasoning():
    p = parser(chat(tools=TOOLS), ToolChoice("named", "ping"), FakeReasoning())
    message, called = p.message("<think>why</think>{}", "assistant")
    assert called and message["content"] is None and message["reasoning_content"] == "why"
    assert message["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{}"}


def test_plain_chat_keeps_every_chunk():
    p = parser(chat())
    assert p.plain and p.delta_dict(p.stream().feed("")) == {"content": ""}


def test_finish_reason():
    assert _finish_reason("stop", True) == "tool_calls"
    assert _finish_reason("length", True) == "length"
    assert _finish_reason("stop", False) == "stop"


def test_streamed_view_sends_tool_calls_and_finish_reason():
    """The chat view over fake engine outputs: a named call, streamed in three steps."""
    from jaxengine.outputs import CompletionOutput, RequestOutput

    def output(text, finish):
        seq = CompletionOutput(
            index=0, text=text, token_ids=[1], cumulative_logprob=None, logprobs=None
        )
        seq.finish_reason = finish
        return RequestOutput("r", None, [1], None, [seq], finished=finish is not None)

    async def outputs():
        for text, finish in [('{"ci', None), ('ty": "Oslo"', None), ("}", "stop")]:
            yield 0, output(text, finish)

    request = chat(
        tools=TOOLS,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    options = SimpleNamespace(
        response_role="assistant",
        return_tokens_as_token_ids=False,
        enable_force_include_usage=False,
        enable_prompt_tokens_details=False,
    )
    ctx = SimpleNamespace(options=options, tokenizer=None)
    view = _ChatView(
        ctx, request, "m", "id", 3, parser(request, ToolChoice("named", "get_weather"))
    )

    async def collect():
        return [chunk async for chunk in view.stream(outputs())]

    chunks = asyncio.run(collect())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [t for d in deltas[1:] for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Oslo"}'
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "tool_calls"]


# ---------------------------------------------------------------------- template input


def test_assistant_tool_calls_reach_the_template_as_dicts():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}},
        ],
    }
    out = normalize_message(message, "string")
    assert out["content"] == ""
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == [{"a": 1}, {}]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not mutated
    tool = {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "ok"}]}
    assert normalize_message(tool, "string") == {**tool, "content": "ok"}


# ---------------------------------------------------------------------- the real parsers


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_deepseek_reasoning_then_hermes_calls(smollm2_tokenizer, size):
    """The registered parsers in the pipeline: the stream joins to the whole reply."""
    from jaxengine.reasoning import get_reasoning_parser
    from server.tool_parsers import get_tool_parser

    text = (
        "Let me think.\n</think>\n\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    request = chat(tools=TOOLS)
    think_vocab = SimpleNamespace(get_vocab=lambda: {"<think>": 1, "</think>": 2})
    reasoning = get_reasoning_parser("deepseek_r1")(think_vocab)
    tools = get_tool_parser("hermes")(smollm2_tokenizer)
    p = parser(request, ToolChoice("auto"), reasoning, tools)
    message, called = p.message(text, "assistant")
    assert called and message["reasoning_content"] == "Let me think."
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    stream = p.stream()
    deltas = [p.delta_dict(stream.feed(piece)) for piece in _pieces(text, size)]
    deltas.append(p.delta_dict(stream.finish()))
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think."
    assert (
        "".join(d.get("content", "") for d in deltas).strip() == (message["content"] or "").strip()
    )
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == {"city": "Paris"} and stream.tools_called


# ---------------------------------------------------------------------- start-up checks


def _args(**flags):
    defaults = {"enable_auto_tool_choice": False, "tool_call_parser": None}
    return SimpleNamespace(**{**defaults, "tool_parser_plugin": None, **flags})


def test_auto_tool_choice_needs_a_parser():
    from server.api_server.args import check_server_args

    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_server_args(_args(enable_auto_tool_choice=True))
    with pytest.raises(ValueError, match="hermes"):  # the known names
        check_server_args(_args(enable_auto_tool_choice=True, tool_call_parser="nope"))
    check_server_args(_args(enable_auto_tool_choice=True, tool_call_parser="hermes"))


def test_parser_plugins(tmp_path):
    from server.serving import ServerOptions, reasoning_parser_class, tool_parser_class

    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(
        "from server.tool_parsers import register_tool_parser\n"
        "from server.tool_parsers.hermes import HermesToolParser\n"
        "from jaxengine.reasoning import register_reasoning_parser\n"
        "from jaxengine.reasoning.think import DeepSeekR1ReasoningParser\n"
        "@register_tool_parser('my_tools')\n"
        "class Mine(HermesToolParser): pass\n"
        "@register_reasoning_parser('my_thoughts')\n"
        "class Thoughts(DeepSeekR1ReasoningParser): pass\n"
    )
    assert tool_parser_class("my_tools", str(plugin)).__name__ == "Mine"
    options = ServerOptions(
        ("m",), reasoning_parser="my_thoughts", reasoning_parser_plugin=str(plugin)
    )
    assert reasoning_parser_class(options).__name__ == "Thoughts"
    assert tool_parser_class(None) is None
    assert reasoning_parser_class(ServerOptions(("m",))) is None


@pytest.mark.parametrize("exclude", [False, True])
def test_tools_in_the_prompt(smollm2_tokenizer, exclude):
    """Tools are rendered for every choice, except "none" with the exclude flag."""
    from pathlib import Path

    template = str(Path(__file__).with_name("tool_chat_template.jinja"))
    options = SimpleNamespace(
        chat_template=template,
        chat_template_content_format="auto",
        exclude_tools_when_tool_choice_none=exclude,
    )
    ctx = SimpleNamespace(options=options, need_tokenizer=lambda: smollm2_tokenizer)
    handler = ChatHandler(ctx)
    for choice in ("none", "required", None):
        ids = handler.render(chat(tools=TOOLS, tool_choice=choice))
        rendered = "<tools>" in smollm2_tokenizer.decode(ids)
        assert rendered == (not (exclude and choice == "none")), choice
