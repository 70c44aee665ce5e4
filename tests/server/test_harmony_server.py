"""gpt-oss's harmony chat format end to end: a real `jaxengine serve` process on a tiny
random gpt-oss with the o200k_harmony tokenizer, asked with the official `openai`
client.

The tokenizer is built offline from the o200k_base vocabulary (`bpe-openai`'s copy,
`jaxengine/tokenizer/harmony.py`) with transformers' tiktoken converter, plus
harmony's special tokens (ids 199998-201087, as gpt-oss's). Random weights write no
harmony of their own, so each request's output is driven by a structured-outputs
grammar naming harmony's special tokens: the model samples within it, the engine
stops on ``<|call|>`` or ``<|return|>`` (stop ids the harmony format adds; the
grammar's last token), and the server must parse the channels out of the token ids.
What the test checks is the server path (harmony rendering of the prompt, its stop
tokens, the id-level parser, chat's whole and streamed answers, the Responses API's
items), not the model's words.
"""

from __future__ import annotations

import base64
import json
import re

import pytest

from tests.server.conftest import API_KEY, start_server, stop_server
from tests.xla_effort import OPTIMIZED

MODEL = "tiny-gpt-oss"
FLAGS = [
    "--api-key", API_KEY,
    "--served-model-name", MODEL,
    "--max-model-len", "512",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "256",
    "--compile-token-buckets", "32", "256",
    "--disable-uvicorn-access-log",
]  # fmt: skip
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ANALYSIS = (
    '<|channel|> "analysis" <|message|> /[a-z]{3,10}( [a-z]{2,8}){0,3}/ <|end|> '
    '<|start|> "assistant" '
)
ANSWER_GRAMMAR = f'start: {ANALYSIS} <|channel|> "final" <|message|> /[a-z]{{2,10}}/ <|return|>'
CALL_GRAMMAR = (
    f'start: {ANALYSIS} <|channel|> "commentary to=functions.get_weather " <|constrain|> '
    '"json" <|message|> "{\\"city\\": \\"" /[a-z]{2,8}/ "\\"}" <|call|>'
)


def _tokenizer(folder) -> None:
    """gpt-oss's tokenizer (o200k_harmony), built from the local o200k_base file."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from jaxengine.tokenizer.harmony import VOCAB_FILE, ensure_harmony_vocab, harmony_encoding

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:  # no tiktoken package
            ranks = {}
            with open(path, "rb") as f:
                for line in f.read().splitlines():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
            return ranks

    encoding = harmony_encoding()
    specials = [encoding.decode([i]) for i in range(199998, 201088)]
    vocab = str(ensure_harmony_vocab() / VOCAB_FILE)
    converted = Converter(vocab, pattern=O200K_PATTERN, extra_special_tokens=specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=converted.converted(),
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )
    text = "Hi <|channel|>analysis<|message|>héllo 123"
    assert tokenizer.encode(text) == encoding.encode(text, allowed_special="all")
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("tiny-gpt-oss")
    config = transformers.GptOssConfig(
        vocab_size=201088,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=512,
        eos_token_id=200002,
        pad_token_id=199999,
        bos_token_id=199998,
    )
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(folder)
    _tokenizer(folder)
    log = tmp_path_factory.mktemp("harmony-server") / "server.log"
    server = start_server(log, [str(folder), *FLAGS], environ=OPTIMIZED)
    yield server
    stop_server(server)


def _grammar(grammar: str) -> dict:
    return {"structured_outputs": {"grammar": grammar}}


def test_chat_answer_reasoning_and_content(harmony_server):
    client = harmony_server.client()
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        reasoning_effort="low",
        max_tokens=60,
        temperature=1.0,
        seed=1,
        extra_body={**_grammar(ANSWER_GRAMMAR), "return_token_ids": True},
    )
    choice = reply.choices[0]
    message = choice.model_dump()["message"]
    assert choice.finish_reason == "stop"
    assert re.fullmatch(r"[a-z]{3,10}( [a-z]{2,8}){0,3}", message["reasoning_content"])
    assert re.fullmatch(r"[a-z]{2,10}", message["content"])
    assert not message.get("tool_calls")
    # the prompt is harmony's: its system message carries the effort, the system
    # message's text went into the developer message
    ids = reply.model_dump()["prompt_token_ids"]
    detok = harmony_server.post("/detokenize", {"model": MODEL, "tokens": ids})
    text = detok.json()["prompt"]
    assert "Reasoning: low" in text and "<|start|>developer" in text and "Be brief." in text
    assert text.endswith("<|start|>assistant")
    # /tokenize renders the same way (no reasoning_effort field there: the default)
    messages = [{"role": "user", "content": "Hi"}]
    tokens = harmony_server.post("/tokenize", {"model": MODEL, "messages": messages}).json()
    detok = harmony_server.post("/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert "Reasoning: medium" in detok.json()["prompt"]
    # generation stopped on <|return|>, the grammar's end and a harmony stop token
    assert choice.model_dump()["token_ids"][-1] == 200002


def test_chat_tool_call_whole_and_streamed(harmony_server):
    client = harmony_server.client()
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        max_tokens=80,
        temperature=1.0,
        seed=3,
        extra_body=_grammar(CALL_GRAMMAR),
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert re.fullmatch(r"[a-z]{2,8}", json.loads(call.function.arguments)["city"])
    assert not whole.message.content
    reasoning = whole.model_dump()["message"]["reasoning_content"]
    assert reasoning

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    streamed_reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    arguments = "".join(t["function"]["arguments"] or "" for t in calls)
    assert streamed_reasoning == reasoning  # same seed: the same tokens
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert arguments == call.function.arguments
    assert sum(1 for d in deltas if d.get("reasoning_content")) > 1  # streamed in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_result_round_trip_renders(harmony_server):
    """History with the assistant's call and the tool's result renders and answers."""
    client = harmony_server.client()
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        tools=[WEATHER],
        max_tokens=60,
        extra_body=_grammar(ANSWER_GRAMMAR),
    )
    assert re.fullmatch(r"[a-z]{2,10}", reply.choices[0].message.content)


def test_forced_tool_choice_is_refused(harmony_server):
    import openai

    with pytest.raises(openai.BadRequestError, match="harmony"):
        harmony_server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[WEATHER],
            tool_choice="required",
        )


def test_responses_reasoning_and_function_call_items(harmony_server):
    client = harmony_server.client()
    response = client.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[{"type": "function", **WEATHER["function"]}],
        max_output_tokens=80,
        temperature=1.0,
        extra_body=_grammar(CALL_GRAMMAR),
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"]
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    assert response.output[0].content[0].text
    usage = response.usage
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
