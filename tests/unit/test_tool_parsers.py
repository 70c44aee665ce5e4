"""Tool-call parsers: canned outputs per format, parsed whole and streamed.

The streaming property (tested for every canned output): split at every character
boundary into two deltas, or fed one character at a time, the stream gives the same
content as `extract_tool_calls` and, per call, one id, the same name and argument
fragments that concatenate to the identical arguments text.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

from server.tool_parsers import (
    TOOL_PARSERS,
    DeltaToolCall,
    get_tool_parser,
    import_tool_parser_plugin,
    make_tool_call_id,
)

# (parser, model output, [(name, arguments object)], content)
CASES = [
    (
        "hermes",
        'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
        ' "days": [1, 2.5], "opts": {"unit": "°C", "deep": {"x": null, "y": [true]}}}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n',
        [
            (
                "get_weather",
                {
                    "city": "Paris",
                    "days": [1, 2.5],
                    "opts": {"unit": "°C", "deep": {"x": None, "y": [True]}},
                },
            ),
            ("now", {}),
        ],
        "Let me check.\n\n",
    ),
    (
        "hermes",
        '<tool_call>{"name": "say", "arguments": {"text": "caf\\u00e9 \\"q\\" \\ud83d\\ude00'
        ' 中文 \\\\ end"}}</tool_call> Done.',
        [("say", {"text": 'café "q" 😀 中文 \\ end'})],
        " Done.",
    ),
    (
        "hermes",  # no closing tag at the end of the output; "parameters" accepted
        'x<tool_call>{"name": "f", "parameters": {"a": "{\\"b\\": 1}"}}',
        [("f", {"a": '{"b": 1}'})],
        "x",
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Zürich", "n": [1, {"a": "x;y"}]}}; '
        '{"name": "now", "arguments": {}}',
        [("get_weather", {"city": "Zürich", "n": [1, {"a": "x;y"}]}), ("now", {})],
        None,
    ),
    (
        "llama3_json",
        'Sure.<|python_tag|>{"name": "f", "parameters": {"q": "é"}}\nThat is all.',
        [("f", {"q": "é"})],
        "Sure.\nThat is all.",
    ),
    (
        "mistral",
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        '"u": {"a": [1, 2]}}}, {"name": "now", "arguments": {}}]',
        [("get_weather", {"city": "Paris", "u": {"a": [1, 2]}}), ("now", {})],
        "Checking.",
    ),
    (
        "mistral",  # the v11+ format, one call per marker
        '[TOOL_CALLS]get_weather[ARGS]{"city": "São Paulo"}[TOOL_CALLS]now[ARGS]{} ok',
        [("get_weather", {"city": "São Paulo"}), ("now", {})],
        " ok",
    ),
    (
        "pythonic",
        "[get_weather(city='Paris', days=(1, 2)), f2(x=1, y={'a': [None, True]}, "
        's="it\'s ) ] 😀")]',
        [
            ("get_weather", {"city": "Paris", "days": [1, 2]}),
            ("f2", {"x": 1, "y": {"a": [None, True]}, "s": "it's ) ] 😀"}),
        ],
        None,
    ),
    (
        "pythonic",
        "  <|python_start|>[now()]<|python_end|> done",
        [("now", {})],
        " done",
    ),
    (
        "llama4_pythonic",
        '<|python_start|>[get_weather(city="Paris", days=[1, 2]), now()]<|python_end|>',
        [("get_weather", {"city": "Paris", "days": [1, 2]}), ("now", {})],
        None,
    ),
    (
        "llama4_pythonic",  # unwrapped, then text after the list
        "[search(q='it\\'s [x]', k=3)]\nLet me look.",
        [("search", {"q": "it's [x]", "k": 3})],
        "\nLet me look.",
    ),
    (
        "qwen3_xml",
        "I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParís\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n"
        '{"a": [1, null], "b": {"c": "d"}}\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=now>\n</function>\n</tool_call>",
        [
            (
                "get_weather",
                {"city": "París", "days": 3, "opts": {"a": [1, None], "b": {"c": "d"}}},
            ),
            ("now", {}),
        ],
        "I will call it.\n",
    ),
    (
        "qwen3_xml",  # missing </parameter> and </tool_call>
        "<tool_call><function=f><parameter=a>1<parameter=b>two lines\nhere</function>",
        [("f", {"a": 1, "b": "two lines\nhere"})],
        None,
    ),
]

# (parser, output that is not a (well-formed) call: all of it is content)
MALFORMED = [
    ("hermes", "<tool_call>not json</tool_call> tail"),
    ("hermes", 'a <tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", "just text with <tool_c"),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", "plain text {not json"),
    ("mistral", "hi [TOOL_CALLS]not a call"),
    ("mistral", "hi [TOOL_CALLS][1, 2]"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "Hello [f(x=1)]"),
    ("pythonic", '[f(x=open("a"))]'),
    ("pythonic", "[f(1)]"),
    ("llama4_pythonic", "<|python_start|>[f(x=y)]<|python_end|>"),
    ("qwen3_xml", "x <tool_call>junk</tool_call> y"),
    ("qwen3_xml", "<tool_call><function=f"),
]


@dataclass
class Streamed:
    content: str = ""
    ids: dict[int, list[str]] = field(default_factory=dict)
    names: dict[int, list[str]] = field(default_factory=dict)
    args: dict[int, str] = field(default_factory=dict)
    fragments: dict[int, int] = field(default_factory=dict)
    sent: bool = False


def run_stream(parser, chunks, request=None) -> Streamed:
    stream, out = parser.stream(request), Streamed()
    for delta in [*(stream.feed(c) for c in chunks), stream.finish()]:
        out.content += delta.content
        for frag in delta.tool_calls:
            out.ids.setdefault(frag.index, [])
            out.names.setdefault(frag.index, [])
            if frag.id is not None:
                out.ids[frag.index].append(frag.id)
            if frag.name is not None:
                out.names[frag.index].append(frag.name)
            out.args[frag.index] = out.args.get(frag.index, "") + frag.arguments
            out.fragments[frag.index] = out.fragments.get(frag.index, 0) + 1
    out.sent = stream.tool_calls_sent
    return out


def splits(text: str):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def case_id(case) -> str:
    return f"{case[0]}-{CASES.index(case)}"


def check_extract(parser, text: str, calls: list, content: str | None) -> None:
    """`extract_tool_calls` finds `calls` ([(name, arguments object)]) and `content`; the
    arguments are compact JSON text and every call has its own id."""
    result = parser.extract_tool_calls(text)
    assert result.tools_called
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls
    assert result.content == content
    for call in result.tool_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    assert len({c.id for c in result.tool_calls}) == len(calls)


def check_stream_matches_extract(parser, text: str) -> None:
    """The streaming property (module docstring) for every split of `text`."""
    expected = parser.extract_tool_calls(text)
    for chunks in splits(text):
        got = run_stream(parser, chunks)
        where = f"split {[len(c) for c in chunks][:2]}"
        assert got.content == (expected.content or ""), where
        assert got.sent
        assert sorted(got.args) == list(range(len(expected.tool_calls))), where
        for i, call in enumerate(expected.tool_calls):
            assert got.names[i] == [call.name], where
            assert len(got.ids[i]) == 1, where
            assert got.args[i] == call.arguments, where


def check_all_content(parser, text: str, chunkings) -> None:
    """`text` holds no (well-formed) call: whole and streamed in each of `chunkings`,
    all of it is content and no call is sent."""
    result = parser.extract_tool_calls(text)
    assert not result.tools_called and result.tool_calls == []
    assert result.content == text
    for chunks in chunkings:
        got = run_stream(parser, chunks)
        assert (got.content, got.sent, got.args) == (text, False, {})


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_extract(case):
    name, text, calls, content = case
    check_extract(get_tool_parser(name)(None), text, calls, content)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_stream_matches_extract_for_every_split(case):
    name, text, _, _ = case
    check_stream_matches_extract(get_tool_parser(name)(None), text)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_xml"])
def test_arguments_stream_in_pieces(name):
    """Fed one character at a time, a long call's arguments come in several fragments."""
    text = next(t for n, t, calls, _ in CASES if n == name and len(calls) > 1)
    got = run_stream(get_tool_parser(name)(None), list(text))
    assert got.fragments[0] > 2


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_output_is_content(name, text):
    check_all_content(get_tool_parser(name)(None), text, ([text], list(text)))


