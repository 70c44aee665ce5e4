"""``--otlp-traces-endpoint`` over the real engine: the app on the shared tiny engine
(`tiny_llm`, in this process: no server is started) exports one ``llm_request`` span
per request to an in-process OTLP/HTTP collector, for completions, streamed chat and
the APIs over chat (Responses, Anthropic Messages). Each span is the child of the
``traceparent`` its request sent, and its token counts are the response's usage.
The flags and both protocols without a model: tests/unit/test_server_tracing.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.entrypoints.async_llm import AsyncLLM
from server.api_server.args import add_server_args
from server.tracing import PROTOCOL_ENV, SpanAttributes
from tests.otlp_collector import OtlpCollector

A = SpanAttributes
MESSAGES = [{"role": "user", "content": "Say hello."}]


def traceparent(number: int) -> tuple[str, str, str]:
    """(header, trace id, parent span id) of the ``number``-th request."""
    trace_id, span_id = f"{number:032x}", f"{number + 0xABC:016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture
def traced(tiny_llm, monkeypatch):
    """(TestClient of the app with tracing on, the collector, the served name)."""
    from server.api_server.app import build_app

    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    engine = tiny_llm.engine
    async_llm = AsyncLLM(engine.config, engine=engine)
    try:
        with OtlpCollector("http/protobuf") as collector:
            argv = ["--otlp-traces-endpoint", collector.endpoint]
            app = build_app(async_llm, add_server_args(FlexibleArgumentParser()).parse_args(argv))
            with TestClient(app) as client:
                yield client, collector, app.state.ctx.model_name
    finally:
        async_llm.shutdown(shutdown_engine=False)
        engine.abort_request(list(engine.outputs.requests))


def _post(client, path: str, body: dict, number: int) -> dict:
    reply = client.post(path, json=body, headers={"traceparent": traceparent(number)[0]})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _streamed_usage(client, body: dict, number: int) -> dict:
    headers = {"traceparent": traceparent(number)[0]}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        chunks = [
            json.loads(line[6:])
            for line in reply.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    return chunks[-1]["usage"]


def test_each_api_exports_its_span(traced):
    client, collector, model = traced
    common = {"model": model, "temperature": 0.0}
    usages = {
        1: _post(client, "/v1/completions", {**common, "prompt": "Hi", "max_tokens": 5}, 1)[
            "usage"
        ],
        2: _streamed_usage(
            client,
            {
                **common,
                "messages": MESSAGES,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            2,
        ),  # fmt: skip
        3: _post(client, "/v1/responses", {**common, "input": "Hi", "max_output_tokens": 6}, 3)[
            "usage"
        ],
        4: _post(client, "/v1/messages", {**common, "messages": MESSAGES, "max_tokens": 3}, 4)[
            "usage"
        ],
    }
    assert client.app.state.ctx.tracer.force_flush()
    spans = {span.trace_id: span for span in collector.spans}
    assert len(collector.spans) == len(spans) == 4  # one span per request
    for number, usage in usages.items():
        _, trace_id, parent_id = traceparent(number)
        span = spans[trace_id]
        assert (span.name, span.kind, span.parent_span_id) == ("llm_request", "SERVER", parent_id)
        attributes = span.attributes
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        assert attributes[A.GEN_AI_USAGE_PROMPT_TOKENS] == prompt > 0
        assert attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] == completion > 0
        assert attributes[A.GEN_AI_RESPONSE_MODEL] == model
        assert attributes[A.GEN_AI_REQUEST_TEMPERATURE] == 0.0
        assert attributes[A.GEN_AI_REQUEST_N] == 1
        _check_times(span)


def _check_times(span) -> None:
    """The latencies are the engine's, consistent with each other and the span."""
    a = span.attributes
    e2e = a[A.GEN_AI_LATENCY_E2E]
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(
        e2e, abs=1e-6
    )
    queue, ttft = a[A.GEN_AI_LATENCY_TIME_IN_QUEUE], a[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN]
    prefill, decode = (
        a[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL],
        a[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE],
    )
    assert 0 <= queue <= ttft <= e2e and prefill >= 0 and decode >= 0
    assert queue + prefill == pytest.approx(ttft, abs=1e-9)
    assert a[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] == pytest.approx(prefill + decode, abs=1e-9)
