"""The server's other routes: tokenization, models, health, version, load, request ids,
the API docs, and the Prometheus metrics after some traffic.
"""

from __future__ import annotations

import time

import httpx

from tests.server.conftest import ALIAS, DP1_ONLY, MODEL

TEXT = "Hello, world! Tokenize me, then put me back together."
CHAT = [{"role": "user", "content": "Hi there"}]

METRICS = [
    "jaxengine:num_requests_running",
    "jaxengine:num_requests_waiting",
    "jaxengine:kv_cache_usage_perc",
    "jaxengine:num_preemptions_total",
]
COUNTERS = [
    "jaxengine:prompt_tokens_total",
    "jaxengine:generation_tokens_total",
    "jaxengine:request_success_total",
    "jaxengine:prefix_cache_queries_total",
    "jaxengine:prefix_cache_hits_total",
]
HISTOGRAMS = [
    "jaxengine:time_to_first_token_seconds",
    "jaxengine:inter_token_latency_seconds",
    "jaxengine:e2e_request_latency_seconds",
    "jaxengine:request_queue_time_seconds",
    "jaxengine:request_prompt_tokens",
    "jaxengine:request_generation_tokens",
]


def wait_for(condition, timeout: float = 10.0) -> bool:
    """Polls ``condition`` (metrics are recorded just after the response is sent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


# ---------------------------------------------------------------------- tokenization


@DP1_ONLY
def test_tokenize_detokenize_round_trip(server):
    response = server.post("/tokenize", {"prompt": TEXT, "model": MODEL})
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == len(body["tokens"]) > 5
    assert body["max_model_len"] == 512
    assert all(isinstance(t, int) for t in body["tokens"])
    back = server.post("/detokenize", {"tokens": body["tokens"], "model": MODEL})
    assert back.status_code == 200
    assert back.json() == {"prompt": TEXT}


@DP1_ONLY
def test_tokenize_token_strings(server):
    body = server.post("/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    assert len(body["token_strs"]) == body["count"]
    assert all(isinstance(s, str) and s for s in body["token_strs"])


@DP1_ONLY
def test_tokenize_chat_messages(server):
    body = server.post("/tokenize", {"messages": CHAT, "model": ALIAS}).json()
    text = server.post("/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert "Hi there" in text
    without = server.post("/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert without["count"] < body["count"]
    assert body["tokens"][: without["count"]] == without["tokens"]


@DP1_ONLY
def test_tokenize_needs_exactly_one_input(server):
    response = server.post("/tokenize", {"prompt": "a", "messages": CHAT})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400


# ---------------------------------------------------------------------- models


@DP1_ONLY
def test_models_lists_both_names(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    assert all(m.object == "model" for m in models.data)
    raw = server.get("/v1/models").json()
    assert raw["object"] == "list"
    assert all(m["max_model_len"] == 512 for m in raw["data"])


def test_alias_serves_requests(client):
    out = client.chat.completions.create(
        model=ALIAS, messages=CHAT, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == ALIAS
    assert out.usage.completion_tokens == 2


# ---------------------------------------------------------------------- small routes


@DP1_ONLY
def test_health_without_key(server):
    response = httpx.get(server.url + "/health", timeout=30)
    assert response.status_code == 200


@DP1_ONLY
def test_version(server):
    version = server.get("/version").json()["version"]
    assert isinstance(version, str) and version


def test_load_counts_requests_in_flight(server):
    assert wait_for(lambda: server.get("/load").json() == {"server_load": 0})
    body = {"model": MODEL, "prompt": "Count to ten:", "max_tokens": 8, "stream": True}
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=server.headers, timeout=120) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.get("/load").json()["server_load"] >= 1
        assert "data: [DONE]" in list(lines)
    assert wait_for(lambda: server.get("/load").json()["server_load"] == 0)


def test_request_id_header_is_echoed(server):
    response = server.get("/v1/models", headers={"X-Request-Id": "my-request-42"})
    assert response.headers["x-request-id"] == "my-request-42"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    response = server.post("/v1/completions", body, headers={"X-Request-Id": "abc"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "abc"
    assert server.get("/health").headers.get("x-request-id")  # one is made up when absent


@DP1_ONLY
def test_docs_and_openapi(server):
    docs = server.get("/docs")
    assert docs.status_code == 200 and "html" in docs.headers["content-type"]
    schema = server.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"):
        assert path in schema["paths"]


# ---------------------------------------------------------------------- metrics


def test_metrics_names(server):
    response = server.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = server.metrics()
    for name in METRICS + COUNTERS:
        assert name in samples, name
    for name in HISTOGRAMS:
        assert f"{name}_count" in samples and f"{name}_sum" in samples, name
        assert f"{name}_bucket" in samples, name
    assert f'model_name="{MODEL}"' in response.text


def test_metrics_count_traffic(server, client):
    idle = ("jaxengine:num_requests_running", "jaxengine:num_requests_waiting")
    assert wait_for(lambda: all(server.metrics()[name] == 0 for name in idle))
    before = server.metrics()
    out = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5

    def delta(name: str) -> float:
        return server.metrics().get(name, 0.0) - before.get(name, 0.0)

    success = "jaxengine:request_success_total{"
    length_key = next(
        k for k in server.metrics() if k.startswith(success) and 'finished_reason="length"' in k
    )
    assert wait_for(lambda: delta(length_key) >= 1)
    assert delta(length_key) == 1
    assert delta("jaxengine:generation_tokens_total") == 5
    assert delta("jaxengine:prompt_tokens_total") > 0
    assert delta("jaxengine:prefix_cache_queries_total") > 0
    for name in HISTOGRAMS:
        assert delta(f"{name}_count") >= 1, name
    assert delta("jaxengine:inter_token_latency_seconds_count") >= 4
    after = server.metrics()
    for name in COUNTERS[:4] + [f"{h}_count" for h in HISTOGRAMS]:
        assert after[name] > 0, name
    assert wait_for(lambda: all(server.metrics()[name] == 0 for name in idle))


@DP1_ONLY
def test_a_generating_model_serves_no_pooling(server):
    """Embeddings, scores and classes from a text-generation server: a 400 naming the
    flag that serves them (as vLLM answers a model without the pooling runner)."""
    embed = server.post("/v1/embeddings", {"model": MODEL, "input": "Hi"})
    assert embed.status_code == 400 and "--runner pooling" in embed.json()["error"]["message"]
    score = server.post("/score", {"model": MODEL, "text_1": "a", "text_2": "b"})
    assert score.status_code == 400 and "classification head" in score.json()["error"]["message"]
