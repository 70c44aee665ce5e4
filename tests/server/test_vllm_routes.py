"""vLLM's server surface beyond OpenAI's: /tokenize's keys, validation error messages,
logit_bias errors, the batched chat endpoint, SageMaker's /invocations and /ping, the
ORCA load header, /tokenizer_info, ``$VLLM_API_KEY`` and ``--api-server-count``.

Most tests use the shared server; one small extra server (module scope) runs with
``--enable-tokenizer-info-endpoint`` and its key from ``$VLLM_API_KEY`` alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import DP1_ONLY, MODEL, start_server, stop_server
from tests.server.test_errors import check_error, still_serves

CHAT = [{"role": "user", "content": "Hi"}]
GREEDY = {"max_tokens": 4, "temperature": 0}


# ---------------------------------------------------------------------- /tokenize


@DP1_ONLY
def test_tokenize_always_sends_token_strs(server):
    """vLLM's TokenizeResponse has ``token_strs: list[str] | None``: the key is always
    there, null unless ``return_token_strs`` asks for the token strings."""
    plain = server.post("/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert "token_strs" in plain and plain["token_strs"] is None
    asked = {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}
    strs = server.post("/tokenize", asked).json()["token_strs"]
    assert isinstance(strs, list) and len(strs) == plain["count"] > 0


# ---------------------------------------------------------------------- errors


@DP1_ONLY
def test_validation_error_keeps_the_pydantic_error_type(server):
    """vLLM answers a RequestValidationError with 400 and the message
    ``"N validation error(s):"`` followed by each pydantic error (type, loc, msg,
    input, ctx), so the error type (``greater_than_equal``) reaches the client."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "seed": -(2**63) - 1}
    error = check_error(server.post("/v1/completions", body), 400, "1 validation error:")
    assert "'type': 'greater_than_equal'" in error["message"]
    assert "'loc': ('body', 'seed')" in error["message"]
    assert error["param"] == "seed"
    two = {**body, "n": "many"}
    error = check_error(server.post("/v1/completions", two), 400, "2 validation errors:")
    assert "greater_than_equal" in error["message"] and "int_parsing" in error["message"]
    still_serves(server)


@DP1_ONLY
def test_logit_bias_error_names_every_bad_key(server):
    """logit_bias keys are token ids; a request with several bad keys hears of all."""
    bias = {"a": 1.0, "5": 1.0, "b": -1.0}
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logit_bias": bias}
    error = check_error(server.post("/v1/completions", body), 400, "logit_bias")
    assert "'a'" in error["message"] and "'b'" in error["message"]
    negative = {**body, "logit_bias": {"-1": 1.0, "-2": 1.0}}
    error = check_error(server.post("/v1/completions", negative), 400, "logit_bias")
    assert "-1" in error["message"] and "-2" in error["message"]
    still_serves(server)


# ---------------------------------------------------------------------- batch chat


