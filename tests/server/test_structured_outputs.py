"""Structured outputs and tool calling against a real `jaxengine serve` (the default model).

On the session's SmolLM2 server (`smollm2_server`), with auto tool choice (the hermes
parser) and a ChatML template that renders tools (`tool_chat_template.jinja`). Outputs
are sampled at temperature 1 over several seeds, so the constraint (not the model's
habits) is what makes them conform: JSON that validates against its schema, text that
fully matches its regex or grammar, one of the choices, tool calls whose arguments
validate. Requests over seeds run concurrently (the engine batches them).
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.test_errors import check_error, still_serves

SEEDS = range(4)
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The session's SmolLM2 server (`tests/server/conftest.py`: auto tool choice with
    the hermes parser, a ChatML template that renders tools)."""
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return server.client(max_retries=0, timeout=300)


def run_all(server, make_calls):
    """Runs ``make_calls(async_client)`` (a list of coroutines) concurrently."""

    async def main():
        async with server.async_client(max_retries=0, timeout=300) as client:
            return await asyncio.gather(*make_calls(client))

    return asyncio.run(main())


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------------- JSON schemas

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "city": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "country": {"type": "string", "enum": ["FR", "DE", "IT"]},
            },
            "required": ["name", "country"],
            "additionalProperties": False,
        },
        "capital": {"type": "boolean"},
    },
    "required": ["city", "capital"],
    "additionalProperties": False,
}
ARRAY = {
    "type": "object",
    "properties": {
        "colors": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["colors"],
    "additionalProperties": False,
}
ENUMS = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "nested": NESTED, "array": ARRAY, "enums": ENUMS}


def _json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def test_json_schemas_over_seeds(server):
    """Every schema over every seed, and through each of response_format,
    structured_outputs and guided_json: the spelling turns with the seed, so each
    schema is asked in all three spellings and each (schema, spelling) pair is run."""
    spellings = {
        "response_format": lambda n, s: {"response_format": _json_schema_format(n, s)},
        "structured_outputs": lambda n, s: {"extra_body": {"structured_outputs": {"json": s}}},
        "guided_json": lambda n, s: {"extra_body": {"guided_json": s}},
    }
    names = list(spellings)
    cases = [
        (name, schema, names[(i + seed) % len(names)], seed)
        for i, (name, schema) in enumerate(SCHEMAS.items())
        for seed in SEEDS
    ]
    assert {(c[0], c[2]) for c in cases} == {(n, s) for n in SCHEMAS for s in spellings}

    def calls(client):
        return [
            client.chat.completions.create(
                model=MODEL,
                messages=ask(f"Describe a {name} as JSON."),
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=seed,
                **spellings[spelling](name, schema),
            )
            for name, schema, spelling, seed in cases
        ]

    for (name, schema, spelling, seed), out in zip(cases, run_all(server, calls), strict=True):
        choice = out.choices[0]
        where = f"{name} via {spelling}, seed {seed}: {choice.message.content!r}"
        assert choice.finish_reason == "stop", where
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_validates(server, client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ask("Describe a city as JSON."),
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=7,
            stream=True,
            response_format=_json_schema_format("city", NESTED),
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), NESTED)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object(server):
    def calls(client):
        return [
            client.chat.completions.create(
                model=MODEL,
                messages=ask("Give a short JSON object about a cat."),
                max_tokens=MAX_TOKENS,
                temperature=0.0 if seed == 0 else 1.0,
                seed=seed,
                response_format={"type": "json_object"},
                extra_body={"structured_outputs": {"disable_any_whitespace": True}},
            )
            for seed in SEEDS
        ]

    for out in run_all(server, calls):
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue  # an object may grow past max_tokens; its prefix was still JSON
        assert isinstance(json.loads(choice.message.content), dict), choice.message.content


# ---------------------------------------------------------------------- regex, choice, grammar

REGEX = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"
CHOICES = ["Paris", "London", "Berlin", "Rome"]
LARK = r"""
start: sum
sum: NUMBER (OP NUMBER){0,3}
OP: " + " | " - "
NUMBER: /[1-9][0-9]{0,2}/
"""
LARK_MATCH = r"[1-9][0-9]{0,2}(( \+ | - )[1-9][0-9]{0,2}){0,3}"
GBNF = r"""
root ::= word ("," word){0,2}
word ::= [a-z]{2,6}
"""
GBNF_MATCH = r"[a-z]{2,6}(,[a-z]{2,6}){0,2}"


def _constrained(client, constraint: dict, seed: int, prompt: str):
    return client.chat.completions.create(
        model=MODEL,
        messages=ask(prompt),
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=seed,
        extra_body={"structured_outputs": constraint},
    )


