"""vLLM's ``--enable-per-request-metrics`` (a ``metrics`` object on completions and chat
completions) and the paths ``--api-key`` guards.

The metrics tests run on the extra server of conftest.py (`vllm_extras_server`, shared
with test_vllm_fields.py); the default-off and API key tests on the shared `server`,
which runs with an API key and without the flag.
"""

from __future__ import annotations

import time

import httpx
import pytest

from jaxengine.config.arg_utils import FlexibleArgumentParser
from server.api_server.args import add_server_args, check_server_args
from tests.server.conftest import DP1_ONLY, MODEL, SECOND_API_KEY

PROMPT = "Count to ten:"
MESSAGES = [{"role": "user", "content": "Count to ten."}]
FIELDS = {
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
}
FIXED = {"temperature": 0.0, "ignore_eos": True}


def generate(server, path: str, stream: bool = False, **body):
    """A completions or chat request through the openai client, as vLLM's docs show
    it; the extra body fields go through ``extra_body``."""
    client = server.client(max_retries=0, timeout=120)
    extra = {"ignore_eos": body.pop("ignore_eos", True)}
    if path == "completions":
        return client.completions.create(
            model=MODEL, prompt=body.pop("prompt", PROMPT), stream=stream, extra_body=extra, **body
        )
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=stream, extra_body=extra, **body
    )


def check_metrics(metrics: dict, completion_tokens: int, wall_ms: float) -> None:
    """The fields are consistent with each other, with usage, and with the time the
    request took as the client saw it."""
    assert set(metrics) == FIELDS
    ttft, gen, queue = (
        metrics["time_to_first_token_ms"],
        metrics["generation_time_ms"],
        metrics["queue_time_ms"],
    )
    assert ttft > 0 and gen >= 0 and queue >= 0
    # queue -> first token -> last token all happen inside the request
    assert queue + ttft + gen <= wall_ms + 1.0
    assert metrics["mean_itl_ms"] == pytest.approx(gen / (completion_tokens - 1), rel=1e-6)
    tps = completion_tokens / ((ttft + gen) / 1000)
    assert metrics["tokens_per_second"] == pytest.approx(tps, rel=1e-6)


def timed(call):
    start = time.time()
    out = call()
    return out, (time.time() - start) * 1000


# ------------------------------------------------------------- the flag


def test_flag_is_off_by_default_and_needs_stats():
    """vLLM: "Per-request metrics also require server-side statistics logging, which
    is on by default. vLLM rejects `--enable-per-request-metrics` ... when
    `--disable-log-stats` is also set." """
    parse = add_server_args(FlexibleArgumentParser()).parse_args
    assert parse([]).enable_per_request_metrics is False
    check_server_args(parse(["--enable-per-request-metrics"]))
    with pytest.raises(ValueError, match="requires engine statistics logging"):
        check_server_args(parse(["--enable-per-request-metrics", "--disable-log-stats"]))


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_metrics_on_a_response(vllm_extras_server, path):
    """vLLM: "When per-request metrics are enabled, the response includes a `metrics`
    object": `time_to_first_token_ms` (scheduled -> first output token),
    `generation_time_ms` (first -> last output token), `queue_time_ms`, `mean_itl_ms`
    and `tokens_per_second` ("all generated tokens over the inference interval
    (scheduling to last output token)"); read with ``model_extra.get("metrics")``."""
    out, wall = timed(lambda: generate(vllm_extras_server, path, max_tokens=8, **FIXED))
    assert out.usage.completion_tokens == 8
    check_metrics(out.model_extra.get("metrics"), out.usage.completion_tokens, wall)


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_metrics_on_the_final_usage_chunk(vllm_extras_server, path):
    """vLLM: "In streaming responses, metrics are attached to the final usage chunk
    (the chunk sent after all content chunks)"; no other chunk has them."""
    options = {"stream_options": {"include_usage": True}}

    def run():
        return list(generate(vllm_extras_server, path, True, max_tokens=8, **options, **FIXED))

    chunks, wall = timed(run)
    *content, final = chunks
    assert final.choices == [] and final.usage.completion_tokens == 8
    assert all("metrics" not in (c.model_extra or {}) for c in content)
    check_metrics(final.model_extra["metrics"], final.usage.completion_tokens, wall)


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_single_token_has_no_mean_itl(vllm_extras_server, path):
    """vLLM: `mean_itl_ms` is "`null` for single-token responses"; the stream's final
    chunk is serialized without nulls, so there the field is left out."""
    whole = generate(vllm_extras_server, path, max_tokens=1, **FIXED)
    metrics = whole.model_extra["metrics"]
    assert whole.usage.completion_tokens == 1 and set(metrics) == FIELDS
    assert metrics["mean_itl_ms"] is None and metrics["generation_time_ms"] == 0
    chunks = list(generate(vllm_extras_server, path, True, max_tokens=1, **FIXED))
    assert set(chunks[-1].model_extra["metrics"]) == FIELDS - {"mean_itl_ms"}


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_no_metrics_for_several_sequences(vllm_extras_server, path):
    """vLLM: metrics "are suppressed (the `metrics` object is `null`) for requests with
    `n > 1`"; the stream's final chunk then has no `metrics`."""
    body = {"n": 2, "max_tokens": 3, "seed": 0, "temperature": 1.0, "ignore_eos": True}
    whole = generate(vllm_extras_server, path, **body)
    assert len(whole.choices) == 2 and whole.model_extra["metrics"] is None
    chunks = list(generate(vllm_extras_server, path, True, **body))
    assert chunks[-1].choices == [] and "metrics" not in chunks[-1].model_extra


