"""The `deepseek_v3`, `deepseek_v31` and `kimi_k2` tool-call parsers: canned outputs in
each model's format, parsed whole and streamed, with the streaming property of
`tests/unit/test_tool_parsers.py` (every two-way split and one character at a time
give extract's content, one id and name per call and the identical arguments text)."""

from __future__ import annotations

import pytest

from server.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.unit.test_tool_parsers import (
    check_all_content,
    check_extract,
    check_stream_matches_extract,
    run_stream,
    splits,
)

DS = {
    "S": "<｜tool▁calls▁begin｜>",
    "E": "<｜tool▁calls▁end｜>",
    "C": "<｜tool▁call▁begin｜>",
    "D": "<｜tool▁call▁end｜>",
    "P": "<｜tool▁sep｜>",
}
KIMI = {
    "S": "<|tool_calls_section_begin|>",
    "E": "<|tool_calls_section_end|>",
    "C": "<|tool_call_begin|>",
    "D": "<|tool_call_end|>",
    "A": "<|tool_call_argument_begin|>",
}
WEATHER = {"city": "São Paulo", "days": [1, 2.5], "opts": {"unit": "°C", "q": '"x" \\ 😀'}}
WEATHER_JSON = (
    '{"city": "São Paulo", "days": [1, 2.5], "opts": {"unit": "°C", "q": "\\"x\\" \\\\ 😀"}}'
)

# (parser, model output, [(name, arguments object)], content)
CASES = [
    (
        "deepseek_v3",
        "Let me check.\n{S}{C}function{P}get_weather\n```json\n" + WEATHER_JSON + "\n```{D}\n"
        "{C}function{P}now\n```json\n{}\n```{D}{E}",
        [("get_weather", WEATHER), ("now", {})],
        "Let me check.\n",
    ),
    (  # no section markers, no fence, cut off before the end markers
        "deepseek_v3",
        '{C}function{P}f\n{"a": [true, null]}',
        [("f", {"a": [True, None]})],
        None,
    ),
    (
        "deepseek_v31",
        "{S}{C}get_weather{P}" + WEATHER_JSON + "{D}{C}now{P}{}{D}{E} Done.",
        [("get_weather", WEATHER), ("now", {})],
        " Done.",
    ),
    (
        "kimi_k2",
        "Sure.{S}{C}functions.get_weather:0{A}" + WEATHER_JSON + "{D}"
        '{C}functions.now:1 {A} {"tz": "UTC"} {D}{E}',
        [("get_weather", WEATHER), ("now", {"tz": "UTC"})],
        "Sure.",
    ),
]
MALFORMED = [
    ("deepseek_v3", "x {C}function{P}f\nnot json{D} y"),
    ("deepseek_v3", "{C}nosep\n{}{D}"),
    ("deepseek_v31", "{S}{C}has space{P}{}{D}{E}"),
    ("kimi_k2", "{S}{C}functions.f:0{A}[1, 2]{D}{E}"),
    ("kimi_k2", "a {C}functions.f:0"),
]


def _fill(name: str, text: str) -> str:
    for key, marker in (KIMI if name == "kimi_k2" else DS).items():
        text = text.replace("{" + key + "}", marker)
    return text


def _id(case) -> str:
    return f"{case[0]}-{(CASES + MALFORMED).index(case)}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_extract(case):
    name, text, calls, content = case
    check_extract(get_tool_parser(name)(None), _fill(name, text), calls, content)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_stream_matches_extract_for_every_split(case):
    name, text = case[:2]
    check_stream_matches_extract(get_tool_parser(name)(None), _fill(name, text))


@pytest.mark.parametrize("case", MALFORMED, ids=_id)
def test_malformed_calls_are_content(case):
    name, text = case
    filled = _fill(name, text)
    check_all_content(get_tool_parser(name)(None), filled, splits(filled))


def test_arguments_stream_in_pieces_and_kimi_keeps_its_ids():
    name, text = CASES[3][:2]
    parser = get_tool_parser(name)(None)
    got = run_stream(parser, list(_fill(name, text)))
    assert got.fragments[0] > 5  # the arguments go out as they are written
    assert got.ids == {0: ["functions.get_weather:0"], 1: ["functions.now:1"]}
    calls = parser.extract_tool_calls(_fill(name, text)).tool_calls
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.now:1"]


def test_plain_answers_pass_through():
    for name in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
        parser = get_tool_parser(name)(None)
        for text in ["", "Hello! How can I help?\n", "  a <｜tool▁c <|tool_ca  "]:
            assert parser.extract_tool_calls(text).content == (text or None)
            assert run_stream(parser, list(text)).content == text


def test_registered_and_markers_special():
    assert {"deepseek_v3", "deepseek_v31", "kimi_k2"} <= set(TOOL_PARSERS)

    class Tokenizer:
        all_special_tokens = [DS["C"]]

    class Request:
        tools = [{"type": "function", "function": {"name": "f"}}]
        tool_choice = "auto"
        skip_special_tokens = True

    request = get_tool_parser("deepseek_v3")(Tokenizer()).adjust_request(Request())
    assert request.skip_special_tokens is False


def test_fenced_arguments_stream_as_they_are_written():
    name, text = CASES[0][:2]
    got = run_stream(get_tool_parser(name)(None), list(_fill(name, text)))
    assert got.fragments[0] > 5