@pytest.mark.parametrize(
    "constraint, matches",
    [
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"choice": CHOICES}, lambda t: t in CHOICES),
        ({"grammar": LARK}, lambda t: re.fullmatch(LARK_MATCH, t)),
        ({"grammar": GBNF}, lambda t: re.fullmatch(GBNF_MATCH, t)),
    ],
    ids=["regex", "choice", "lark", "gbnf"],
)
def test_text_constraints_over_seeds(server, constraint, matches):
    def calls(client):
        return [_constrained(client, constraint, seed, "Say something.") for seed in SEEDS]

    for out in run_all(server, calls):
        text = out.choices[0].message.content
        assert matches(text), (constraint, text)
        assert out.choices[0].finish_reason == "stop"


def test_legacy_guided_fields(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=ask("Capital of Italy?"),
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"guided_choice": CHOICES, "guided_decoding_backend": "auto"},
    )
    assert out.choices[0].message.content in CHOICES
    out = client.chat.completions.create(
        model=MODEL,
        messages=ask("A number?"),
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"guided_regex": "[0-9]{2}"},
    )
    assert re.fullmatch("[0-9]{2}", out.choices[0].message.content)


def test_completions_structured_outputs(server, client):
    """Completions take the same fields. Without a chat turn the model is prone to
    endless whitespace inside JSON, so the JSON is compact or its whitespace bounded
    (the two options, checked)."""
    options = [{"disable_any_whitespace": True}, {"whitespace_pattern": "[ ]?"}]

    def calls(c):
        return [
            c.completions.create(
                model=MODEL,
                prompt="The best colour is",
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=seed,
                extra_body={"structured_outputs": {"json": ARRAY, **option}},
            )
            for option in options
            for seed in SEEDS
        ]

    outs = run_all(server, calls)
    for i, out in enumerate(outs):
        text = out.choices[0].text
        jsonschema.validate(json.loads(text), ARRAY)
        assert "\n" not in text
        if i < len(SEEDS):
            assert " " not in text
    out = client.completions.create(
        model=MODEL,
        prompt=["Pick a city:", "Another city:"],
        max_tokens=10,
        n=2,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    assert len(out.choices) == 4 and all(c.text in CHOICES for c in out.choices)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="A number:",
            max_tokens=20,
            temperature=1.0,
            seed=2,
            stream=True,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": ENUMS}}},
        )
    )  # fmt: skip
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), ENUMS)


# ---------------------------------------------------------------------- tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_ASK = ask("What is the weather in Paris?")
TOOL_MAX_TOKENS = 400  # "required" leaves the number of calls open: some seeds make many


def check_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in (names or PARAMETERS)
        arguments = json.loads(call.function.arguments)
        schema = PARAMETERS[call.function.name]
        jsonschema.validate(arguments, {**schema, "additionalProperties": False})


def _tool_request(client, tool_choice, seed, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=TOOL_MAX_TOKENS,
        temperature=1.0,
        seed=seed,
        **kwargs,
    )


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_over_seeds(server, tool_choice):
    def calls(client):
        return [_tool_request(client, tool_choice, seed) for seed in SEEDS]

    names = ["get_time"] if tool_choice == NAMED else None
    for out in run_all(server, calls):
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content
        check_calls(choice.message.tool_calls, names)
        if names:
            assert len(choice.message.tool_calls) == 1


def test_required_without_parallel_calls_makes_one(server):
    def calls(client):
        return [
            _tool_request(client, "required", seed, parallel_tool_calls=False) for seed in SEEDS
        ]

    for out in run_all(server, calls):
        assert len(out.choices[0].message.tool_calls) == 1
        check_calls(out.choices[0].message.tool_calls)


def streamed_calls(chunks) -> tuple[dict[int, dict], list[str]]:
    """Each streamed call ({id, name, arguments joined}) by index; the finish reasons."""
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
                else:
                    assert delta.function.name is None
                calls[delta.index]["args"] += delta.function.arguments or ""
    return calls, finishes


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_forced_tool_calls(server, tool_choice):
    """The joined argument fragments are the arguments of the same seeded request
    unstreamed (the four requests at once: a seeded row's tokens do not depend on
    its neighbours)."""
    seeds = (11, 12)

    async def streamed(client, seed):
        chunks = await _tool_request(client, tool_choice, seed, stream=True)
        return [chunk async for chunk in chunks]

    def requests(client):
        wholes = [_tool_request(client, tool_choice, seed) for seed in seeds]
        return wholes + [streamed(client, seed) for seed in seeds]

    outs = run_all(server, requests)
    for whole, chunks in zip(outs[: len(seeds)], outs[len(seeds) :], strict=True):
        whole = whole.choices[0].message.tool_calls
        calls, finishes = streamed_calls(chunks)
        assert finishes == ["tool_calls"]
        assert [c["name"] for c in calls.values()] == [c.function.name for c in whole]
        assert [c["args"] for c in calls.values()] == [c.function.arguments for c in whole]
        for call in calls.values():
            jsonschema.validate(json.loads(call["args"]), PARAMETERS[call["name"]])


HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", "unit": "celsius"\}\}\n</tool_call>'  # noqa: E501


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_tool_choice_parses_hermes_calls(server, client, stream):
    """tool_choice auto: the hermes parser finds the call; a regex makes the model
    write one (the template asks for this format)."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=TOOLS,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
        stream=stream,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    if not stream:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, ["get_weather"])
        assert not choice.message.content
        return
    calls, finishes = streamed_calls(out)
    assert finishes == ["tool_calls"]
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["args"]), PARAMETERS["get_weather"])


def test_tool_choice_none_gives_text(client):
    out = client.chat.completions.create(
        model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    choice = out.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"


def test_tool_messages_rendered_by_the_template(server):
    messages = [
        *WEATHER_ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    response = server.post("/tokenize", {"messages": messages, "tools": TOOLS})
    assert response.status_code == 200, response.text
    text = server.post("/detokenize", {"tokens": response.json()["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # and a reply to it
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 4}
    assert server.post("/v1/chat/completions", body).status_code == 200


# ---------------------------------------------------------------------- 400s

CHAT = ask("Hi")

REFUSED_CHAT = {
    "length_penalty": 0.5,  # beam search's (tests/server/test_beam_search_server.py)
    "early_stopping": True,
    "best_of": 3,
    "logits_processors": ["my.module:Processor"],
    "cache_salt": "salt",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "verbosity": "low",
}
REFUSED_COMPLETIONS = {
    "suffix": "!",
    "best_of": 2,
    "length_penalty": 2.0,
    "prompt_embeds": "AAAA",
    "mm_processor_kwargs": {"size": 3},  # images come in chat messages only
    "logits_processors": ["x"],
    "cache_salt": "salt",
}


@pytest.mark.parametrize("field", REFUSED_CHAT)
def test_unsupported_chat_field_is_refused(server, field):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, field: REFUSED_CHAT[field]}
    error = check_error(server.post("/v1/chat/completions", body), 400, field)
    assert error["param"] == field


@pytest.mark.parametrize("field", REFUSED_COMPLETIONS)
def test_unsupported_completion_field_is_refused(server, field):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: REFUSED_COMPLETIONS[field]}
    error = check_error(server.post("/v1/completions", body), 400, field)
    assert error["param"] == field


def test_defaults_of_refused_fields_are_accepted(server):
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 2,
        "use_beam_search": False,
        "length_penalty": 1.0,
        "best_of": 1,
        "modalities": ["text"],
        "return_token_ids": False,
        "user": "u",
        "metadata": {"a": "b"},
        "store": False,
        "service_tier": "auto",
    }
    assert server.post("/v1/chat/completions", body).status_code == 200
    still_serves(server)


BAD_STRUCTURED = {
    "two constraints": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "regex"),
    "two spellings": (
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        "guided_regex",
    ),
    "unknown key": ({"structured_outputs": {"jsonn": {}}}, "jsonn"),
    "bad regex": ({"structured_outputs": {"regex": "a(("}}, ""),
    "bad schema": ({"structured_outputs": {"json": {"type": "no-such-type"}}}, ""),
    "bad grammar": ({"structured_outputs": {"grammar": "start: ((("}}, ""),
    "empty choice": ({"structured_outputs": {"choice": []}}, "choice"),
    "schema missing": ({"response_format": {"type": "json_schema", "json_schema": {}}}, "schema"),
    "other format": ({"response_format": {"type": "xml"}}, "response_format"),
    "other backend": ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, "backend"),
}


@pytest.mark.parametrize("fields", BAD_STRUCTURED.values(), ids=BAD_STRUCTURED.keys())
def test_bad_structured_outputs(server, fields):
    change, needle = fields
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **change}
    check_error(server.post("/v1/chat/completions", body), 400, needle)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **change}
    check_error(server.post("/v1/completions", body), 400, needle)


BAD_TOOLS = {
    "unknown named tool": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "nope",
    ),
    "tool_choice without tools": ({"tool_choice": "required"}, "tools"),
    "bad tool_choice": ({"tools": TOOLS, "tool_choice": "sometimes"}, "sometimes"),
    "tool without name": ({"tools": [{"type": "function", "function": {}}]}, "name"),
    "required with response_format": (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    "arguments not JSON": (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{x"}}],
                }
            ]
        },
        "arguments",
    ),
}


@pytest.mark.parametrize("fields", BAD_TOOLS.values(), ids=BAD_TOOLS.keys())
def test_bad_tool_requests(server, fields):
    change, needle = fields
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **change}
    check_error(server.post("/v1/chat/completions", body), 400, needle)


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"cache_salt": "salt"}
        )
    assert "cache_salt" in info.value.message
