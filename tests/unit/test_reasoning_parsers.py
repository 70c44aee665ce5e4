"""Reasoning parsers: `<think>` splitting on text (whole and streamed) and on token ids."""

from __future__ import annotations

import textwrap

import pytest

from jaxengine.reasoning import (
    REASONING_PARSERS,
    get_reasoning_parser,
    import_reasoning_parser_plugin,
)

# (parser, model output, reasoning, content)
CASES = [
    (
        "deepseek_r1",
        "Let me think.\n</think>\n\nThe answer is 4.",
        "Let me think.",
        "The answer is 4.",
    ),
    (
        "deepseek_r1",
        "<think>\nStep 1 😀\n\nStep 2\n</think>\n\nDone",
        "Step 1 😀\n\nStep 2",
        "Done",
    ),
    ("deepseek_r1", "still thinking when cut </th", "still thinking when cut </th", None),
    ("deepseek_r1", "<think>a</think>", "a", None),
    ("deepseek_r1", "</think>only content\n", None, "only content\n"),
    ("deepseek_r1", "", None, None),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "x</think>y</think>z", "x", "y</think>z"),
    ("qwen3", "<think>\nhmm, 2+2\n</think>\n\n4", "hmm, 2+2", "4"),
    ("qwen3", "<think>\n\n</think>\n\n4", None, "4"),
    ("qwen3", "<think>cut off mid-thought", "cut off mid-thought", None),
    ("qwen3", "Thinking disabled: a plain answer.", None, "Thinking disabled: a plain answer."),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "", None, None),
    ("qwen3", "a < b and c </ d", None, "a < b and c </ d"),
    # GLM-4.5 writes "\n<think>" after <|assistant|>: the newlines go with the marker
    ("glm45", "\n<think>Let me see.\n</think>\nThe answer.", "Let me see.", "The answer."),
    ("glm45", "<think>cut off", "cut off", None),
    ("glm45", "\n\n<think></think>\n\n4", None, "4"),
    ("glm45", "\n\nThinking off: an answer.", None, "\n\nThinking off: an answer."),
    ("glm45", "\n<thi", None, "\n<thi"),
    ("glm45", "\n", None, "\n"),
    ("glm45", "", None, None),
]


def splits(text: str):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def run_stream(parser, chunks) -> tuple[str, str]:
    stream, reasoning, content = parser.stream(), "", ""
    for r, c in [*(stream.feed(chunk) for chunk in chunks), stream.finish()]:
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_extract(name, text, reasoning, content):
    assert get_reasoning_parser(name)(None).extract(text) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_stream_matches_extract_for_every_split(name, text, reasoning, content):
    parser = get_reasoning_parser(name)(None)
    for chunks in splits(text):
        assert run_stream(parser, chunks) == (reasoning or "", content or ""), chunks


def test_partial_end_marker_is_held_back():
    stream = get_reasoning_parser("deepseek_r1")(None).stream()
    assert stream.feed("abc\n</th") == ("abc", "")
    assert stream.feed("ink>\n\nHi") == ("", "Hi")
    assert stream.finish() == ("", "")
    stream = get_reasoning_parser("qwen3")(None).stream()
    assert stream.feed("<th") == ("", "")  # may still become <think>
    assert stream.feed("ink>x") == ("x", "")
    stream = get_reasoning_parser("glm45")(None).stream()
    assert stream.feed("\n\n") == ("", "")  # newlines may still precede <think>
    assert stream.feed("<think>x") == ("x", "")


def test_qwen3_without_leading_think():
    """extract still splits at `</think>` (template opened the block in the prompt);
    the stream, which has sent the text as content by then, passes it through."""
    parser = get_reasoning_parser("qwen3")(None)
    text = "reasoning here\n</think>\n\nanswer"
    assert parser.extract(text) == ("reasoning here", "answer")
    assert run_stream(parser, list(text)) == ("", text)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


THINK_VOCAB = {"<think>": 7, "</think>": 8, "a": 1, "b": 2}


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3", "glm45"])
def test_token_ids(name):
    parser = get_reasoning_parser(name)(FakeTokenizer(THINK_VOCAB))
    assert (parser.start_token_id, parser.end_token_id) == (7, 8)
    assert not parser.is_reasoning_end([])
    assert not parser.is_reasoning_end([7, 1, 2])
    assert parser.content_token_ids([7, 1, 2]) == []
    assert parser.is_reasoning_end([7, 1, 8])
    assert parser.content_token_ids([7, 1, 8]) == []
    assert parser.content_token_ids([1, 8, 2, 1]) == [2, 1]
    # a think block reopened after an earlier one closed (prompt + output ids)
    assert not parser.is_reasoning_end([7, 8, 1, 7, 2])
    assert parser.content_token_ids([7, 8, 1, 7, 2, 8, 1]) == [1]


def test_missing_end_token_is_an_error():
    with pytest.raises(ValueError, match=r"'deepseek_r1'.*'</think>'"):
        get_reasoning_parser("deepseek_r1")(FakeTokenizer({"<think>": 1, "a": 2}))
    with pytest.raises(ValueError, match=r"'qwen3'.*'</think>'"):
        get_reasoning_parser("qwen3")(FakeTokenizer({"a": 2}))
    with pytest.raises(ValueError, match="without a tokenizer"):
        get_reasoning_parser("qwen3")(None).is_reasoning_end([1])


def test_registry_and_unknown_name():
    assert {"deepseek_r1", "glm45", "qwen3"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope'.*deepseek_r1.*qwen3"):
        get_reasoning_parser("nope")


def test_plugin_from_a_file(tmp_path):
    plugin = tmp_path / "my_reasoner.py"
    plugin.write_text(
        textwrap.dedent(
            """
            from jaxengine.reasoning import register_reasoning_parser
            from jaxengine.reasoning.think import ThinkingParser

            @register_reasoning_parser("my_reasoner")
            class Mine(ThinkingParser):
                name = "my_reasoner"
                implicit = False
            """
        )
    )
    import_reasoning_parser_plugin(str(plugin))
    try:
        parser = get_reasoning_parser("my_reasoner")(None)
        assert parser.extract("<think>r</think>c") == ("r", "c")
    finally:
        REASONING_PARSERS.pop("my_reasoner", None)
    with pytest.raises(ValueError, match="no such file"):
        import_reasoning_parser_plugin(str(tmp_path / "missing.py"))