@pytest.mark.parametrize(
    "name", ["hermes", "llama3_json", "llama4_pythonic", "mistral", "pythonic", "qwen3_xml"]
)
def test_plain_answers_pass_through(name):
    parser = get_tool_parser(name)(None)
    for text in ["", "Hello! How can I help?\n", "  spaced  "]:
        assert parser.extract_tool_calls(text).content == (text or None)
        assert run_stream(parser, list(text)).content == text


def test_whitespace_between_calls_is_dropped():
    parser = get_tool_parser("hermes")(None)
    text = '\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\n  \n'
    assert parser.extract_tool_calls(text).content is None
    assert run_stream(parser, list(text)).content == ""


def test_qwen3_xml_string_parameters_follow_the_schema():
    tool = {"type": "function", "function": {"name": "write", "parameters": {"properties": {
        "path": {"type": "string"}, "body": {"type": ["string", "null"]}, "n": {"type": "integer"}
    }}}}  # fmt: skip

    class Request:
        tools = [tool]

    text = (
        "<tool_call>\n<function=write>\n<parameter=path>\n123\n</parameter>\n"
        '<parameter=body>\n\nline 1\n\tline 2 "q"\n\n</parameter>\n<parameter=n>\n7\n'
        "</parameter>\n</function>\n</tool_call>"
    )
    parser = get_tool_parser("qwen3_xml")(None)
    call = parser.extract_tool_calls(text, Request()).tool_calls[0]
    assert json.loads(call.arguments) == {"path": "123", "body": '\nline 1\n\tline 2 "q"\n', "n": 7}
    assert json.loads(parser.extract_tool_calls(text).tool_calls[0].arguments)["path"] == 123
    for chunks in splits(text):
        assert run_stream(parser, chunks, Request()).args[0] == call.arguments
    assert run_stream(parser, list(text), Request()).fragments[0] > 10  # strings stream


