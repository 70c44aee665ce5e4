"""The `glm45` tool-call parser (GLM-4.5 / 4.6): canned outputs, parsed whole and
streamed, with the streaming property of `tests/unit/test_tool_parsers.py` (every
two-way split and one character at a time give extract's content, one id and name per
call and the identical arguments text)."""

from __future__ import annotations

import json

import pytest

from server.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.unit.test_tool_parsers import (
    check_all_content,
    check_extract,
    check_stream_matches_extract,
    run_stream,
    splits,
)

WEATHER = (
    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>São Paulo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>[1, 2.5]</arg_value>\n"
    '<arg_key>opts</arg_key>\n<arg_value>{"unit": "°C", "deep": [null, true]}</arg_value>\n'
    "</tool_call>\n<tool_call>now\n</tool_call>\n"
)

# (model output, [(name, arguments object)], content)
CASES = [
    (
        WEATHER,
        [
            (
                "get_weather",
                {
                    "city": "São Paulo",
                    "days": [1, 2.5],
                    "opts": {"unit": "°C", "deep": [None, True]},
                },
            ),
            ("now", {}),
        ],  # fmt: skip
        "Let me check.\n",
    ),
    (  # no closing tags at the end; a value cut short by the next key; 42 is JSON
        '<tool_call>f<arg_key>a</arg_key><arg_value>"quoted" \\ 😀<arg_key>b</arg_key>'
        "<arg_value>42",
        [("f", {"a": '"quoted" \\ 😀', "b": 42})],
        None,
    ),
    (  # whitespace around the name and between key and value; text after the call
        "<tool_call>\n  lookup  \n<arg_key> q </arg_key>  \n <arg_value>x < y</arg_value>"
        "</tool_call> Done.",
        [("lookup", {"q": "x < y"})],
        " Done.",
    ),
    (  # a key without a value, then a key holding "<", are ignored
        "<tool_call>g\n<arg_key>lost</arg_key>\n<arg_key>a<b</arg_key><arg_value>1</arg_value>"
        "<arg_key>ok</arg_key><arg_value>true</arg_value></tool_call>",
        [("g", {"ok": True})],
        None,
    ),
]

MALFORMED = [
    "x <tool_call>not a name</tool_call> y",
    "<tool_call>\n</tool_call>",
    "<tool_call>",
    "a <tool_call><arg_key>k</arg_key>",
]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_extract(case):
    text, calls, content = case
    check_extract(get_tool_parser("glm45")(None), text, calls, content)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_stream_matches_extract_for_every_split(case):
    check_stream_matches_extract(get_tool_parser("glm45")(None), case[0])


def test_arguments_stream_one_parameter_at_a_time():
    """Fed one character at a time, each argument goes out once its value ends."""
    got = run_stream(get_tool_parser("glm45")(None), list(WEATHER))
    assert got.fragments[0] == 5  # "{", three "key": value pieces, "}"


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_blocks_are_content(text):
    check_all_content(get_tool_parser("glm45")(None), text, splits(text))


def test_plain_answers_pass_through():
    parser = get_tool_parser("glm45")(None)
    for text in ["", "Hello! How can I help?\n", "  a <tool_c  "]:
        assert parser.extract_tool_calls(text).content == (text or None)
        assert run_stream(parser, list(text)).content == text


def test_string_parameters_follow_the_schema():
    """A parameter the schema declares a string stays as written, even when it would
    parse as JSON; the others are decoded."""

    class Request:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "write",
                    "parameters": {
                        "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}
                    },
                },
            }
        ]

    text = (
        "<tool_call>write\n<arg_key>path</arg_key>\n<arg_value>123</arg_value>\n"
        "<arg_key>n</arg_key>\n<arg_value>123</arg_value>\n</tool_call>"
    )
    parser = get_tool_parser("glm45")(None)
    call = parser.extract_tool_calls(text, Request()).tool_calls[0]
    assert json.loads(call.arguments) == {"path": "123", "n": 123}
    assert run_stream(parser, list(text), Request()).args[0] == call.arguments
    assert json.loads(parser.extract_tool_calls(text).tool_calls[0].arguments)["path"] == 123


def test_registered_and_markers_special():
    assert TOOL_PARSERS["glm45"] is get_tool_parser("glm45")

    class Tokenizer:
        all_special_tokens = ["<arg_value>"]

    class Request:
        tools = [{"type": "function", "function": {"name": "f"}}]
        tool_choice = "auto"
        skip_special_tokens = True

    request = get_tool_parser("glm45")(Tokenizer()).adjust_request(Request())
    assert request.skip_special_tokens is False
