"""gpt-oss's harmony chat format without a model: the offline o200k vocabulary, the
rendering (token ids equal to openai-harmony's own rendering of the same
conversation), and the output parser on completions built with openai-harmony
(reasoning, final content, tool calls; whole and streamed in pieces), also through
the chat view that the server streams with.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from types import SimpleNamespace

import openai_harmony as oh
import pytest

from jaxengine.tokenizer import harmony as vocab
from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import _ChatView
from server.chat_rendering.harmony import HarmonyChatFormat, is_harmony_model
from server.errors import APIError
from server.tool_calls import NO_TOOLS, ToolChoice

TODAY = "2026-11-28"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def fmt() -> HarmonyChatFormat:
    return HarmonyChatFormat(today=TODAY)


@pytest.fixture(scope="module")
def enc():
    return vocab.harmony_encoding()


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m", **{"messages": [{"role": "user", "content": "Hi"}], **kw}
    )


# ---------------------------------------------------------------------- the vocabulary


def test_vocab_is_written_from_the_bpe_openai_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv(vocab.ENV_VAR, raising=False)
    folder = vocab.ensure_harmony_vocab()
    assert folder == tmp_path / "tiktoken"
    data = (folder / vocab.VOCAB_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == vocab.VOCAB_SHA256
    assert vocab.os.environ[vocab.ENV_VAR] == str(folder)


def test_a_corrupt_cached_vocab_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv(vocab.ENV_VAR, raising=False)
    (tmp_path / "tiktoken").mkdir()
    (tmp_path / "tiktoken" / vocab.VOCAB_FILE).write_bytes(b"not a vocabulary")
    folder = vocab.ensure_harmony_vocab()
    data = (folder / vocab.VOCAB_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == vocab.VOCAB_SHA256


def test_a_missing_vocab_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(vocab.ENV_VAR, str(tmp_path / "nowhere"))
    monkeypatch.setattr(vocab.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(vocab.HarmonyVocabError, match="pip install bpe-openai"):
        vocab.ensure_harmony_vocab()


def test_a_user_vocab_folder_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(vocab.ENV_VAR, raising=False)
    data = vocab._packaged_vocab()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / vocab.VOCAB_FILE).write_bytes(data)
    monkeypatch.setenv(vocab.ENV_VAR, str(tmp_path / "mine"))
    assert vocab.ensure_harmony_vocab() == tmp_path / "mine"
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------- rendering


def test_gpt_oss_is_detected_by_type_or_architecture():
    assert is_harmony_model(SimpleNamespace(model_type="gpt_oss"))
    assert is_harmony_model(SimpleNamespace(architectures=["GptOssForCausalLM"]))
    assert not is_harmony_model(SimpleNamespace(model_type="llama", architectures=["X"]))


def _system(effort: oh.ReasoningEffort) -> oh.Message:
    content = (
        oh.SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(TODAY)
    )
    return oh.Message.from_role_and_content(oh.Role.SYSTEM, content)


def test_a_conversation_renders_as_openai_harmony_renders_it(fmt, enc):
    request = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I should call the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
            {"role": "assistant", "content": "Rainy, 4 C."},
            {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
        ],
        tools=[WEATHER],
        reasoning_effort="high",
    )
    fn = WEATHER["function"]
    developer = (
        oh.DeveloperContent.new()
        .with_instructions("Be brief.")
        .with_function_tools(
            [oh.ToolDescription.new(fn["name"], fn["description"], fn["parameters"])]
        )
    )
    A = oh.Role.ASSISTANT
    expected_messages = [
        _system(oh.ReasoningEffort.HIGH),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer),
        oh.Message.from_role_and_content(oh.Role.USER, "Weather in Oslo?"),
        oh.Message.from_role_and_content(A, "I should call the tool.").with_channel("analysis"),
        oh.Message.from_role_and_content(A, '{"city": "Oslo"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        oh.Message.from_author_and_content(
            oh.Author.new(oh.Role.TOOL, "functions.get_weather"), "rain, 4 C"
        )
        .with_channel("commentary")
        .with_recipient("assistant"),
        oh.Message.from_role_and_content(A, "Rainy, 4 C.").with_channel("final"),
        oh.Message.from_role_and_content(oh.Role.USER, "And tomorrow?"),
    ]
    expected = enc.render_conversation_for_completion(
        oh.Conversation.from_messages(expected_messages), A
    )
    ids = fmt.render(request)
    assert ids == list(expected)
    text = enc.decode(ids)
    assert "Reasoning: high" in text
    assert "namespace functions" in text and "type get_weather" in text
    assert text.endswith("<|start|>assistant")


def test_a_plain_chat_renders_system_and_user_only(fmt, enc):
    expected = enc.render_conversation_for_completion(
        oh.Conversation.from_messages(
            [
                _system(oh.ReasoningEffort.MEDIUM),
                oh.Message.from_role_and_content(oh.Role.USER, "Hi"),
            ]
        ),
        oh.Role.ASSISTANT,
    )
    assert fmt.render(chat()) == list(expected)


def test_refusals(fmt):
    with pytest.raises(APIError, match="reasoning_effort"):
        fmt.render(chat(reasoning_effort="max"))
    with pytest.raises(APIError, match="tool_call_id"):
        fmt.render(chat(messages=[{"role": "tool", "tool_call_id": "x", "content": "1"}]))
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with pytest.raises(APIError, match="images"):
        fmt.render(chat(messages=[{"role": "user", "content": [image]}]))
    with pytest.raises(APIError, match="not supported"):
        fmt.check(ToolChoice("required"))
    fmt.check(ToolChoice("auto"))


def test_stop_tokens_are_return_and_call(fmt, enc):
    names = {enc.decode([t]) for t in fmt.stop_token_ids}
    assert names == {"<|return|>", "<|call|>"}


# ---------------------------------------------------------------------- output parsing


def completion(enc, messages: list[oh.Message], last: str) -> list[int]:
    """What gpt-oss writes after the prompt's ``<|start|>assistant``: the messages,
    the last one closed by ``last`` (``<|return|>`` or ``<|call|>``) instead of
    ``<|end|>``."""
    ids: list[int] = []
    for m in messages:
        ids += enc.render(m)
    head = enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(head)] == head
    end = enc.encode(last, allowed_special="all")
    return ids[len(head) : -1] + end


def analysis(text):
    return oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel("analysis")


def final(text):
    return oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel("final")


def call(name, arguments):
    msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, arguments)
    msg = msg.with_channel("commentary").with_recipient(f"functions.{name}")
    return msg.with_content_type("<|constrain|>json")


def ids_counter():
    n = iter(range(1000))
    return lambda: f"call_{next(n)}"


def seq(ids, finish=None):
    return SimpleNamespace(token_ids=ids, text="", finish_reason=finish, stop_reason=None, index=0)


def _pieces(ids, rng):
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out.append(ids[i : i + k])
        i += k
    return out


REASONING = "The user wants the weather; call get_weather with Oslo."
ANSWER = "It is rainy in Oslo, 4 degrees."


def test_reasoning_and_final_content(fmt, enc):
    ids = completion(enc, [analysis(REASONING), final(ANSWER)], "<|return|>")
    parsed = enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    assert [m.channel for m in parsed] == ["analysis", "final"]  # the reference agrees
    parser = fmt.output_parser(chat(), NO_TOOLS, ids_counter())
    message, called = parser.message_of(seq(ids), "assistant")
    assert not called
    assert message["reasoning_content"] == parsed[0].content[0].text == REASONING
    assert message["content"] == parsed[1].content[0].text == ANSWER
    assert "tool_calls" not in message
    hidden = fmt.output_parser(chat(include_reasoning=False), NO_TOOLS, ids_counter())
    assert "reasoning_content" not in hidden.message_of(seq(ids), "assistant")[0]


def test_tool_calls(fmt, enc):
    messages = [analysis(REASONING), call("get_weather", '{"city": "Oslo"}')]
    messages.append(call("get_weather", '{"city": "Bergen"}'))
    ids = completion(enc, messages, "<|call|>")
    parsed = enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    assert [m.recipient for m in parsed] == [None, *["functions.get_weather"] * 2]
    request = chat(tools=[WEATHER])
    message, called = fmt.output_parser(request, ToolChoice("auto"), ids_counter()).message_of(
        seq(ids), "assistant"
    )
    assert called and message["content"] is None
    assert message["reasoning_content"] == REASONING
    assert message["tool_calls"] == [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": p.content[0].text},
        }
        for i, p in enumerate(parsed[1:])
    ]
    serial = chat(tools=[WEATHER], parallel_tool_calls=False)
    one = fmt.output_parser(serial, ToolChoice("auto"), ids_counter())
    assert len(one.message_of(seq(ids), "assistant")[0]["tool_calls"]) == 1
    # tool_choice "none": what the model addressed to a tool is content, not a call
    none = fmt.output_parser(request, NO_TOOLS, ids_counter())
    message, called = none.message_of(seq(ids), "assistant")
    assert not called and "tool_calls" not in message
    assert message["content"] == '{"city": "Oslo"}{"city": "Bergen"}'


@pytest.mark.parametrize("seed", range(3))
def test_streamed_deltas_add_up_to_the_whole(fmt, enc, seed):
    ids = completion(
        enc,
        [analysis(REASONING), final("Let me check."), call("get_weather", '{"city": "Oslo"}')],
        "<|call|>",
    )
    request = chat(tools=[WEATHER])
    parser = fmt.output_parser(request, ToolChoice("auto"), ids_counter())
    whole, _ = parser.message_of(seq(ids), "assistant")
    stream = fmt.output_parser(request, ToolChoice("auto"), ids_counter()).stream()
    deltas = [stream.feed_output(seq(p)) for p in _pieces(ids, random.Random(seed))]
    deltas.append(stream.finish())
    assert "".join(d.reasoning for d in deltas) == whole["reasoning_content"] == REASONING
    assert "".join(d.content for d in deltas) == whole["content"] == "Let me check."
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0] == {
        "index": 0,
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert arguments == whole["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert stream.tools_called
    assert len([d for d in deltas if d.reasoning]) > 1  # really streamed, not at the end


def test_reasoning_tokens_are_the_analysis_messages(fmt, enc):
    """The Responses API's ``reasoning_tokens``: the analysis message's content (and
    its ``<|message|>``), nothing of the final answer."""
    ids = completion(enc, [analysis(REASONING), final(ANSWER)], "<|return|>")
    counter = fmt.reasoning_counter()
    content = counter.content_token_ids(ids)
    analysis_ids = enc.encode(REASONING) + enc.encode("<|message|>", allowed_special="all")
    assert len(ids) - len(content) == len(analysis_ids)
    assert enc.decode(content).endswith("<|channel|>final<|message|>" + ANSWER + "<|return|>")


def test_a_truncated_completion_keeps_what_it_had(fmt, enc):
    ids = completion(enc, [analysis(REASONING), final(ANSWER)], "<|return|>")
    cut = ids[: len(ids) // 2]
    message, _ = fmt.output_parser(chat(), NO_TOOLS, ids_counter()).message_of(seq(cut), "a")
    assert REASONING.startswith(message["reasoning_content"]) and message["reasoning_content"]


def test_the_chat_view_streams_harmony_chunks(fmt, enc):
    """The server's chunk stream (`_ChatView.stream`) over a harmony parser: reasoning,
    content and a tool call, with finish_reason "tool_calls"."""
    ids = completion(
        enc, [analysis(REASONING), call("get_weather", '{"city": "Oslo"}')], "<|call|>"
    )
    pieces = _pieces(ids, random.Random(7))
    request = chat(tools=[WEATHER], stream=True)

    async def outputs():
        for i, p in enumerate(pieces):
            finish = "stop" if i == len(pieces) - 1 else None
            yield 0, SimpleNamespace(outputs=[seq(p, finish)], num_cached_tokens=0)

    options = SimpleNamespace(
        response_role="assistant",
        return_tokens_as_token_ids=False,
        enable_force_include_usage=False,
        enable_prompt_tokens_details=False,
    )
    ctx = SimpleNamespace(options=options, tokenizer=None)
    parser = fmt.output_parser(request, ToolChoice("auto"), ids_counter())
    view = _ChatView(ctx, request, "m", "id", 3, parser)

    async def collect():
        return [chunk async for chunk in view.stream(outputs())]

    chunks = asyncio.run(collect())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(t["function"]["arguments"] for t in calls)
    assert json.loads(arguments) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