def test_no_metrics_for_several_prompts(vllm_extras_server):
    """vLLM (Completions API): "metrics are omitted for requests with multiple prompts,
    because the timing data cannot be attributed to a single prompt's generation"."""
    two = ["One", "Two"]
    whole = generate(vllm_extras_server, "completions", prompt=two, max_tokens=2, **FIXED)
    assert len(whole.choices) == 2 and whole.model_extra["metrics"] is None
    body = {"prompt": two, "max_tokens": 2, **FIXED}
    chunks = list(generate(vllm_extras_server, "completions", True, **body))
    assert chunks[-1].choices == [] and "metrics" not in chunks[-1].model_extra


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_off_by_default(server, path):
    """Without the flag vLLM's response model leaves `metrics` None: `"metrics": null`
    in a whole response (serialized with every field), absent from every chunk of a
    stream (serialized without nulls)."""
    whole = generate(server, path, max_tokens=2, **FIXED)
    assert "metrics" in whole.model_extra and whole.model_extra["metrics"] is None
    options = {"stream_options": {"include_usage": True}}
    chunks = list(generate(server, path, True, max_tokens=2, **options, **FIXED))
    assert chunks[-1].usage.completion_tokens == 2
    assert all("metrics" not in (c.model_extra or {}) for c in chunks)


# ------------------------------------------------------------- --api-key


GUARDED = [
    ("GET", "/v1/models"),
    ("POST", "/v2/rerank"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/cohere/v2/chat"),
]
OPEN = [
    ("GET", "/health"),
    ("GET", "/ping"),
    ("GET", "/load"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/invocations"),
    ("POST", "/pooling"),
    ("POST", "/score"),
    ("POST", "/rerank"),
    ("POST", "/classify"),
]
BODIES = {
    "/tokenize": {"model": MODEL, "prompt": "Hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
    "/invocations": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
}


def call(server, method: str, path: str, headers: dict) -> httpx.Response:
    body = BODIES.get(path, {"model": MODEL}) if method == "POST" else None
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("method, path", GUARDED)
@DP1_ONLY
def test_api_key_guards_vllm_prefixes(server, method, path):
    """vLLM's AuthenticationMiddleware guards the paths under `/v1`, `/v2`,
    `/inference` and `/cohere`: without the Bearer token (the scheme in any case), 401
    whether or not a route is there."""
    assert call(server, method, path, {}).status_code == 401
    wrong = {"Authorization": "Bearer wrong-key"}
    assert call(server, method, path, wrong).status_code == 401
    lower = {"Authorization": f"bearer {server.api_key}"}
    assert call(server, method, path, lower).status_code != 401


def test_any_of_several_api_keys_is_accepted(vllm_extras_server):
    """vLLM's --api-key takes several keys; a request needs one of them."""
    for key in (vllm_extras_server.api_key, SECOND_API_KEY):
        ok = call(vllm_extras_server, "GET", "/v1/models", {"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    wrong = {"Authorization": f"Bearer {SECOND_API_KEY}x"}
    assert call(vllm_extras_server, "GET", "/v1/models", wrong).status_code == 401


@pytest.mark.parametrize("method, path", OPEN)
def test_api_key_leaves_other_paths_open(server, method, path):
    """vLLM's security guide: "The following endpoints do not require authentication
    even when `--api-key` is configured": /invocations, /pooling, /classify, /score,
    /rerank, /tokenize, /detokenize, /health, /ping, /version, /load (and /metrics)."""
    response = call(server, method, path, {})
    assert response.status_code != 401, response.text
    if path in BODIES or method == "GET":
        assert response.status_code == 200, response.text
