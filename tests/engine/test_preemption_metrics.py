"""``/metrics`` after preemption, over the real engine: the app on the shared tiny
engine (`tiny_llm`: 24 KV blocks, in this process, no server started) serves one
completion whose eight sequences do not fit the cache together, so the scheduler
preempts some of them. vLLM's ``request_num_preemptions`` histogram then holds one
observation for the request, whose value is every preemption the scheduler made
meanwhile, and the prefix-cache state gauges describe the cache.
The families without a model: tests/unit/test_metrics.py; on a served engine:
tests/server/test_vllm_metrics.py."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.factory import prometheus_logger
from server.api_server.args import add_server_args


def _samples(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:") and "le" not in s.labels
    }


def _recorded(client: TestClient, seconds: float = 10.0) -> dict[str, float]:
    """The samples once the finished request is in them: the reply can reach the
    client before the engine's loop hands that step's stats to the logger."""
    deadline = time.monotonic() + seconds
    samples = _samples(client)
    while not samples.get("vllm:e2e_request_latency_seconds_count") and time.monotonic() < deadline:
        time.sleep(0.05)
        samples = _samples(client)
    return samples


def test_a_preempted_request_shows_in_the_histogram(tiny_llm):
    from server.api_server.app import build_app

    engine = tiny_llm.engine
    model = engine.config.model_config.served_model_names[0]
    metrics = prometheus_logger(engine, model)
    before = engine.get_stats().num_preemptions  # (the shared engine's earlier tests')
    engine.take_iteration_stats()  # and their finished requests, which nobody recorded
    async_llm = AsyncLLM(engine.config, engine=engine, stat_loggers=[metrics])
    args = add_server_args(FlexibleArgumentParser()).parse_args([])
    try:
        app = build_app(async_llm, args, metrics)
        with TestClient(app) as client:
            body = {
                "model": model,
                "prompt": "Once upon a time",
                "n": 8,  # 8 x 69 tokens > the 24 blocks of 16 tokens
                "max_tokens": 64,
                "temperature": 1.0,
                "seed": 0,
                "ignore_eos": True,
            }
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 8 * 64
            after = _recorded(client)
    finally:
        async_llm.shutdown(shutdown_engine=False)
        engine.abort_request(list(engine.outputs.requests))
    preemptions = engine.get_stats().num_preemptions - before
    assert preemptions > 0
    assert after["vllm:request_num_preemptions_count"] == 1
    assert after["vllm:request_num_preemptions_sum"] == preemptions
    assert after["vllm:num_kv_cache_total_blocks"] == 23  # 24 less the null block
    cached = after["vllm:num_prefix_cached_blocks"]
    assert after["vllm:num_prefix_cached_tokens"] == 16 * cached
    assert after["vllm:prefix_cache_usage_perc"] == cached / 23