def test_registry_names_and_unknown_parser():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"} <= set(TOOL_PARSERS)
    assert "llama4_pythonic" in TOOL_PARSERS  # vLLM's name for Llama 4
    with pytest.raises(ValueError, match=r"unknown tool parser 'nope'.*hermes.*qwen3_xml"):
        get_tool_parser("nope")


def test_plugin_from_a_file(tmp_path):
    plugin = tmp_path / "my_tool_parser.py"
    plugin.write_text(
        textwrap.dedent(
            """
            from server.tool_parsers import register_tool_parser
            from server.tool_parsers.hermes import HermesToolParser

            @register_tool_parser("my_plugin_parser")
            class Mine(HermesToolParser):
                pass
            """
        )
    )
    import_tool_parser_plugin(str(plugin))
    try:
        parser = get_tool_parser("my_plugin_parser")(None)
        result = parser.extract_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
        assert result.tool_calls[0].name == "f"
    finally:
        TOOL_PARSERS.pop("my_plugin_parser", None)
    with pytest.raises(ValueError, match="no such file"):
        import_tool_parser_plugin(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="no such file or module"):
        import_tool_parser_plugin("no_such_module_for_tool_parsers")


def test_ids_and_delta_shape():
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", make_tool_call_id())
    mistral = get_tool_parser("mistral")(None)
    call = mistral.extract_tool_calls('[TOOL_CALLS]f[ARGS]{"a": 1}').tool_calls[0]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    first = DeltaToolCall(0, "id1", "f", '{"a"').to_openai()
    assert first == {
        "index": 0,
        "id": "id1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a"'},
    }
    assert DeltaToolCall(0, arguments=": 1}").to_openai() == {
        "index": 0,
        "function": {"arguments": ": 1}"},
    }


class _Request:
    def __init__(self, tools=True, tool_choice="auto") -> None:
        self.tools = [{"type": "function", "function": {"name": "f"}}] if tools else None
        self.tool_choice = tool_choice
        self.skip_special_tokens = True


class _Tokenizer:
    all_special_tokens = ["<s>", "[TOOL_CALLS]", "<|python_tag|>"]


def test_adjust_request_keeps_special_marker_tokens():
    tok = _Tokenizer()
    assert not get_tool_parser("mistral")(tok).adjust_request(_Request()).skip_special_tokens
    assert not get_tool_parser("llama3_json")(tok).adjust_request(_Request()).skip_special_tokens
    assert get_tool_parser("hermes")(tok).adjust_request(_Request()).skip_special_tokens
    mistral = get_tool_parser("mistral")(tok)
    assert mistral.adjust_request(_Request(tools=False)).skip_special_tokens
    assert mistral.adjust_request(_Request(tool_choice="none")).skip_special_tokens
    # without a tokenizer to ask, the markers are assumed special
    assert not get_tool_parser("hermes")(None).adjust_request(_Request()).skip_special_tokens
    assert get_tool_parser("mistral")(tok).adjust_request(object()) is not None


def test_import_leaves_jax_out():
    code = (
        "import sys, server.tool_parsers, jaxengine.reasoning\n"
        "print([m for m in ('jax', 'jaxlib', 'flax', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