def _chat(server, messages, **fields) -> dict:
    body = {"model": MODEL, "messages": messages, **GREEDY, **fields}
    reply = server.post("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_batch_chat_answers_each_conversation(server):
    """vLLM's /v1/chat/completions/batch: ``messages`` is a list of conversations,
    each processed independently; the response has one choice per conversation,
    indexed 0..N-1, and the usage of them all."""
    conversations = [CHAT, [{"role": "user", "content": "Name a colour."}]]
    body = {"model": MODEL, "messages": conversations, **GREEDY}
    reply = server.post("/v1/chat/completions/batch", body)
    assert reply.status_code == 200, reply.text
    batch = reply.json()
    assert batch["object"] == "chat.completion" and batch["model"] == MODEL
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    singles = [_chat(server, messages) for messages in conversations]
    for choice, single in zip(batch["choices"], singles, strict=True):
        assert choice["message"]["content"] == single["choices"][0]["message"]["content"]
        assert choice["finish_reason"] == single["choices"][0]["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"n": 2}, "n > 1"),
        ({"stream": True}, "streaming"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": [CHAT, []]}, "at least one message"),
        ({"temperature": -1}, "temperature"),
    ],
    ids=["n", "stream", "tools", "empty conversation", "bad field"],
)
@DP1_ONLY
def test_batch_chat_refuses_what_it_cannot_do(server, change, needle):
    """vLLM's batch endpoint supports neither streaming, tools, beam search nor
    ``n`` > 1; any invalid field fails the whole batch."""
    body = {"model": MODEL, "messages": [CHAT, CHAT], **GREEDY, **change}
    check_error(server.post("/v1/chat/completions/batch", body), 400, needle)
    still_serves(server)


# ---------------------------------------------------------------------- SageMaker


def test_invocations_dispatch_by_body(server):
    """SageMaker's /invocations "routes requests based on the request type": a body
    that is a chat completion request is served as one, else a completion request."""
    chat = server.post("/invocations", {"model": MODEL, "messages": CHAT, **GREEDY})
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"] == _chat(server, CHAT)["choices"][0]["message"]
    completion = server.post("/invocations", {"model": MODEL, "prompt": "Hi", **GREEDY})
    assert completion.status_code == 200, completion.text
    assert completion.json()["object"] == "text_completion"
    neither = server.post("/invocations", {"model": MODEL, "input": "Hi"})
    error = check_error(neither, 400, "Cannot find suitable handler for request")
    assert "ChatCompletionRequest" in error["message"]
    bad_json = httpx.post(server.url + "/invocations", content=b"{", headers=server.headers)
    check_error(bad_json, 400, "JSON decode error")


@DP1_ONLY
def test_ping(server):
    """SageMaker's ``/ping`` (GET or POST) is the health check."""
    assert server.get("/ping").status_code == 200
    assert server.post("/ping", {}).status_code == 200


# ---------------------------------------------------------------------- ORCA


def test_orca_load_header(server):
    """A request with ``endpoint-load-metrics-format: TEXT`` (or ``JSON``) gets an
    ``endpoint-load-metrics`` response header with ``kv_cache_usage_perc`` and
    ``num_requests_waiting`` (vLLM's ORCA load report); without it, no header."""
    body = {"model": MODEL, "messages": CHAT, **GREEDY}
    text = server.post(
        "/v1/chat/completions", body, headers={"endpoint-load-metrics-format": "TEXT"}
    )
    value = text.headers["endpoint-load-metrics"]
    assert value.startswith("TEXT "), value
    pairs = dict(p.split("=") for p in value[len("TEXT ") :].split(", "))
    assert set(pairs) == {"named_metrics.kv_cache_usage_perc", "named_metrics.num_requests_waiting"}
    assert all(float(v) >= 0 for v in pairs.values())
    completion = {"model": MODEL, "prompt": "Hi", **GREEDY}
    as_json = server.post(
        "/v1/completions", completion, headers={"endpoint-load-metrics-format": "json"}
    )
    value = as_json.headers["endpoint-load-metrics"]
    assert value.startswith("JSON "), value
    named = json.loads(value[len("JSON ") :])["named_metrics"]
    assert set(named) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert 0.0 <= named["kv_cache_usage_perc"] <= 1.0
    assert "endpoint-load-metrics" not in server.post("/v1/completions", completion).headers


# ---------------------------------------------------------------------- flags


@DP1_ONLY
def test_tokenizer_info_is_off_by_default(server):
    """/tokenizer_info exists only with --enable-tokenizer-info-endpoint."""
    assert server.get("/tokenizer_info").status_code == 404


def test_api_server_count_above_one_is_refused(tmp_path):
    """vLLM's --api-server-count runs several API server processes over one engine
    process; here the engine lives in the one API server's process, so more is
    refused, saying why (before any model loads)."""
    cmd = [sys.executable, "-m", "jaxengine.cli.main", "serve", "--api-server-count", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    assert "--api-server-count=2 is not supported" in done.stderr
    assert "runs inside its API server's process" in done.stderr


VLLM_KEY = "key-from-vllm-env"


@pytest.fixture(scope="module")
def env_server(tiny_smollm2, tmp_path_factory):
    """A small server (the tiny model) whose key comes only from $VLLM_API_KEY, with
    /tokenizer_info."""
    flags = [
        str(tiny_smollm2[0]),
        "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--compile-token-buckets", "32", "--enable-tokenizer-info-endpoint",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    log_path = tmp_path_factory.mktemp("server-vllm-env") / "server.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("JAXENGINE_API_KEY", raising=False)
        patch.setenv("VLLM_API_KEY", VLLM_KEY)
        running = start_server(log_path, flags)
    running.api_key = VLLM_KEY
    yield running
    stop_server(running)


def test_vllm_api_key_is_read(env_server):
    """vLLM reads the API key from --api-key, else from $VLLM_API_KEY: /v1 requests
    without it are refused (401), with it served."""
    url = env_server.url
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer no"}, timeout=30)
    assert wrong.status_code == 401
    assert env_server.get("/v1/models").status_code == 200
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # not guarded


def test_tokenizer_info(env_server):
    """vLLM's /tokenizer_info returns the tokenizer configuration (as in
    tokenizer_config.json, file paths left out) with ``tokenizer_class``."""
    reply = env_server.get("/tokenizer_info")
    assert reply.status_code == 200, reply.text
    info = reply.json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert info["eos_token"] == "<|im_end|>"  # an AddedToken, sent as its text
    assert "{% for message in messages %}" in info["chat_template"]
    assert "vocab_file" not in info and "merges_file" not in info
