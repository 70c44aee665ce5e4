"""vLLM's extra response fields of /v1/completions and /v1/chat/completions.

`prompt_logprobs`, `return_token_ids`, `logprob_token_ids`, `truncation_side`, the
`stream_options` defaults, and (on the extra server of conftest.py, started with
``--enable-force-include-usage --max-logprobs -1``) usage on every chunk and
logprobs over the whole vocabulary. Each test quotes the vLLM behaviour it checks.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.server.conftest import DP1_ONLY, MODEL

PROMPT = "My name is"
MESSAGES = [{"role": "user", "content": "Name a color."}]
VOCAB_SIZE = 49152  # SmolLM2's vocabulary
GREEDY = {"temperature": 0.0}


def completion(server, **body) -> dict:
    response = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(server, **body) -> dict:
    response = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    return response.json()


def sse(server, path: str, body: dict) -> list[dict]:
    """The JSON payloads of a streamed response (without ``[DONE]``)."""
    import httpx

    payloads = []
    with httpx.stream(
        "POST", server.url + path, json={"model": MODEL, **body, "stream": True},
        headers=server.headers, timeout=300,
    ) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payloads.append(json.loads(line[len("data: ") :]))
    return payloads


def tokens_of(server, body: dict) -> list[int]:
    response = server.post("/tokenize", {"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def bad_request(response, wording: str) -> None:
    assert response.status_code == 400, response.text
    assert wording in response.json()["error"]["message"]


def check_prompt_logprobs(entries: list, prompt_ids: list[int], most: int) -> None:
    """vLLM's shape: one entry per prompt token, the first null, each other a dict
    token-id string -> {logprob, rank, decoded_token} holding the prompt token."""
    assert len(entries) == len(prompt_ids)
    assert entries[0] is None
    for token, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        assert str(token) in entry and 1 <= len(entry) <= most
        for value in entry.values():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert value["logprob"] <= 0 and value["rank"] >= 1
            assert isinstance(value["decoded_token"], str)
        assert any(v["rank"] == 1 for v in entry.values())


def logsumexp(values) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


# ------------------------------------------------------------------ prompt_logprobs


def test_completion_prompt_logprobs(server):
    """vLLM: `prompt_logprobs` "Number of log probabilities to return per prompt
    token"; the completions response carries them per choice (`prompt_logprobs`),
    also when `echo` with `logprobs` asks for them ("if prompt_logprobs is None and
    echo: prompt_logprobs = logprobs")."""
    prompt_ids = tokens_of(server, {"prompt": PROMPT})
    out = completion(server, max_tokens=2, prompt_logprobs=1, n=2, temperature=1.0, seed=1)
    for choice in out["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], prompt_ids, most=2)
    echoed = completion(server, max_tokens=2, echo=True, logprobs=1, **GREEDY)["choices"][0]
    check_prompt_logprobs(echoed["prompt_logprobs"], prompt_ids, most=2)
    assert echoed["logprobs"]["token_logprobs"][0] is None  # the first prompt token
    plain = completion(server, max_tokens=2, **GREEDY)["choices"][0]
    assert plain["prompt_logprobs"] is None


def test_chat_prompt_logprobs_at_top_level(server):
    """vLLM: the chat response's top-level `prompt_logprobs` (one entry per prompt
    token of the rendered conversation)."""
    prompt_ids = tokens_of(server, {"messages": MESSAGES})
    out = chat(server, max_tokens=2, prompt_logprobs=2, **GREEDY)
    check_prompt_logprobs(out["prompt_logprobs"], prompt_ids, most=3)
    assert chat(server, max_tokens=2, **GREEDY)["prompt_logprobs"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@DP1_ONLY
def test_prompt_logprobs_refused_when_streaming(server, path):
    """vLLM: "`prompt_logprobs` are not available when `stream=True`." (400)."""
    body = {"model": MODEL, "prompt": PROMPT, "messages": MESSAGES, "max_tokens": 2}
    response = server.post(path, {**body, "stream": True, "prompt_logprobs": 1})
    bad_request(response, "`prompt_logprobs` are not available when `stream=True`.")


# ------------------------------------------------------------------ stream_options


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_empty_stream_options_send_no_usage(server, path):
    """vLLM's `StreamOptions`: `include_usage` defaults to False, so
    `stream_options: {}` streams no usage."""
    body = {"prompt": PROMPT, "messages": MESSAGES, "max_tokens": 3, **GREEDY}
    chunks = sse(server, path, {**body, "stream_options": {}})
    assert chunks and all(c.get("usage") is None for c in chunks)
    assert all(c["choices"] for c in chunks)  # no usage-only chunk
    with_usage = sse(server, path, {**body, "stream_options": {"include_usage": True}})
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 3


# ------------------------------------------------------------------ return_token_ids


def test_completion_return_token_ids(server):
    """vLLM: "If specified, the result will include token IDs alongside the
    generated text. In streaming mode, prompt_token_ids is included only in the first
    chunk, and token_ids contains the delta tokens for each chunk." (per choice)."""
    prompt_ids = tokens_of(server, {"prompt": PROMPT})
    out = completion(server, max_tokens=4, return_token_ids=True, ignore_eos=True, **GREEDY)
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] == 4
    detok = server.post("/detokenize", {"model": MODEL, "tokens": choice["token_ids"]})
    assert detok.json()["prompt"] == choice["text"]
    body = {"prompt": PROMPT, "max_tokens": 4, "return_token_ids": True, "ignore_eos": True}
    chunks = [c["choices"][0] for c in sse(server, "/v1/completions", {**body, **GREEDY})]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    plain = completion(server, max_tokens=2, **GREEDY)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    # vLLM: with return_token_ids, echo returns the prompt as ids, not as text
    echoed = completion(server, max_tokens=4, echo=True, return_token_ids=True, **GREEDY)
    assert echoed["choices"][0]["text"] == choice["text"]


def test_chat_return_token_ids(server):
    """vLLM: chat returns the prompt's ids at the top level (`prompt_token_ids`; when
    streaming, in the first chunk) and each choice's `token_ids` (streamed: the delta's
    ids in every chunk)."""
    prompt_ids = tokens_of(server, {"messages": MESSAGES})
    body = {"max_tokens": 4, "return_token_ids": True, "ignore_eos": True, **GREEDY}
    out = chat(server, **body)
    assert out["prompt_token_ids"] == prompt_ids
    token_ids = out["choices"][0]["token_ids"]
    assert len(token_ids) == out["usage"]["completion_tokens"] == 4
    chunks = sse(server, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    streamed = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    assert streamed == token_ids
    plain = chat(server, max_tokens=2, **GREEDY)
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


# ------------------------------------------------------------------ kv_transfer_params


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_kv_transfer_params_without_a_kv_connector(server, path):
    """vLLM's `kv_transfer_params` ("KVTransfer parameters used for disaggregated
    serving") go to its KV connector; with none configured (no --kv-transfer-config)
    the request is served as usual and the response's `kv_transfer_params` is null
    (`final_res.kv_transfer_params`). The same output as without the field."""
    handshake = {"do_remote_decode": True, "do_remote_prefill": False}
    body = {"model": MODEL, "prompt": PROMPT, "messages": MESSAGES, "max_tokens": 3, **GREEDY}
    plain = server.post(path, body).json()
    response = server.post(path, {**body, "kv_transfer_params": handshake})
    assert response.status_code == 200, response.text
    out = response.json()
    assert "kv_transfer_params" in out and out["kv_transfer_params"] is None
    assert plain["kv_transfer_params"] is None
    assert out["choices"] == plain["choices"]


# ------------------------------------------------------------------ truncation_side


def test_truncation_side(server):
    """vLLM: `truncation_side` "Which side to truncate from when
    truncate_prompt_tokens is active. 'right' keeps the first N tokens. 'left' keeps
    the last N tokens." (left by default)."""
    ids = tokens_of(server, {"prompt": "one two three four five six seven eight"})
    body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 3, **GREEDY}

    def kept(**extra) -> list[int]:
        out = completion(server, **{**body, **extra, "return_token_ids": True})
        assert out["usage"]["prompt_tokens"] == 3
        return out["choices"][0]["prompt_token_ids"]

    assert kept() == kept(truncation_side="left") == ids[-3:]
    assert kept(truncation_side="right") == ids[:3]
    text = completion(server, **body, truncation_side="right", echo=True)["choices"][0]["text"]
    detok = server.post("/detokenize", {"model": MODEL, "tokens": ids[:3]}).json()["prompt"]
    assert text.startswith(detok)
    messages = [{"role": "user", "content": "a b c d e f g h i j"}]
    rendered = tokens_of(server, {"messages": messages})
    out = chat(
        server, messages=messages, max_tokens=1, truncate_prompt_tokens=4,
        truncation_side="right", return_token_ids=True,
    )  # fmt: skip
    assert out["prompt_token_ids"] == rendered[:4]
    bad = server.post("/v1/completions", {**body, "model": MODEL, "truncation_side": "middle"})
    assert bad.status_code == 400


# ------------------------------------------------------------------ logprob_token_ids


def test_completion_logprob_token_ids(server):
    """vLLM: `logprob_token_ids` "Specific vocab token IDs to return logprobs for at
    each generated position, in addition to the sampled token ... this explicit token
    selection takes precedence over the natural top-k selected by `logprobs`.
    Requires `logprobs` to be set." The logprobs are the same the top-k reports."""
    base = {"max_tokens": 3, "return_tokens_as_token_ids": True, **GREEDY}
    top = completion(server, logprobs=5, **base)["choices"][0]["logprobs"]
    first = top["top_logprobs"][0]
    wanted = [int(k.split(":")[1]) for k in first][:3] + [1000, 7]
    out = completion(server, logprobs=0, logprob_token_ids=wanted, **base)["choices"][0]
    assert out["text"] == completion(server, logprobs=5, **base)["choices"][0]["text"]
    logprobs = out["logprobs"]
    assert logprobs["tokens"] == top["tokens"]
    for token, entry in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert set(entry) == {token} | {f"token_id:{t}" for t in wanted}
    for key in list(first)[:3]:
        assert logprobs["top_logprobs"][0][key] == pytest.approx(first[key], abs=1e-4)
    if "token_id:1000" not in first:  # not in the top 5: less likely than all of them
        assert logprobs["top_logprobs"][0]["token_id:1000"] <= min(first.values())


def test_chat_logprob_token_ids(server):
    """vLLM: with `logprob_token_ids`, each position's `top_logprobs` holds the
    sampled token and every requested id (`top_logprobs` no longer chooses them)."""
    wanted = [15, 3000, 42]
    out = chat(
        server, max_tokens=3, logprobs=True, top_logprobs=1, logprob_token_ids=wanted,
        return_tokens_as_token_ids=True, **GREEDY,
    )  # fmt: skip
    for item in out["choices"][0]["logprobs"]["content"]:
        names = [t["token"] for t in item["top_logprobs"]]
        assert names[0] == item["token"]
        assert set(names[1:]) | {item["token"]} == {item["token"]} | {
            f"token_id:{t}" for t in wanted
        }


@pytest.mark.parametrize(
    "extra, wording",
    [
        ({"logprob_token_ids": [1, 2]}, "`logprobs` must be set"),
        ({"logprobs": 1, "logprob_token_ids": []}, "must not be an empty list"),
        ({"logprobs": 1, "logprob_token_ids": [VOCAB_SIZE]}, "out of the vocabulary"),
        ({"logprobs": 1, "logprob_token_ids": list(range(129))}, "max allowed: 128"),
    ],
)
@DP1_ONLY
def test_bad_logprob_token_ids(server, extra, wording):
    """vLLM refuses `logprob_token_ids` without `logprobs`, an empty list, ids out of
    the vocabulary and more than 128 ids (400)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **extra}
    bad_request(server.post("/v1/completions", body), wording)


@DP1_ONLY
def test_whole_vocabulary_needs_max_logprobs(server):
    """vLLM: -1 asks for all `vocab_size` logprobs, refused beyond `--max-logprobs`
    (20 by default): "Requested logprobs of 49152, which is greater than max allowed"."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "logprobs": -1}
    bad_request(server.post("/v1/completions", body), "greater than max allowed: 20")


# ------------------------------------------------- --enable-force-include-usage, -1


@pytest.fixture(scope="module")
def vocab_server(vllm_extras_server):
    """The shared extra server (conftest.py), which runs with
    ``--enable-force-include-usage --max-logprobs -1``."""
    return vllm_extras_server


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_force_include_usage_on_every_chunk(vocab_server, path):
    """vLLM's `should_include_usage`: with `--enable-force-include-usage` usage is
    included and continuous (on every chunk), whatever the request's
    `stream_options`, and the stream ends with a usage-only chunk."""
    body = {"prompt": PROMPT, "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True}
    for options in ({}, {"stream_options": {"include_usage": False}}):
        chunks = sse(vocab_server, path, {**body, **options, **GREEDY})
        assert all(c["usage"] is not None for c in chunks)
        *content, final = chunks
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3
        counts = [c["usage"]["completion_tokens"] for c in content]
        assert counts == sorted(counts) and counts[-1] == 3


def test_whole_vocabulary_logprobs(vocab_server):
    """vLLM: "When set to -1, return all `vocab_size` log probabilities" (chat
    `top_logprobs`, completions `logprobs` and `prompt_logprobs`), allowed by
    `--max-logprobs -1`; their probabilities sum to 1. (vLLM's completions handler
    drops them, vllm-project/vllm#55717; its validator and engine mean the whole
    vocabulary, which is what jaxengine returns.)"""
    ids = {"return_tokens_as_token_ids": True, "max_tokens": 1, **GREEDY}
    out = completion(vocab_server, logprobs=-1, prompt_logprobs=-1, **ids)["choices"][0]
    (top,) = out["logprobs"]["top_logprobs"]
    assert len(top) == VOCAB_SIZE and logsumexp(top.values()) == pytest.approx(0, abs=1e-3)
    for entry in out["prompt_logprobs"][1:]:
        assert len(entry) == VOCAB_SIZE
        assert logsumexp([v["logprob"] for v in entry.values()]) == pytest.approx(0, abs=1e-3)
    reply = chat(vocab_server, logprobs=True, top_logprobs=-1, **ids)
    (item,) = reply["choices"][0]["logprobs"]["content"]
    assert len({t["token"] for t in item["top_logprobs"]}) == VOCAB_SIZE
    # the explicit ids report the same values as the whole vocabulary
    wanted = [0, 1000, 30000, VOCAB_SIZE - 1]
    chosen = completion(vocab_server, logprobs=1, logprob_token_ids=wanted, **ids)
    (picked,) = chosen["choices"][0]["logprobs"]["top_logprobs"]
    for t in wanted:
        assert picked[f"token_id:{t}"] == pytest.approx(top[f"token_id:{t}"], abs=1e-4)
    assert "XLA compilation after warm-up" not in vocab_server.log_path.read_text()
