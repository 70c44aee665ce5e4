"""The request-level frontend flags over a fake engine (the real app, no model):
``--enable-log-outputs`` (vLLM's "Generated response" lines, streamed or not),
``--log-error-stack`` (the stack trace of an error answered, in a stream too),
``--trust-request-chat-template`` (a request's own template is refused without it)
and ``--h11-max-header-count`` (431 past the limit)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from jaxengine.config import MultiModalConfig
from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.inputs import PreparedPrompt
from jaxengine.outputs import CompletionOutput, RequestOutput
from jaxengine.sampling_params import RequestOutputKind
from server.api_server.app import build_app
from server.api_server.args import add_server_args
from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import ChatHandler
from server.chat_rendering.messages import UNTRUSTED_TEMPLATE
from server.errors import APIError
from server.output_log import logged_outputs
from server.serving import sse
from tests.unit.logs import captured

PIECES = [(" Hello", [7]), (" world", [8])]


class FakeEngine:
    """What the app and the completions handler read of an engine. Every sequence
    generates " Hello world" (ids 7, 8): in one final output, or in two deltas when
    the request streams."""

    def __init__(self, tokenizer=None) -> None:
        self.max_model_len, self.vocab_size = 64, 100
        self.tokenizer, self.generation_config, self.is_sleeping = tokenizer, None, False
        self.config = SimpleNamespace(
            model_config=SimpleNamespace(model="/m", served_model_names=["m"]),
            structured_outputs_config=SimpleNamespace(
                reasoning_parser_name=None, reasoning_parser_plugin=None
            ),
            lora_config=SimpleNamespace(enable_lora=False),
            multimodal_config=MultiModalConfig(),
        )

    def check_admission(self, num_seqs: int) -> None:
        """No admission caps: every request is admitted."""

    def prepare(self, prompt, params, lora_request=None) -> PreparedPrompt:
        return PreparedPrompt(prompt.get("prompt"), list(prompt["prompt_token_ids"]), params)

    async def generate(self, prepared, params, request_id, priority=0):
        steps = (
            PIECES if params.output_kind == RequestOutputKind.DELTA else [(" Hello world", [7, 8])]
        )
        for step, (text, ids) in enumerate(steps):
            finish = "length" if step == len(steps) - 1 else None
            seqs = [CompletionOutput(i, text, ids, None, None, finish) for i in range(params.n)]
            yield RequestOutput(request_id, None, prepared.token_ids, None, seqs, bool(finish))


def client(*argv: str, tokenizer=None) -> TestClient:
    args = add_server_args(FlexibleArgumentParser()).parse_args(list(argv))
    return TestClient(build_app(FakeEngine(tokenizer), args))


def completion(http: TestClient, **fields):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "request_id": "r", **fields}
    return http.post("/v1/completions", json=body)


# ---------------------------------------------------------------------- --enable-log-outputs


def generated(log) -> list[str]:
    return [m for m in log.messages(logging.INFO) if m.startswith("Generated response")]


def test_outputs_are_logged_with_the_flag():
    http = client("--enable-log-requests", "--enable-log-outputs")
    with captured("jaxengine.server") as log:
        assert completion(http, n=2).json()["choices"][1]["text"] == " Hello world"
    assert (
        generated(log)
        == [
            "Generated response r-0: output: ' Hello world', output_token_ids: [7, 8], "
            "finish_reason: length",
        ]
        * 2
    )  # one line per sequence (n = 2)
    assert any(m.startswith("Received request r-0") for m in log.messages())
    with captured("jaxengine.server") as log:
        completion(client("--enable-log-requests"))  # requests only
    assert generated(log) == [] and any(m.startswith("Received request") for m in log.messages())


def test_streamed_outputs_log_each_delta_then_the_whole():
    http = client("--enable-log-requests", "--enable-log-outputs", "--max-log-len", "4")
    with captured("jaxengine.server") as log:
        lines = completion(http, stream=True).text.splitlines()
    texts = [json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {")]
    assert texts == [" Hello", " world"]
    assert generated(log) == [
        "Generated response r-0 (streaming delta): output: ' Hel', output_token_ids: [7], "
        "finish_reason: None",
        "Generated response r-0 (streaming delta): output: ' wor', output_token_ids: [8], "
        "finish_reason: length",
        "Generated response r-0 (streaming complete): output: ' Hel', output_token_ids: "
        "[7, 8], finish_reason: length",
    ]  # --max-log-len 4 cuts the text (and would cut the ids)


def test_closing_the_logged_stream_closes_the_engine_streams():
    closed = []

    async def source():
        try:
            yield 0, RequestOutput("x-0", None, [1], None, [], False)
            yield 0, RequestOutput("x-0", None, [1], None, [], False)
        finally:
            closed.append(True)

    async def take_one():
        stream = logged_outputs(source(), "x", False, None)
        await anext(stream)
        await stream.aclose()

    asyncio.run(take_one())
    assert closed == [True]


# ---------------------------------------------------------------------- --log-error-stack


def stack_records(log) -> list[logging.LogRecord]:
    return [r for r in log.records if r.levelno == logging.ERROR and r.exc_info]


def test_error_answers_log_their_stack_with_the_flag():
    with captured("jaxengine.server") as log:
        reply = completion(client("--log-error-stack"), model="nope")
    assert reply.status_code == 404  # an unknown model: the answer is unchanged
    (record,) = stack_records(log)
    assert record.getMessage() == (
        "error response 404 to POST /v1/completions: The model `nope` does not exist."
    )
    assert record.exc_info[0] is APIError
    with captured("jaxengine.server") as log:
        assert completion(client(), model="nope").status_code == 404
    assert stack_records(log) == []


def test_stream_errors_log_their_stack_with_the_flag():
    async def failing():
        yield {"a": 1}
        raise APIError("stopped", 400)

    async def events(log_stack: bool) -> list[str]:
        return [e async for e in sse(failing(), log_stack)]

    for log_stack in (True, False):
        with captured("jaxengine.server") as log:
            sent = asyncio.run(events(log_stack))
        assert '"message": "stopped"' in sent[1] and sent[-1] == "data: [DONE]\n\n"
        assert len(stack_records(log)) == (1 if log_stack else 0)


# ---------------------------------------------------------------------- chat templates

MINE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
OTHER = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"


def handler(tokenizer, trust: bool) -> ChatHandler:
    options = SimpleNamespace(
        chat_template=None,
        chat_template_content_format="auto",
        exclude_tools_when_tool_choice_none=False,
        trust_request_chat_template=trust,
    )
    return ChatHandler(SimpleNamespace(options=options, need_tokenizer=lambda: tokenizer))


def test_request_chat_templates_need_trust(smollm2_tokenizer):
    """As vLLM: a request's ``chat_template`` (or ``chat_template_kwargs.chat_template``,
    which wins) is refused unless --trust-request-chat-template; trusted, it renders."""
    messages = [{"role": "user", "content": "Hi"}]
    given = [
        {"chat_template": MINE},
        {"chat_template_kwargs": {"chat_template": MINE}},
        {"chat_template": OTHER, "chat_template_kwargs": {"chat_template": MINE}},
    ]
    for fields in given:
        request = ChatCompletionRequest(messages=messages, **fields)
        with pytest.raises(APIError) as info:
            handler(smollm2_tokenizer, trust=False).render(request)
        assert (info.value.message, info.value.status) == (UNTRUSTED_TEMPLATE, 400)
        ids = handler(smollm2_tokenizer, trust=True).render(request)
        assert smollm2_tokenizer.decode(ids) == "[Hi]"
    plain = ChatCompletionRequest(messages=messages)  # the tokenizer's template: no trust needed
    assert "<|im_start|>" in smollm2_tokenizer.decode(
        handler(smollm2_tokenizer, False).render(plain)
    )


def test_request_chat_template_over_http(smollm2_tokenizer):
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": MINE}
    reply = client(tokenizer=smollm2_tokenizer).post("/tokenize", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        "Chat template is passed with request, but --trust-request-chat-template is not "
        "set. Refused request with untrusted chat template."
    )
    trusted = client("--trust-request-chat-template", tokenizer=smollm2_tokenizer)
    tokens = trusted.post("/tokenize", json={**body, "add_special_tokens": False}).json()["tokens"]
    assert smollm2_tokenizer.decode(tokens) == "[Hi]"


# ---------------------------------------------------------------------- --h11-max-header-count


def test_requests_with_too_many_headers_get_431():
    http = client("--h11-max-header-count", "12")
    assert http.get("/version").status_code == 200  # TestClient sends 5 headers
    many = {f"x-extra-{i}": "1" for i in range(8)}
    reply = http.get("/version", headers=many)
    assert reply.status_code == 431
    assert reply.json()["error"]["message"] == (
        "Request Header Fields Too Large: 13 headers, more than --h11-max-header-count 12"
    )
    assert client().get("/version", headers=many).status_code == 200  # 256 by default
